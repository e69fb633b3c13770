"""The arguments of one LoggingTensor op call, as JSON values.

    parse_args("$181, ['14', '99']")       -> Args(["$181", [14, 99]], ["$181"], complete=True)
    parse_args("$3, dtype=torch.float32")  -> Args(["$3", {"dtype": "torch.float32"}], ["$3"], True)
    parse_args("$154, dtype=torch.floorch._ops.aten.select.int($198, 0, 3")
                                           -> Args(["$154"], ["$154"], complete=False)  (spliced)

LoggingTensor formats every leaf with `repr`, then each argument with `str`, so:
- a tensor is the string "$N" (inside a list too: `['$449', '$450']` -> ["$449", "$450"]);
- numbers that torch printed as quoted strings inside lists (`['14', '99']`) become ints, so a
  list of sizes reads [14, 99] -- the real values, as a recorder would store them;
- a quoted string at the top level (`'sum'`, the process-group name `'9'`) stays a string;
- True/False/None become JSON true/false/null; floats become floats, except inf/nan which stay
  the strings "inf", "-inf", "nan" (JSON has no such numbers);
- anything else (`torch.float32`, `device(type='xpu', index=1)`, `torch.contiguous_format`)
  is kept as its text;
- keyword arguments are collected into ONE dict appended as the last element of the list.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Any

from ac_diff.logs.meta import INT

_TOKEN = re.compile(r"""'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|[\[\](){},]|[^\[\](){},'"]+|.""", re.S)
_KWARG = re.compile(r"\s*([A-Za-z_]\w*)=(.*)\Z", re.S)
_TENSOR_ID = re.compile(r"\$\d+\Z")
_FLOAT = re.compile(r"-?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?\Z")
_CLOSE = {"[": "]", "(": ")", "{": "}"}


@dataclass(slots=True)
class Args:
    """Arguments of one op call: values, the tensor ids in order, and whether the text was whole."""

    values: list[Any] = field(default_factory=list)
    tensor_ids: list[str] = field(default_factory=list)
    complete: bool = True


def unquote(tok: str) -> str:
    """The string a Python repr'd quoted token stands for (`'a\\'b'` -> `a'b`)."""
    if "\\" not in tok:
        return tok[1:-1]
    try:
        value = ast.literal_eval(tok)
        return value if isinstance(value, str) else tok[1:-1]
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return tok[1:-1]


def scalar(text: str, ids: list[str]) -> Any:
    """One unquoted leaf as a JSON value; a tensor id is appended to `ids`."""
    text = text.strip()
    if not text:
        return text
    c = text[0]
    if c == "$" and _TENSOR_ID.match(text):
        ids.append(text)
        return text
    if c == "-" or c == "." or c.isdigit():
        if INT.match(text):
            return int(text)
        if _FLOAT.match(text):
            return float(text)
        return text  # -inf and friends stay text
    if text == "True":
        return True
    if text == "False":
        return False
    if text == "None":
        return None
    if c in "'\"" and len(text) >= 2 and text[-1] == c:
        return unquote(text)
    return text


class _Cut(Exception):
    """The argument text ended inside a value."""


class _ArgReader:
    """Recursive descent over `_TOKEN` tokens of an argument list."""

    __slots__ = ("text", "toks", "i", "ids")

    def __init__(self, text: str, ids: list[str]):
        self.text = text
        self.toks = [(m.group(), m.start(), m.end()) for m in _TOKEN.finditer(text)]
        self.i = 0
        self.ids = ids

    def _skip_space(self) -> None:
        toks = self.toks
        while self.i < len(toks) and toks[self.i][0].isspace():
            self.i += 1

    def _balanced_end(self) -> int:
        """Index just past the bracket group starting at token i (raises _Cut if it never closes)."""
        stack = []
        toks = self.toks
        j = self.i
        while j < len(toks):
            t = toks[j][0]
            if t in _CLOSE:
                stack.append(_CLOSE[t])
            elif t in (")", "]", "}"):
                if not stack or stack.pop() != t:
                    raise _Cut
                if not stack:
                    return j + 1
            j += 1
        raise _Cut

    def value(self, in_container: bool) -> Any:
        self._skip_space()
        if self.i >= len(self.toks):
            raise _Cut
        tok, start, _ = self.toks[self.i]
        if tok == "[" or tok == "(":
            return self._sequence(_CLOSE[tok])
        if tok == "{":
            end = self._balanced_end()
            text = self.text[start:self.toks[end - 1][2]]
            self.i = end
            return text
        if tok[0] in "'\"" and len(tok) >= 2 and tok[-1] == tok[0]:
            self.i += 1
            s = unquote(tok)
            return scalar(s, self.ids) if in_container else s
        if tok in (")", "]", "}", ","):
            raise _Cut
        # an atom, maybe a call like device(type='cpu'), kept as its text
        self.i += 1
        call_end = self._call()
        if call_end is not None:
            return self.text[start:call_end].strip()
        return scalar(tok, self.ids)

    def _call(self) -> int | None:
        """If a `(` group follows the atom just read, consume it and return where it ends."""
        if self.i < len(self.toks) and self.toks[self.i][0] == "(":
            end = self._balanced_end()
            self.i = end
            return self.toks[end - 1][2]
        return None

    def _sequence(self, close: str) -> list:
        self.i += 1  # the opening bracket
        out: list[Any] = []
        while True:
            self._skip_space()
            if self.i >= len(self.toks):
                raise _Cut
            if self.toks[self.i][0] == close:
                self.i += 1
                return out
            out.append(self.value(True))
            self._skip_space()
            if self.i >= len(self.toks):
                raise _Cut
            t = self.toks[self.i][0]
            if t == ",":
                self.i += 1
            elif t != close:
                raise _Cut

    def item(self, kwargs: dict) -> Any:
        """One top-level argument; keyword arguments go into `kwargs` (returns _KW)."""
        self._skip_space()
        if self.i < len(self.toks):
            tok, start, _ = self.toks[self.i]
            m = _KWARG.match(tok) if tok[0] not in "'\"[({" else None
            if m:
                key, rest = m.group(1), m.group(2).strip()
                if rest:
                    self.i += 1
                    call_end = self._call()
                    if call_end is not None:
                        kwargs[key] = self.text[self.text.index("=", start) + 1:call_end].strip()
                    else:
                        kwargs[key] = scalar(rest, self.ids)
                else:
                    self.i += 1
                    kwargs[key] = self.value(False)
                return _KW
        return self.value(False)


_KW = object()


_FLAT_LIST = re.compile(r"(.*?)\[((?:'[^',\\\[\](){}]*'(?:, )?)*)\](.*)\Z")


def _flat_items(text: str, ids: list[str], values: list[Any], kwargs: dict[str, Any]) -> None:
    """Comma-separated scalars and keyword scalars, with no brackets or quotes."""
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        eq = item.find("=")
        if eq > 0 and item[:eq].isidentifier():
            kwargs[item[:eq]] = scalar(item[eq + 1:], ids)
        else:
            values.append(scalar(item, ids))


def _fast_args(text: str) -> Args | None:
    """The shapes most op calls have, without the general reader (None: use the reader).

    `$3, $6` / `$4, 2` / `$3, dtype=torch.float32`, and the same with one flat list of quoted
    leaves (`$0, ['1', '128', '5120']`).
    """
    if "(" in text or "{" in text or '"' in text or "\\" in text:
        return None
    ids: list[str] = []
    values: list[Any] = []
    kwargs: dict[str, Any] = {}
    if "[" not in text:
        if "'" in text:
            return None
        _flat_items(text, ids, values, kwargs)
    else:
        m = _FLAT_LIST.match(text)
        if m is None:
            return None
        before, inner, after = m.group(1), m.group(2), m.group(3)
        if "[" in before or "'" in before or "[" in after or "'" in after:
            return None
        before = before.rstrip()
        if before and not before.endswith(","):
            return None
        if before.endswith("=") or (after.strip() and not after.lstrip().startswith(",")):
            return None
        _flat_items(before, ids, values, kwargs)
        values.append([scalar(it.strip()[1:-1], ids) for it in inner.split(",") if it.strip()])
        _flat_items(after, ids, values, kwargs)
    if kwargs:
        values.append(kwargs)
    return Args(values, ids, True)


def parse_args(text: str, closed: bool = True) -> Args:
    """Parse the text between the parentheses of a LoggingTensor op call.

    `closed=False` means the text ran out before the closing parenthesis, so its last argument may
    itself be cut short and is dropped. On text that was cut or spliced, keeps the arguments that
    ended before the damage and sets `complete=False`.
    """
    ids: list[str] = []
    values: list[Any] = []
    kwargs: dict[str, Any] = {}
    if not text.strip():
        return Args([], ids, closed)
    if closed:
        fast = _fast_args(text)
        if fast is not None:
            return fast
    reader = _ArgReader(text, ids)
    complete = closed
    try:
        while True:
            n_ids, n_values, kw_before = len(ids), len(values), dict(kwargs)
            try:
                v = reader.item(kwargs)
            except (_Cut, RecursionError):
                del ids[n_ids:]
                complete = False
                break
            if v is not _KW:
                values.append(v)
            reader._skip_space()
            if reader.i >= len(reader.toks):
                if not closed:  # the last argument reached the cut: it may be short
                    del ids[n_ids:]
                    del values[n_values:]
                    kwargs = kw_before
                break
            if reader.toks[reader.i][0] == ",":
                reader.i += 1
                continue
            complete = False  # junk after a value
            break
    except Exception:  # noqa: BLE001 - a parser of damaged text must never raise
        complete = False
    if kwargs:
        values.append(kwargs)
    return Args(values, ids, complete)
