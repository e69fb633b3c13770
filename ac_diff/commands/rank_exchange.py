"""Each rank's finished trace to rank 0 through the job's own rendezvous store: a cross-rank report without a
shared filesystem (two nodes, each with its own `-o` directory on a local disk).

    exchange = connect("4f2a.0", rank=3, world=4)  # StoreUnavailable when there is none: read the filesystem instead
    exchange.hello("out")                          # every rank, when it starts: who it is, where it writes
    exchange.send(Path("out/trace-rank3.jsonl"), "out")   # a non-zero rank, its trace finished
    exchange.receive(Path("out"), "4f2a.0")       # rank 0, polled while it waits -> {1, 3}: the ranks done so far
    exchange.arrived[3]  -> {"rank": 3, "node": 1, "host": "node1", "dir": "/scratch/out", "cut": False, ...}
    exchange.hellos([2]) -> {2: {"rank": 2, "node": 1, "host": "node1", "pid": 4242, ...}}  (started, never done)

Under torchrun (torch >= 2.4, c10d rendezvous) MASTER_ADDR:MASTER_PORT is a TCPStore that the agent of rank 0's
node hosts for the whole launch (TORCHELASTIC_USE_AGENT_STORE=True): it outlives every rank of that node, rank 0
included, so a rank that finishes early can leave its trace there. The keys, under `ac-diff/<run id>/` so that two
launches (or two restarts) never mix:

    hello/R    {"rank", "host", "pid", "dir", "node", "local_rank"}   set when rank R starts
    trace/R/i  chunk i of rank R's trace file                          taken (and deleted) by rank 0
    file/R/i/j chunk j of the i-th file sent with it (its gradients, its reference's: `--reference` on that node)
    done/R     what was sent: {"chunks", "bytes", "crc", "cut", "original_bytes", "shared", "path", "files",
               "left" (files over the rank's share, not sent), ...}
    done       how many ranks are done (rank 0 polls this one key)

A trace above the rank's share of the store (`rank_cap`: RANK_CAP, less in a big job) travels cut: its header,
end record and every record but the op lists, a warning naming where the full trace is, and each pass that had
op lists marked cut, without the saved positions that point into them (such a region reads as unchecked unless
torch raised about it; a summarized region, the default for one that reproduced, keeps its verdict), and the
report that reads it is never clean. A rank that writes into rank 0's own directory (same host, same path) sends
nothing but "done"; rank 0 never overwrites a finished trace of this run already in its directory (a shared
filesystem).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import threading
import zlib
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

from ..trace import decode_line, with_crc
from ..trace.lines import fast_encode
from .trace_peek import read_end, read_header

RANK_CAP = 64 << 20  # bytes of one rank's trace sent whole; above it the op lists stay behind
STORE_BUDGET = 1 << 30  # all ranks' traces together may hold this much of the agent's memory
CHUNK = 8 << 20  # bytes per store value
CONNECT_S = 10.0  # reaching the store
OP_S = 30.0  # one store operation
SEND_S = 20.0  # a rank's whole send (torchrun's agent SIGKILLs a rank 30 s after its SIGTERM)
DONE_COUNT = "done"

T = TypeVar("T")


class StoreUnavailable(Exception):
    """No rendezvous store to exchange traces through. `failed`: one was named but could not be reached (worth a
    line on every rank), not merely absent (a launch without torchrun's agent store)."""

    def __init__(self, message: str, failed: bool = False) -> None:
        super().__init__(message)
        self.failed = failed


def connect(namespace: str, rank: int, world: int, timeout: float = CONNECT_S) -> "Exchange":
    """A client of the torchrun agent's store, under `ac-diff/<namespace>/`. Never waits longer than `timeout`."""
    return Exchange(job_store(namespace, timeout), rank, world)


def job_store(namespace: str, timeout: float = CONNECT_S) -> Any:
    """The torchrun agent's store, under `ac-diff/<namespace>/`: every node's ranks reach it (no shared filesystem
    needed). StoreUnavailable where there is none."""
    import torch.distributed as dist

    return dist.PrefixStore(f"ac-diff/{namespace}", _agent_store(timeout))


def launch_token(elastic_id: str, timeout: float = CONNECT_S) -> str:
    """A token the first rank of this launch sets in the agent's store and every rank reads: the store lives as long
    as the launch's agents, so a launch that reuses the rendezvous id (a fixed --rdzv-id, a requeued job's id) gets
    another token, and its traces another run id. StoreUnavailable where there is no store."""
    store = _agent_store(timeout)
    try:
        got = bounded(lambda: store.compare_set(f"ac-diff/{elastic_id}/launch", "", os.urandom(4).hex()), OP_S)
    except Exception as exc:  # noqa: BLE001 - no token: the run id is the rendezvous id alone, as before
        raise StoreUnavailable(f"the rendezvous store did not answer ({_why(exc)})", failed=True) from None
    return got.decode() if isinstance(got, bytes) else str(got)


def _agent_store(timeout: float):
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        raise StoreUnavailable("no rendezvous store of torchrun's agent to hand the traces over through "
                               "(TORCHELASTIC_USE_AGENT_STORE is not True)")
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not (port or "").isdigit():
        raise StoreUnavailable("MASTER_ADDR / MASTER_PORT do not name the rendezvous store")
    import torch.distributed as dist

    try:
        store = bounded(lambda: dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=timeout)),
                        timeout + 5.0)
        store.set_timeout(timedelta(seconds=OP_S))
    except Exception as exc:  # noqa: BLE001 - any failure to connect means: use the filesystem
        raise StoreUnavailable(f"could not reach the rendezvous store at {addr}:{port} ({_why(exc)})",
                               failed=True) from None
    return store


def bounded(fn: Callable[[], T], seconds: float) -> T:
    """fn() on a daemon thread; TimeoutError after `seconds` (the thread is left behind, it cannot hold the process)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=run, name="ac-diff-rank-exchange", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {seconds:.0f} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def rank_cap(world: int) -> int:
    """What one rank may send whole: RANK_CAP, or its share of STORE_BUDGET in a big job (at least 1 MiB)."""
    return max(1 << 20, min(RANK_CAP, STORE_BUDGET // max(1, world - 1)))


def where_am_i(rank: int, output_dir: str | os.PathLike) -> dict[str, Any]:
    """This rank's hello: who it is and where its trace is written."""
    node = os.environ.get("GROUP_RANK") or os.environ.get("NODE_RANK")
    return {"rank": rank, "host": platform.node(), "pid": os.getpid(), "dir": os.path.realpath(output_dir),
            "node": int(node) if node and node.isdigit() else None,
            "local_rank": int(os.environ.get("LOCAL_RANK", "0") or 0)}


class Exchange:
    """One rank's side of the exchange over `store` (a PrefixStore of the agent's, or any c10d Store in tests)."""

    def __init__(self, store: Any, rank: int, world: int, cap: int | None = None) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.cap = rank_cap(world) if cap is None else cap
        self.done: set[int] = set()  # rank 0: ranks whose "done" it has taken
        self.arrived: dict[int, dict[str, Any]] = {}  # rank 0: ranks whose trace it wrote into its directory
        self.damaged: dict[int, str] = {}  # rank 0: ranks whose trace arrived incomplete, and why
        self._counted = 0

    # -- every rank ------------------------------------------------------------------------------------
    def hello(self, output_dir: str | os.PathLike) -> None:
        self.store.set(f"hello/{self.rank}", json.dumps(where_am_i(self.rank, output_dir)))

    def hellos(self, ranks: Iterable[int]) -> dict[int, dict[str, Any]]:
        """The hellos of `ranks` that were set."""
        found = {}
        for r in ranks:
            hello = self._get_json(f"hello/{r}")
            if hello is not None:
                found[r] = hello
        return found

    # -- a non-zero rank -------------------------------------------------------------------------------
    def send(self, trace_path: Path, output_dir: str | os.PathLike, companions: Iterable[Path] = ()
             ) -> dict[str, Any]:
        """Hand the finished trace to rank 0 (nothing but "done" when rank 0 writes into the same directory), and
        `companions`: files under `output_dir` a report of this rank reads too (its gradients and its reference's),
        while the rank's share of the store lasts; returns what "done" says."""
        me = where_am_i(self.rank, output_dir)
        zero = self._get_json("hello/0")
        meta: dict[str, Any] = {**me, "path": os.path.realpath(trace_path), "chunks": 0, "bytes": 0, "crc": 0,
                                "cut": False, "shared": bool(zero and zero.get("host") == me["host"]
                                                             and zero.get("dir") == me["dir"])}
        if not meta["shared"]:
            data, original = trace_bytes(trace_path, self.cap, me["host"])
            meta.update(bytes=len(data), crc=zlib.crc32(data), cut=original is not None, original_bytes=original)
            meta["chunks"] = self._put(f"trace/{self.rank}", data)
            meta["files"], meta["left"] = self._send_files(companions, Path(output_dir), self.cap - len(data))
        self.store.set(f"done/{self.rank}", json.dumps(meta))
        self.store.add(DONE_COUNT, 1)
        return meta

    def _put(self, key: str, data: bytes) -> int:
        """`data` in chunks under key/0, key/1, ...; how many (an empty file: one empty chunk)."""
        starts = range(0, max(len(data), 1), CHUNK)
        for i, start in enumerate(starts):
            self.store.set(f"{key}/{i}", data[start:start + CHUNK])
        return len(starts)

    def _send_files(self, files: Iterable[Path], base: Path, room: int) -> tuple[list[dict], list[str]]:
        """Each file under `base` that fits in `room` bytes (in order), as file/R/i; the paths of those left behind."""
        sent: list[dict] = []
        left: list[str] = []
        for path in files:
            try:
                rel, data = path.relative_to(base).as_posix(), path.read_bytes()
            except (OSError, ValueError):
                continue
            if len(data) > room:
                left.append(rel)
                continue
            room -= len(data)
            chunks = self._put(f"file/{self.rank}/{len(sent)}", data)
            sent.append({"path": rel, "chunks": chunks, "bytes": len(data), "crc": zlib.crc32(data)})
        return sent, left

    # -- rank 0 ------------------------------------------------------------------------------------------
    def receive(self, directory: Path, rid: str | None, scan: bool = False) -> set[int]:
        """Write every trace that arrived since the last call into `directory` as trace-rank{R}.jsonl (unless a
        finished trace of run `rid` is already there); returns every rank done so far, rank 0 included.
        Each call reads one counter; `scan` (the last call) also looks for a "done" the counter missed."""
        count = int(self.store.add(DONE_COUNT, 0))
        if count > self._counted or scan:
            self._counted = count
            for r in range(1, self.world):
                if r not in self.done and self.store.check([f"done/{r}"]):
                    self._take(r, directory, rid)
        return self.done | {0}

    def _take(self, r: int, directory: Path, rid: str | None) -> None:
        meta = self._get_json(f"done/{r}") or {}
        self.done.add(r)
        keys = [f"trace/{r}/{i}" for i in range(int(meta.get("chunks", 0)))]
        if meta.get("shared"):
            return
        try:
            data = b"".join(self.store.get(k) for k in keys)
        except Exception as exc:  # noqa: BLE001 - a chunk gone missing: this rank's trace did not arrive
            self.damaged[r] = _why(exc)
            return
        for k in keys:  # the agent holds every byte until then
            try:
                self.store.delete_key(k)
            except Exception:  # noqa: BLE001 - a store without delete_key keeps them; nothing is lost
                break
        if len(data) != meta.get("bytes") or zlib.crc32(data) != meta.get("crc"):
            self.damaged[r] = f"{len(data):,} of {meta.get('bytes', 0):,} bytes arrived, or their checksum differs"
            return
        target = directory / f"trace-rank{r}.jsonl"
        if _finished_trace_of(target, rid):  # a shared filesystem: the rank wrote it there itself
            return
        directory.mkdir(parents=True, exist_ok=True)
        _write(target, data)
        self.arrived[r] = meta
        for i, f in enumerate(meta.get("files") or ()):
            self._take_file(r, i, f, directory)

    def _take_file(self, r: int, i: int, f: dict[str, Any], directory: Path) -> None:
        """A companion of rank r's trace (Exchange.send) written at its place under `directory`; one that did not
        arrive whole is named in the rank's `meta["lost"]`."""
        rel = Path(str(f.get("path", "")))
        keys = [f"file/{r}/{i}/{j}" for j in range(int(f.get("chunks", 0)))]
        try:
            data = b"".join(self.store.get(k) for k in keys)
        except Exception:  # noqa: BLE001 - a chunk gone missing
            data = None
        for k in keys:
            with contextlib.suppress(Exception):
                self.store.delete_key(k)
        if rel.is_absolute() or ".." in rel.parts or data is None or len(data) != f.get("bytes") \
                or zlib.crc32(data) != f.get("crc"):
            self.arrived[r].setdefault("lost", []).append(rel.as_posix())
            return
        (directory / rel).parent.mkdir(parents=True, exist_ok=True)
        _write(directory / rel, data)

    def _get_json(self, key: str) -> dict[str, Any] | None:
        if not self.store.check([key]):
            return None
        try:
            value = json.loads(self.store.get(key))
        except ValueError:
            return None
        return value if isinstance(value, dict) else None


def _write(target: Path, data: bytes) -> None:
    """`data` as `target`, whole or not at all (a reader never sees a part)."""
    part = target.with_name(f".{target.name}.{os.getpid()}.part")
    part.write_bytes(data)
    os.replace(part, target)


def _finished_trace_of(path: Path, rid: str | None) -> bool:
    if not path.exists():
        return False
    header = read_header(path) or {}
    return rid is not None and header.get("run_id") == rid and read_end(path) is not None


def _why(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# -- a trace over the cap --------------------------------------------------------------------------------
_TYPE = re.compile(rb'\{"type": ?"(\w+)"')
_PASS_KEY = re.compile(rb'"region": ?(\d+), ?"phase": ?"(\w+)", ?"attempt": ?(\d+)')  # how an op(s) record starts


def trace_bytes(path: Path, cap: int, host: str) -> tuple[bytes, int | None]:
    """The trace file's bytes, and None; or, when it is over `cap`, every record but its op lists (each pass
    that had them marked cut, a warning naming the full trace) and the file's size. Passes that never had op lists
    (a reproduced region's summary, a pass compared by its saved tensors only) travel whole."""
    size = path.stat().st_size
    if size <= cap:
        return path.read_bytes(), None
    out: list[bytes] = []
    with open(path, "rb") as f:
        first = f.readline()
        header = decode_line(first)
        header.pop("crc", None)
        header["cut"] = {"bytes": size, "host": host, "path": os.path.realpath(path)}
        out.append(_line(header))
        out.append(_line({"type": "warning", "message": (
            f"this copy of rank {header.get('rank', '?')}'s trace was cut for the trip to rank 0 ({size:,} bytes, "
            f"over the {cap:,}-byte cap): its op lists stayed behind, so a region that had them reads as unchecked "
            f"here unless torch raised about it; the full trace is {header['cut']['path']} on {host}")}))
        dropped: set[tuple] = set()  # (region, phase, attempt) of the passes whose op lists stay behind
        unknown = False  # an op list whose pass could not be told: every pass that may have had one is cut
        for line in f:
            kind = _TYPE.match(line)
            kind = kind[1] if kind else b""
            if kind in (b"op", b"ops"):
                key = _PASS_KEY.search(line, 0, 200)
                if key is None:
                    unknown = True
                else:
                    dropped.add((int(key[1]), key[2].decode(), int(key[3])))
                continue
            if kind == b"pass":
                rec = decode_line(line)
                key = (rec.get("region"), rec.get("phase"), rec.get("attempt", 0))
                if key in dropped or (unknown and rec.get("ops_written") is not False):
                    # its saved positions and outputs point into the ops left behind: without them they would read
                    # as values that differ
                    rec.pop("crc", None)
                    rec.update(positions=[], outputs=None, state={**(rec.get("state") or {}), "cut": True})
                    line = _line(rec)
            out.append(line)
    return b"".join(out), size


def _line(record: dict[str, Any]) -> bytes:
    """One record as the trace writer writes it (trace.TraceWriter): orjson unless it holds non-finite floats."""
    line = None if record.get("nonfinite") else fast_encode(record)
    if line is None:
        line = json.dumps(record, separators=(",", ":"), default=str).encode("utf-8", "replace")
    return with_crc(line) + b"\n"
