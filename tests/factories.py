"""Factory-built passes and regions for fast diagnosis tests (no torch run needed)."""

from __future__ import annotations

from ac_diff.passes import External, InputRef, OpRecord, Pass, Position, Region, Run, TensorMeta


def meta(*shape: int, dtype: str = "f32") -> TensorMeta:
    return TensorMeta(tuple(shape), dtype)


def op(index: int, name: str, *, module: str = "m", out=None, refs=None, fp=None, args=None, values=None,
       random: bool = False, host=None) -> OpRecord:
    return OpRecord(index=index, op=name, module=module, source=f"model.py:{10 + index} in forward",
                    out=out if out is not None else [meta(4, 4)], input_refs=refs or [], fingerprint=fp,
                    args=args or [], values=values, random=random, host_value=host)


def ref(i: int) -> InputRef:
    return InputRef("op", i)


def ext(kind: str, name: str, fp, index: int = 0) -> External:
    return External(index=index, kind=kind, name=name, meta=meta(4), fingerprint=fp, first_op=0)


def positions(*op_indices: int, shapes=None) -> list[Position]:
    return [Position(position=k, meta=(shapes[k] if shapes else meta(4, 4)), origin="op", op_index=i)
            for k, i in enumerate(op_indices)]


def region(forward: Pass, recompute: Pass | None, kind: str = "checkpoint", **options) -> Region:
    return Region(rank=0, region=0, module="layers.0", kind=kind, forward=forward, recompute=recompute,
                  options={"use_reentrant": kind == "reentrant", "determinism_check": "default", **options})


def param_ref(name: str) -> InputRef:
    return InputRef("param", name=name)


def run(*regions: Region, path: str = "trace-rank0.jsonl") -> Run:
    return Run(source="trace", path=path, rank=0, regions=list(regions), exit_status="ok")
