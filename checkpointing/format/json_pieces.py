"""A JSON document read a piece at a time, handing the GIL over between pieces (layer: format).

`json.loads` is one C call that holds the GIL until the whole document is parsed: 0.2 s for the
10 MB manifest of 256 ranks x 256 DTensors, during which no other thread of the process runs
Python (a training thread included: rank 0 and every tier's leader decode each step's manifest on
a background thread). `loads` parses the top-level object itself and one named array in it element
by element, each with json's own scanner, calling handoff() between elements. The value is what
json.loads returns; a document it cannot read piece by piece (malformed, or not an object) goes to
json.loads as a whole, so every error is json's own.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from checkpointing.format.handoff import handoff

_WS = re.compile(r"[ \t\n\r]*")


class _Malformed(Exception):
    pass


def loads(text: str, *, split: str, parse_constant: Callable[[str], Any]) -> Any:
    """json.loads(text, parse_constant=parse_constant), reading the top-level array `split` (if the
    document is an object holding one) element by element."""
    scan = json.JSONDecoder(parse_constant=parse_constant).raw_decode
    try:
        i = _WS.match(text, 0).end()  # type: ignore[union-attr]
        if not text.startswith("{", i):
            raise _Malformed
        obj, i = _object(text, i + 1, scan, split)
        if _WS.match(text, i).end() != len(text):  # type: ignore[union-attr]
            raise _Malformed
        return obj
    except (_Malformed, ValueError, IndexError):
        return json.loads(text, parse_constant=parse_constant)  # json's own value or error


def _ws(text: str, i: int) -> int:
    return _WS.match(text, i).end()  # type: ignore[union-attr]


def _object(text: str, i: int, scan: Callable[[str, int], tuple[Any, int]], split: str) -> tuple[dict[str, Any], int]:
    obj: dict[str, Any] = {}
    i = _ws(text, i)
    if text[i] == "}":
        return obj, i + 1
    while True:
        if text[i] != '"':
            raise _Malformed
        key, i = scan(text, i)
        i = _ws(text, i)
        if text[i] != ":":
            raise _Malformed
        i = _ws(text, i + 1)
        if key == split and text[i] == "[":
            value, i = _array(text, i + 1, scan)
        else:
            value, i = scan(text, i)
        obj[key] = value  # a repeated key: the last one wins, as in json.loads
        i, closed = _after_item(text, i, "}")
        if closed:
            return obj, i


def _array(text: str, i: int, scan: Callable[[str, int], tuple[Any, int]]) -> tuple[list[Any], int]:
    items: list[Any] = []
    i = _ws(text, i)
    if text[i] == "]":
        return items, i + 1
    while True:
        handoff()
        value, i = scan(text, i)
        items.append(value)
        i, closed = _after_item(text, i, "]")
        if closed:
            return items, i


def _after_item(text: str, i: int, close: str) -> tuple[int, bool]:
    """Past the separator after an item and the whitespace after it (False), or past `close` (True)."""
    i = _ws(text, i)
    if text[i] == ",":
        return _ws(text, i + 1), False
    if text[i] == close:
        return i + 1, True
    raise _Malformed
