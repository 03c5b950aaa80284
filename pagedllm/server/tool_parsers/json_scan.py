"""The one JSON scanner every tool-call format reads its calls with: a call is a JSON object with a string "name"
and an arguments member (`"arguments"` in the Hermes format, `"parameters"` in the array constrained decoding
writes), read as far as a growing text goes. The arguments are kept as the raw text written (`{}` when the
object has none), so a stream sends them as they grow and never takes back what it sent."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass
class CallRead:
    """One call as far as it was read: its name (None until its string is whole) and its arguments text (None
    until the arguments member starts)."""

    name: str | None = None
    args: str | None = None


class Incomplete(Exception):
    """The text ends inside what is being read."""


class NotJSON(Exception):
    """The JSON breaks at `at`."""

    def __init__(self, at: int) -> None:
        super().__init__(at)
        self.at = at


def read_call(text: str, p: int, call: CallRead, args_key: str) -> int:
    """Reads the object at p into `call`; the position after it. The first "name" and `args_key` count; a name
    that is not a string breaks the JSON there. Raises Incomplete or NotJSON with what was read in `call`."""
    expect(text, p, "{")
    p = skip(text, p + 1)
    if expect(text, p, '"}') == "}":
        return p + 1
    while True:
        expect(text, p, '"')
        key_end = value_end(text, p)
        key = json.loads(text[p:key_end])
        p = skip(text, key_end)
        expect(text, p, ":")
        v = skip(text, p + 1)
        if key == args_key and call.args is None:
            end = _read_arguments(text, v, call)
        else:
            end = value_end(text, v)
            value = json.loads(text[v:end])
            if key == "name" and call.name is None:
                if not isinstance(value, str):
                    raise NotJSON(v)
                call.name = value
        p = skip(text, end)
        if expect(text, p, ",}") == "}":
            return p + 1
        p = skip(text, p + 1)


def _read_arguments(text: str, v: int, call: CallRead) -> int:
    """The arguments value at v: its raw text so far (a string value, decoded, once whole); where it ends."""
    if v >= len(text):
        raise Incomplete
    try:
        end = value_end(text, v)
    except Incomplete:
        call.args = "" if text[v] == '"' else text[v:]
        raise
    except NotJSON as e:
        call.args = text[v : e.at]
        raise
    call.args = json.loads(text[v:end]) if text[v] == '"' else text[v:end]
    return end


_BARE = re.compile(r"[-+.\w]+")  # a number, true, false or null (json.loads judges it whole)


def value_end(text: str, p: int) -> int:
    """Where the JSON value at p ends: Incomplete while the text ends inside it, NotJSON where it breaks (a
    character JSON never has outside a string at once, the rest when the value is whole)."""
    if p >= len(text):
        raise Incomplete
    if text[p] in '{["':
        end = _bracketed_end(text, p)
    else:
        bare = _BARE.match(text, p)
        if bare is None:
            raise NotJSON(p)
        if bare.end() == len(text):
            raise Incomplete
        end = bare.end()
    try:
        json.loads(text[p:end])
    except ValueError:
        raise NotJSON(end) from None
    return end


def _bracketed_end(text: str, p: int) -> int:
    depth, in_str, esc = 0, False, False
    for i in range(p, len(text)):
        ch = text[i]
        if in_str:
            esc, in_str = (False, True) if esc else (ch == "\\", ch != '"')
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif not (ch.isalnum() or ch in " \t\n\r,:-+."):
            raise NotJSON(i)
        if depth == 0 and not in_str:
            return i + 1
    raise Incomplete


def expect(text: str, p: int, chars: str) -> str:
    if p >= len(text):
        raise Incomplete
    if text[p] not in chars:
        raise NotJSON(p)
    return text[p]


def skip(text: str, p: int) -> int:
    while p < len(text) and text[p] in " \t\n\r":
        p += 1
    return p
