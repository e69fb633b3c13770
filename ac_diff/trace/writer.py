"""The trace writer: records appended to a file as checksummed JSON lines, flushed once per pass.

    writer = TraceWriter("ac-diff-out/trace-rank0.jsonl", default_header(options), background=True)
    writer.write(encode_ops(...))        # or a function that builds the record, run on the writer thread
    writer.flush()                       # at the end of each pass: a crash loses nothing written
    writer.sync(); writer.copy("mine.jsonl", {"type": "end", ...})   # a finished copy of what is written so far
    writer.close({"type": "end", "status": "ok", "exit_code": 0})
    writer.failure                       # None, or what a failed write (a full disk) lost, in words
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import queue
import threading
import zlib
from pathlib import Path
from typing import Any, Callable

from .lines import fast_encode, with_crc


class TraceWriter:
    """Appends records to a trace file; `flush()` pushes them to disk so a crash loses nothing written.

    With `background=True` a writer thread encodes and writes, in order, what `write` queues (a record,
    or a function that builds one): the training thread only queues, and on a machine with a core to
    spare the JSON encoding overlaps the backward's kernels (which run without the GIL). Whoever queues
    a record must not change it afterwards. `close()` drains the queue, so an exception, SystemExit or
    Ctrl-C still leaves a finished trace; a process killed outright loses what was still queued (a pass
    or two) instead of nothing after the last flush. A write that fails (a full disk) never raises into
    the training: the writer stops writing and `failure` says which file and what was lost.
    """

    def __init__(self, path: str | os.PathLike, header: dict[str, Any], background: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        raw = open(self.path, "wb")
        self._raw = raw
        self._file = gzip.GzipFile(fileobj=raw, mode="wb") if self.path.suffix == ".gz" else raw
        # records are trees: no circular-reference bookkeeping (a quarter of the encoding time)
        self._encode = json.JSONEncoder(separators=(",", ":"), default=str, check_circular=False).encode
        self.error: BaseException | None = None  # the first failure of the writer thread, if any
        self.failure: str | None = None  # the first write that failed (a full disk): what was lost, in words
        self._lost = 0  # records not written since
        self._written = 0
        self._write_now(header)
        self._flush_now()
        if self.failure is not None:  # not even the header: nothing to record into, before anything ran
            raise self._os_error
        self._queue: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._run, name="ac-diff-trace-writer", daemon=True)
            self._thread.start()

    def write(self, record: dict[str, Any] | Callable[[], dict[str, Any]]) -> None:
        """Queue or write one record. One that may hold NaN or infinite floats must say so with
        `"nonfinite": true`: only json writes them as such (orjson would write null)."""
        if self._queue is not None:
            self._queue.put((self._write_now, record))
        else:
            self._write_now(record)

    def flush(self) -> None:
        if self._queue is not None:
            self._queue.put((self._flush_now, None))
        else:
            self._flush_now()

    def sync(self, timeout: float = 60.0) -> None:
        """Write what was queued so far and push it to disk, waiting (up to `timeout` s) until it is there."""
        if self._queue is None:
            self._flush_now()
            return
        done = threading.Event()
        self._queue.put((self._flush_now, None))
        self._queue.put((lambda _: done.set(), None))
        done.wait(timeout)

    def copy(self, path: str | os.PathLike, end_record: dict[str, Any]) -> None:
        """A finished copy of the trace written so far at `path` (compressed as its name says), `end_record` last.
        Call `sync()` first. An OSError propagates."""
        written = self.path.read_bytes()
        if written[:2] == b"\x1f\x8b":  # (a gzip stream still open has no trailer: gzip's reader would refuse it)
            written = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(written)
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        with (gzip.open(target, "wb") if target.suffix == ".gz" else open(target, "wb")) as dst:
            dst.write(written[:written.rfind(b"\n") + 1])  # (whole lines only)
            dst.write(self._line(end_record))

    def _line(self, record: dict[str, Any]) -> bytes:
        """A record as the file holds it: its JSON, the checksum, a newline."""
        line = None if record.get("nonfinite") else fast_encode(record)
        if line is None:
            line = self._encode(record).encode("utf-8", "replace")
        return with_crc(line) + b"\n"

    def close(self, end_record: dict[str, Any]) -> None:
        self.write(end_record)
        if self._queue is not None:
            self._queue.put((None, None))
            self._thread.join()
            self._queue = None
        self._flush_now()
        for f in {id(self._file): self._file, id(self._raw): self._raw}.values():
            try:
                f.close()
            except OSError as exc:  # the last buffered bytes (a gzip trailer) did not fit
                self._failed(exc)
        if self.failure is not None:
            self.failure += f"; {self._lost} record(s) after it were lost (the end record too)" if self._lost else ""

    def _write_now(self, record: Any) -> None:
        if self.failure is not None:
            self._lost += 1
            return
        if callable(record):
            record = record()
        try:
            self._file.write(self._line(record))
            self._written += 1
        except OSError as exc:
            self._failed(exc)
            self._lost += 1

    def _flush_now(self, _: Any = None) -> None:
        if self.failure is not None:
            return
        try:
            if isinstance(self._file, gzip.GzipFile):
                self._file.flush(gzip.zlib.Z_SYNC_FLUSH)
            self._file.flush()
            self._raw.flush()
        except OSError as exc:
            self._failed(exc)

    def _failed(self, exc: OSError) -> None:
        """A write failed (a full disk, a quota, a dead mount): keep the training running, write nothing more,
        and say what was lost. The file keeps what reached it (read back as a trace cut short)."""
        if self.failure is None:
            from ..streams import describe_os_error

            exc.filename = exc.filename or str(self.path)
            self._os_error = exc
            self.failure = (f"could not write the trace: {describe_os_error(exc)}; it holds only what was written "
                            f"before ({self._written} record(s), the last one possibly cut) and reads as cut short")

    def _run(self) -> None:
        queue_ = self._queue
        while True:
            action, arg = queue_.get()
            if action is None:
                return
            try:
                action(arg)
            except Exception as exc:  # noqa: BLE001 - one bad record must not stop the others
                if self.error is None:
                    self.error = exc
                with contextlib.suppress(Exception):
                    self._write_now({"type": "warning", "message": f"ac-diff trace writer: {type(exc).__name__}: "
                                                                   f"{exc} (a record was lost; please report)"})
