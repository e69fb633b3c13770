"""`ac-diff.yaml`: settings kept in the repository; command-line options override them.

    # ac-diff.yaml (in the working directory, or `ac-diff --config FILE ...` / `ac-diff report --config FILE`)
    rtol: 1.0e-6            # value tolerances for fingerprints (default 0: a recompute is bit-identical)
    atol: 0.0
    ignore_ops: [aten.detach.default]        # ops never recorded
    discrete_ops: [mylib.route.default]      # extra ops treated as discrete decisions
    keep_values: 4096       # max elements kept per discrete op output (0: none)
    max_regions: 64         # record ops of the first N regions only (null: all)
    write: all              # every region's ops (default diverged: those that diverged + a sample; see RecordOptions)
    output_dir: runs/ac-diff
    format: html            # default report format: terminal, json, html

    config = load_config()                 # ./ac-diff.yaml if there is one, else the defaults
    config = load_config("ci/ac-diff.yaml")
    config.record_options(keep_values=None)   # RecordOptions; a non-None argument (a CLI option) wins
    config.settings(rtol=1e-5)                # diagnosis Settings

Every key is optional. The keys, their types and defaults are in `KEYS` (and in `ac-diff --help`'s
epilog). Unknown keys, wrong types and malformed YAML raise `ConfigError` with the key's name and the
valid choices; the CLI prints it as one line and exits 2.

Where each key applies: `rtol`, `atol`, `window_before`, `window_after` to the diagnosis (`run`,
`report`, `compare`); `ignore_ops`, `discrete_ops`, `keep_values`, `max_regions`, `fingerprints`,
`fingerprint_derived`, `source_lines`, `scope`, `write`, `keep_clean`, `watch`, `watch_full_steps`, `watch_resample`,
`full_from_step` to
recording (`run`); `output_dir` to `run` (and `demo`, which writes to
`OUTPUT_DIR/demo`); `format` to `run`, `report`, `compare`, `demo`; `check` to `run`.
Op names are full overload names (`aten.topk.default`); a short name (`topk`, `aten.topk`) stands
for every overload of that op and is expanded when torch knows it.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from .commands.choices import REPORT_FORMATS as FORMATS, SCOPES, WRITES
from .errors import AcDiffError

CONFIG_NAME = "ac-diff.yaml"


class ConfigError(AcDiffError):
    """A config file that cannot be used: the message names the file, the key and the valid choices."""


@dataclass(frozen=True)
class Key:
    name: str
    kind: str  # what the value must be, in words (for the error message)
    default: Any
    help: str
    check: Callable[[Any], Any]  # returns the normalised value or raises ValueError(reason)


def _number(v: Any) -> float:
    if isinstance(v, str):  # PyYAML reads `1e-6` (no dot) as a string: accept what float() reads
        try:
            v = float(v)
        except ValueError:
            raise ValueError("a number") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError("a number")
    if not 0 <= v < float("inf"):  # NaN fails too
        raise ValueError("a finite number >= 0")
    return float(v)


def _count(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError("an integer >= 0")
    if v < 0:
        raise ValueError("an integer >= 0")
    return v


def _count_or_null(v: Any) -> int | None:
    return None if v is None else _count(v)


def _step_or_null(v: Any) -> int | None:
    """A training step (they count from 1), or None."""
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ValueError("an integer >= 1 (steps count from 1)")
    return v


def _flag(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError("true or false")
    return v


def _text(v: Any) -> str:
    if not isinstance(v, str) or not v.strip():
        raise ValueError("a non-empty string")
    return v


def _choice(choices: tuple[str, ...]) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        if v not in choices:
            raise ValueError("one of " + ", ".join(choices))
        return v

    return check


def _op_list(v: Any) -> tuple[str, ...]:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(x, str) and x.strip() for x in v):
        raise ValueError("a list of op names like aten.topk.default")
    return tuple(x.strip() for x in v)


def _key(default: Any, kind: str, help: str, check: Callable[[Any], Any]) -> Any:
    """A settings key: its default, and in the field's metadata how `ac-diff.yaml` writes and checks it."""
    return field(default=default, metadata={"kind": kind, "help": help, "check": check})


@dataclass(frozen=True)
class Config:
    """The settings: each field is one `ac-diff.yaml` key, declared once with its default, kind and check."""

    rtol: float = _key(0.0, "finite number >= 0", "relative tolerance for value fingerprints (0: exact)", _number)
    atol: float = _key(0.0, "finite number >= 0", "absolute tolerance for value fingerprints", _number)
    ignore_ops: tuple[str, ...] = _key((), "list of op names", "ops never recorded (e.g. aten.detach.default)",
                                       _op_list)
    discrete_ops: tuple[str, ...] = _key((), "list of op names", "extra ops treated as discrete decisions (custom "
                                         "routers)", _op_list)
    keep_values: int = _key(16384, "integer >= 0", "max elements kept per discrete op output (0: none)", _count)
    max_regions: int | None = _key(None, "integer >= 0 or null", "record ops of the first N regions only (null: all)",
                                   _count_or_null)
    fingerprints: bool = _key(True, "true/false", "value fingerprints of region ops (false: metadata only, "
                              "cheapest)", _flag)
    fingerprint_derived: bool = _key(False, "true/false", "also fingerprint elementwise ops whose inputs were "
                                     "measured (their values follow from them; false skips about a fifth of the "
                                     "fingerprinting)", _flag)
    watch: bool = _key(False, "true/false", "watch mode: no dispatch mode; each region's saved tensors are compared "
                       "on the device, and a module whose region diverged is recorded in full from then on (cheap "
                       "enough to leave on)", _flag)
    watch_full_steps: int = _key(1, "integer >= 0", "watch: the first N steps are recorded in full", _count)
    watch_resample: int = _key(20, "integer >= 0", "watch: a module whose regions are compared by their outputs "
                               "only (reentrant checkpoints) is recorded in full once every N steps, one such module "
                               "a step (0: never)", _count)
    full_from_step: int | None = _key(None, "integer >= 1 or null", "record every region in full from this step on "
                                      "(watched before it)", _step_or_null)
    source_lines: bool = _key(True, "true/false", "record the user source line of each op", _flag)
    scope: str = _key("regions", "regions|all", "regions: observe only checkpointed regions; all: also count other "
                      "ops", _choice(SCOPES))
    write: str = _key("diverged", "diverged|all", "diverged: write the ops of regions whose recompute did not "
                      "reproduce the forward, plus a sample of clean ones (keep_clean), and a ~1 KB summary of every "
                      "other region (the trace grows with what diverged, not with the steps); all: every region's "
                      "ops", _choice(WRITES))
    keep_clean: int = _key(1, "integer >= 0", "write: diverged: clean regions per module written in full", _count)
    output_dir: str = _key("ac-diff-out", "path", "directory for trace files written by `run` (demo: "
                           "OUTPUT_DIR/demo)", _text)
    format: str = _key("terminal", "terminal|json|html", "default report format", _choice(FORMATS))
    check: bool = _key(False, "true/false", "`run` exits 1 when the script succeeded but a region diverged", _flag)
    window_before: int = _key(3, "integer >= 0", "aligned rows shown before the first divergence", _count)
    window_after: int = _key(8, "integer >= 0", "aligned rows shown after the first divergence", _count)
    path: Path | None = field(default=None, compare=False)  # the file it came from (None: defaults)

    def pick(self, name: str, given: Any) -> Any:
        """A command-line value wins when given (not None; checked like the key, as `--name`); otherwise
        the config's (or the default)."""
        if given is None:
            return getattr(self, name)
        try:
            return KEYS[name].check(given)
        except ValueError as exc:
            raise ConfigError(f"--{name.replace('_', '-')} must be {exc} (got {given!r})") from None

    def settings(self, rtol: float | None = None, atol: float | None = None):
        from .diagnosis import Settings, Tolerance

        return Settings(tolerance=Tolerance(rtol=self.pick("rtol", rtol), atol=self.pick("atol", atol)),
                        window_before=self.window_before, window_after=self.window_after)

    def record_options(self, *, keep_values: int | None = None, max_regions: int | None = None,
                       fingerprints: bool | None = None, scope: str | None = None, write: str | None = None,
                       keep_clean: int | None = None, watch: bool | None = None,
                       watch_full_steps: int | None = None, watch_resample: int | None = None,
                       full_from_step: int | None = None):
        from .capture.recorder import RecordOptions

        return RecordOptions(
            fingerprints=self.pick("fingerprints", fingerprints), keep_values=self.pick("keep_values", keep_values),
            fingerprint_derived=self.fingerprint_derived, source_lines=self.source_lines,
            max_regions=self.pick("max_regions", max_regions),
            scope=self.pick("scope", scope), discrete_ops=frozenset(self.discrete_ops),
            ignore_ops=frozenset(self.ignore_ops), write=self.pick("write", write),
            keep_clean=self.pick("keep_clean", keep_clean), watch=self.pick("watch", watch),
            watch_full_steps=self.pick("watch_full_steps", watch_full_steps),
            watch_resample=self.pick("watch_resample", watch_resample),
            full_from_step=self.pick("full_from_step", full_from_step))


KEYS: dict[str, Key] = {f.name: Key(f.name, f.metadata["kind"], f.default, f.metadata["help"], f.metadata["check"])
                       for f in fields(Config) if f.metadata}


def find_config(cwd: str | os.PathLike | None = None) -> Path | None:
    """`ac-diff.yaml` in the working directory, if there is one."""
    p = Path(cwd or os.getcwd()) / CONFIG_NAME
    return p if p.is_file() else None


def load_config(path: str | os.PathLike | None = None, cwd: str | os.PathLike | None = None) -> Config:
    """Read `path` (must exist), else `./ac-diff.yaml` when present, else the defaults."""
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{p}: config file not found; pass an existing file to --config "
                              f"(or put {CONFIG_NAME} in the working directory)")
    else:
        p = find_config(cwd)
        if p is None:
            return Config()
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: cannot read the config file ({exc})") from None
    return parse_config(text, origin=p)


def parse_config(text: str, origin: str | os.PathLike = CONFIG_NAME) -> Config:
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{origin}: malformed YAML{where}: {problem}; fix the syntax (the file holds "
                          "`key: value` lines, e.g. `rtol: 1.0e-6`)") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: expected a mapping of `key: value` lines at the top level, got "
                          f"{_type_name(data)}; keys: {', '.join(KEYS)}")
    values: dict[str, Any] = {}
    for key, value in data.items():
        spec = KEYS.get(key) if isinstance(key, str) else None
        if spec is None:
            close = difflib.get_close_matches(str(key), KEYS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"{origin}: unknown key {key!r}{hint}; valid keys: {', '.join(KEYS)}")
        try:
            values[key] = spec.check(value)
        except ValueError as exc:
            raise ConfigError(f"{origin}: {key} must be {exc} (got {_type_name(value)} {value!r})") from None
        if key in ("ignore_ops", "discrete_ops"):
            try:
                values[key] = tuple(expand_ops(values[key]))
            except ValueError as exc:
                raise ConfigError(f"{origin}: {key}: {exc}") from None
    return Config(path=Path(origin), **values)


def expand_ops(names: tuple[str, ...] | list[str]) -> list[str]:
    """Full overload names; `topk` / `aten.topk` become every overload torch knows (`aten.topk.default`, ...).

    A full name (`ns.op.overload`) is kept as written: custom ops may be registered only by the script.
    A short name torch does not know raises ValueError.
    """
    out: list[str] = []
    for name in names:
        parts = name.split(".")
        if len(parts) >= 3:
            out.append(name)
            continue
        ns, op = ("aten", parts[0]) if len(parts) == 1 else (parts[0], parts[1])
        overloads = _overloads(ns, op)
        if not overloads:
            raise ValueError(f"{name!r} is not an op torch knows; write the full overload name, e.g. "
                             "aten.topk.default or mylib.route.default")
        out.extend(f"{ns}.{op}.{o}" for o in overloads)
    return out


def _overloads(ns: str, op: str) -> list[str]:
    import torch

    try:
        packet = getattr(getattr(torch.ops, ns), op)
        return list(packet.overloads())
    except (AttributeError, RuntimeError):
        return []


def _type_name(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)
