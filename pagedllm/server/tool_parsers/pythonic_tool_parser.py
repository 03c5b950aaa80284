"""The pythonic tool-call format (vLLM's `pythonic`, pythonic_tool_parser.py; Llama 3.2 and 4): the answer is a
Python list of calls, `[get_weather(city="Oslo"), add(a=1, b=2)]` (Llama 4 may wrap it in `<|python_start|>`
... `<|python_end|>`), each keyword's value a Python literal. The arguments go out as the JSON object of the
keywords (`{"city": "Oslo"}`), each keyword once its value is whole (`ast.literal_eval` of its complete text),
so what a stream sends never changes: `{"a": 1`, then `, "b": 2`, then `}` when the call closes."""

from __future__ import annotations

import ast
import json
import re

from pagedllm.server.tool_parsers.abstract_tool_parser import Scan, ScannedCall, ToolParser

START = "<|python_start|>"
_CALL = re.compile(r"\s*([A-Za-z_]\w*)\s*\(")  # a call's head: its name and "("
_KEYWORD = re.compile(r"\s*([A-Za-z_]\w*)\s*=(.*)", re.S)
# Llama 3.2's and 4's templates: "[func_name1(params_name1=params_value1, params_name2=params_value2...), ...]"
_ASKS = re.compile(r"\[\s*func_name\w*\(\s*\w+\s*=")


class _Broken(Exception):
    """The text is no Python call list from here on."""


class PythonicToolParser(ToolParser):
    """Nothing is sent while the answer may still become a call list (whitespace, `[`, a name not yet followed
    by `(`); an answer that cannot is content. A call is one once `name(` is read; a keyword whose value is no
    Python literal breaks the list: the calls stand as far as they were read, as Hermes' do. Text after the
    list is dropped (vLLM's rule)."""

    name = "pythonic"

    @staticmethod
    def supports(chat_template: str) -> bool:
        return _ASKS.search(chat_template) is not None

    def scan(self, text: str, done: bool) -> Scan:
        body = text.lstrip()
        if not done and START.startswith(body):
            return Scan("", [])
        p = len(text) - len(body) + (len(START) if body.startswith(START) else 0)
        p = _skip(text, p)
        if p == len(text) and not done:
            return Scan("", [])
        if p == len(text) or text[p] != "[":
            return Scan(text, [])
        calls: list[ScannedCall] = []
        pending = _read_calls(text, p + 1, calls)
        if not calls and (not pending or done):
            return Scan(text, [])
        return Scan("", calls if calls or done else [ScannedCall(None, "")])


def _skip(text: str, p: int) -> int:
    while p < len(text) and text[p].isspace():
        p += 1
    return p


def _read_calls(text: str, p: int, calls: list[ScannedCall]) -> bool:
    """Appends the calls of the list whose items start at p; whether the text may still go on to the next
    call's name (it ended before the list did, and nothing broke)."""
    while True:
        head = _CALL.match(text, p)
        if head is None:
            return bool(re.fullmatch(r"\s*(?:[A-Za-z_]\w*)?\s*", text[p:]))  # a name being written, or nothing yet
        args: list[str] = []
        try:
            end = _read_arguments(text, head.end(), args)
        except _Broken:
            end = None
        closed = end is not None and end <= len(text)
        calls.append(ScannedCall(head.group(1), "{" + ", ".join(args) + ("}" if closed else "")))
        if end is None or not closed:
            return False
        p = _skip(text, end)
        if p == len(text) or text[p] != ",":
            return False
        p += 1


def _read_arguments(text: str, p: int, args: list[str]) -> int:
    """Appends each keyword whose value is whole, as JSON (`"k": v`), from p (just after the "("); where the
    call ends (just after its ")"), or past the text while it is open. Raises _Broken."""
    start, depth, quote = p, 0, ""
    i = p
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}" and depth:
            depth -= 1
        elif ch in ",)" and not depth:
            _keyword(text[start:i], args, last=ch == ")")
            if ch == ")":
                return i + 1
            start = i + 1
        i += 1
    return len(text) + 1


def _keyword(piece: str, args: list[str], last: bool) -> None:
    """One `name=value` of a call as JSON; an empty piece only as the last (`f()`, `f(a=1,)`)."""
    if not piece.strip() and last:
        return
    m = _KEYWORD.fullmatch(piece)
    if m is None:
        raise _Broken
    try:
        value = ast.literal_eval(m.group(2).strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        raise _Broken from None
    try:
        args.append(f"{json.dumps(m.group(1))}: {json.dumps(value, ensure_ascii=False)}")
    except (TypeError, ValueError):  # a set, bytes, a complex number: no JSON value
        raise _Broken from None
