"""Hermes tool calls in model output: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

Streaming uses the parse-and-diff design (vLLM's recent Hermes parser): every round the
accumulated text is parsed and only what was not sent yet goes out, so it does not matter where
token or round boundaries fall, which is what makes it safe under speculative decoding, where one
round can carry many tokens. The scan of each call's JSON resumes where the last round's stopped
(`_ObjectFields`), so a long call costs time linear in its length, not quadratic.

The arguments are streamed as the raw text slice of the model's `"arguments"` value, found by
brace matching that ignores braces inside strings. A partial slice is always a prefix of the
final one, so fragments concatenate to exactly the non-streaming `arguments` string.
"""
from __future__ import annotations

import json
import logging
import secrets
import string
from dataclasses import dataclass

from whiflash_core.chat import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

from .limits import MAX_JSON_DEPTH, json_text_depth
from .schemas import DeltaFunction, DeltaToolCall

log = logging.getLogger(__name__)

_ALPHANUM = string.ascii_letters + string.digits


def new_tool_call_id() -> str:
    # >= 9 chars (Mistral templates) and <= 40 (OpenAI rejects longer ids on replay)
    return "call_" + "".join(secrets.choice(_ALPHANUM) for _ in range(24))


# --- a tiny scanner for the top level of a (possibly incomplete) JSON object -------------------


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\r\n":
        i += 1
    return i


class _ValueScan:
    """Finds the end of the JSON value starting at text[start] while the text grows: `run()`
    resumes where the last call ran out of text, so a value streamed in n pieces costs O(its
    length) in all, not O(length x pieces). Brackets inside strings are skipped."""

    def __init__(self, start: int):
        self.start = self.i = start
        self.depth = 0
        self.in_string = False

    def run(self, s: str) -> int | None:
        """Index just past the value in `s` (which extends the text of earlier calls), or None if
        the value is still incomplete."""
        i, depth, in_string, n = self.i, self.depth, self.in_string, len(s)
        if s[self.start] not in '"{[':
            # number / true / false / null: ends at a delimiter (incomplete if the text ends first)
            while i < n and s[i] not in ",}] \t\r\n":
                i += 1
            self.i = i
            return i if i < n else None
        end = None
        while i < n:
            c = s[i]
            if in_string:
                if c == "\\":
                    if i + 1 >= n:
                        break  # the escaped character has not arrived: look at the backslash again
                    i += 2
                    continue
                if c == '"':
                    in_string = False
                    if depth == 0:
                        end = i + 1
                        break
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    end = i + 1
                    break
            i += 1
        self.i, self.depth, self.in_string = (end if end is not None else i), depth, in_string
        return end


def _string_end(s: str, i: int) -> int | None:
    """s[i] == '"'; index just past the closing quote, or None if the string is incomplete."""
    return _ValueScan(i).run(s)


@dataclass
class _Field:
    start: int
    end: int | None  # None: the value is still being generated


class _ObjectFields:
    """The top-level keys of a growing JSON object text, with the spans of their values as far as
    they go. `update(body)` resumes where the previous call stopped, so a body streamed in many
    pieces is scanned once; a body that got shorter (the closing tag replaced a partial one) is
    scanned again from the start."""

    def __init__(self):
        self.fields: dict[str, _Field] = {}
        self._i = 0                       # where the next token (or the scan in progress) resumes
        self._expect = "{"                # "{", "key", ":", "value", ",": what comes next
        self._key: str | None = None
        self._scan: _ValueScan | None = None  # the key or value being read
        self._done = False                # the object ended or is malformed: nothing more to find
        self._length = 0

    def update(self, body: str) -> dict[str, _Field]:
        if len(body) < self._length:
            self.__init__()
        self._length = len(body)
        while not self._done:
            if self._scan is None:
                i = _skip_ws(body, self._i)
                if i >= len(body):
                    self._i = i
                    break
                self._i = i
                if self._expect in ("key", "value"):
                    if self._expect == "key" and body[i] != '"':
                        self._done = True
                        break
                    self._scan = _ValueScan(i)
                    if self._expect == "value":
                        self.fields[self._key] = _Field(i, None)
                    continue
                expected = self._expect
                if body[i] != expected:
                    self._done = True
                    break
                self._i = i + 1
                self._expect = "key" if expected in "{," else "value"
                continue
            end = self._scan.run(body)
            if end is None:
                break
            if self._expect == "key":
                try:
                    self._key = json.loads(body[self._scan.start:end])
                except json.JSONDecodeError:
                    self._done = True
                    break
                self._expect = ":"
            else:
                self.fields[self._key].end = end
                self._expect = ","
            self._scan, self._i = None, end
        return self.fields


def _top_level_fields(body: str) -> dict[str, _Field]:
    """Keys of the JSON object in `body` with the spans of their values, as far as they go."""
    return _ObjectFields().update(body)


# --- regions -----------------------------------------------------------------------------------


def _regions(text: str) -> list[tuple[str, bool]]:
    """(body, closed) for each `<tool_call>` region of `text`."""
    out = []
    pos = text.find(TOOL_CALL_OPEN)
    while pos >= 0:
        start = pos + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, start)
        if end < 0:
            out.append((text[start:], False))
            break
        out.append((text[start:end], True))
        pos = text.find(TOOL_CALL_OPEN, end + len(TOOL_CALL_CLOSE))
    return out


def _name(body: str, fields: dict[str, _Field]) -> str | None:
    f = fields.get("name")
    if f is None or f.end is None or body[f.start] != '"':
        return None
    return json.loads(body[f.start:f.end])


def _arguments(body: str, fields: dict[str, _Field], complete: bool) -> str | None:
    """The raw `arguments` text so far (all of it if `complete`); None if nothing can be sent yet."""
    f = fields.get("arguments", fields.get("parameters"))
    if f is None:
        return "{}" if complete else None
    if f.end is not None:
        return body[f.start:f.end]
    # an incomplete object can be streamed as a prefix; other values only once complete
    return body[f.start:].rstrip() if body[f.start] == "{" else None


def _partial_overlap(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


# --- non-streaming -----------------------------------------------------------------------------


@dataclass
class ParsedToolCall:
    name: str
    arguments: str


def parse_tool_calls(text: str, parallel: bool = True) -> tuple[str | None, list[ParsedToolCall]]:
    """(content, calls) of a finished output. If a tool-call body is not a valid
    `{"name": str, "arguments": object}`, the whole text is returned as content (vLLM's rule),
    except for a last call cut off by max_tokens after complete ones, which is dropped."""
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        return text, []
    calls = []
    regions = _regions(text)
    for i, (body, closed) in enumerate(regions):
        try:
            # too deep is not a call we accept (and would exhaust json's recursion: 500)
            if json_text_depth(body) > MAX_JSON_DEPTH:
                raise json.JSONDecodeError(f"nested deeper than {MAX_JSON_DEPTH} levels", body, 0)
            obj = json.loads(body)
        except json.JSONDecodeError:
            if not closed and i == len(regions) - 1 and calls:
                break  # a last call cut off by max_tokens: keep the complete ones before it
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        fields = _top_level_fields(body)
        args = _arguments(body, fields, complete=True)
        value = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(value, dict):
            return text, []
        calls.append(ParsedToolCall(obj["name"], args if args is not None else json.dumps(value)))
    if not parallel:
        calls = calls[:1]
    content = text[:start].rstrip()
    return (content or None), calls


# --- streaming ---------------------------------------------------------------------------------


@dataclass
class _SentCall:
    id: str
    name: str
    arguments: str = ""


class StreamingToolParser:
    """Turns the growing output text into content and tool-call deltas, sending each part once."""

    def __init__(self, parallel: bool = True):
        self.parallel = parallel
        self.content_sent = 0
        self.calls: list[_SentCall] = []
        self._fields: list[_ObjectFields] = []  # per region, resumed every round (linear in the output)

    def update(self, text: str, final: bool = False) -> tuple[str, list[DeltaToolCall]]:
        start = text.find(TOOL_CALL_OPEN)
        if start >= 0:
            content_end = len(text[:start].rstrip())
        elif final:
            content_end = len(text)
        else:
            # hold back what could still become "<tool_call>", and trailing whitespace (dropped
            # before a tool call, as in the non-streaming content)
            held = text[: len(text) - _partial_overlap(text, TOOL_CALL_OPEN)]
            content_end = len(held.rstrip())
        content = text[self.content_sent:content_end] if content_end > self.content_sent else ""
        self.content_sent = max(self.content_sent, content_end)
        if start < 0:
            return content, []

        deltas = []
        for index, (body, closed) in enumerate(_regions(text)):
            if index > 0 and not self.parallel:
                break
            if index >= len(self._fields):
                self._fields.append(_ObjectFields())
            fields = self._fields[index].update(body)
            complete = closed or final
            if index >= len(self.calls):
                name = _name(body, fields)
                if name is None:
                    break  # later calls wait for this one's header
                self.calls.append(_SentCall(new_tool_call_id(), name))
                header = True
            else:
                header = False
            call = self.calls[index]
            args = _arguments(body, fields, complete) or ""
            fragment = ""
            if len(args) > len(call.arguments):
                if not args.startswith(call.arguments):  # cannot happen for well-formed output
                    log.warning("tool call %d arguments diverged from what was streamed", index)
                else:
                    fragment = args[len(call.arguments):]
                    call.arguments = args
            if header:
                deltas.append(DeltaToolCall(index=index, id=call.id, type="function",
                                            function=DeltaFunction(name=call.name, arguments=fragment)))
            elif fragment:
                deltas.append(DeltaToolCall(index=index, function=DeltaFunction(arguments=fragment)))
        return content, deltas


def ends_inside_tool_call(text: str) -> bool:
    """Whether the text stops inside an unclosed `<tool_call>` region (cut off by max_tokens)."""
    regions = _regions(text)
    return bool(regions) and not regions[-1][1]
