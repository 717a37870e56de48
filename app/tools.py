"""Hermes tool calls in model output: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

One parser serves both kinds of response: streaming calls `ToolCallParser.update(text, final)`
with the growing text every round, non-streaming calls it once with the whole text
(`parse_tool_calls`). Its decisions depend only on regions whose `</tool_call>` has arrived (or on
the end of the output), never on where round boundaries fall, so the streamed message always
equals the non-streamed one, under speculative decoding too (one round can carry many tokens):

* content is the text before the first `<tool_call>` (trailing whitespace dropped);
* a call counts once its `</tool_call>` has arrived and its body is a valid call: a JSON object
  with a `name` among the tools and `arguments` (or `parameters`) an object, or a JSON string
  holding an object; its `arguments` are the model's own text of that value. It is streamed whole
  (id, name and arguments in one delta), so a call that turns out cut off or invalid was never sent;
* if the first call is cut off (max_tokens) or invalid, the output is not a tool call: all of the
  text is content (vLLM's rule), finish_reason `length` when it was cut off;
* after a valid call, a cut-off or invalid one ends the calls (the valid ones before it are kept);
  text between and after calls is not content;
* with parallel_tool_calls false only the first call counts (the grammar allows no second one).

Each update scans only text no earlier update has scanned, so a response costs time linear in its
length, however many rounds it streams in.
"""
from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field

from whiflash_core.chat import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

from .limits import MAX_JSON_DEPTH, json_text_depth

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


def _partial_overlap(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


# --- the parser ------------------------------------------------------------------------------


@dataclass
class ParsedToolCall:
    name: str
    arguments: str
    id: str = field(default_factory=new_tool_call_id, compare=False)


def _json_object_text(text: str) -> bool:
    """Whether `text` is JSON text of an object (bounded in depth: json's recursion would 500)."""
    if json_text_depth(text) > MAX_JSON_DEPTH:
        return False
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def parse_call(body: str, names: set[str] | None = None) -> ParsedToolCall | None:
    """The call in the body of a closed `<tool_call>` region, or None if it is not a valid call
    (of one of `names`, when given)."""
    if not _json_object_text(body):
        return None
    obj = json.loads(body)
    name = obj.get("name")
    if not isinstance(name, str) or (names is not None and name not in names):
        return None
    key = "arguments" if "arguments" in obj else "parameters" if "parameters" in obj else None
    if key is None:
        return ParsedToolCall(name, "{}")
    value = obj[key]
    if isinstance(value, str):  # some models write the arguments as a JSON string
        return ParsedToolCall(name, value) if _json_object_text(value) else None
    if not isinstance(value, dict):
        return None
    span = _top_level_fields(body)[key]
    return ParsedToolCall(name, body[span.start:span.end])


class ToolCallParser:
    """The content and tool calls of a growing output text, each part reported once."""

    def __init__(self, parallel: bool = True, names: set[str] | None = None):
        self.parallel, self.names = parallel, names
        self.calls: list[ParsedToolCall] = []
        self.content_sent = 0
        self._plain = False                  # the output is not tool calls: all of it is content
        self._done = False                   # no further calls count
        self._content_end: int | None = None  # end of the content, once the first `<tool_call>` is seen
        self._open_at: int | None = None     # where the region being generated starts
        self._scan = 0                       # where the search for the next tag resumes

    def update(self, text: str, final: bool = False) -> tuple[str, list[ParsedToolCall]]:
        """New content and newly complete calls in `text`, the whole output so far."""
        new_calls = []
        while not (self._plain or self._done):
            if self._open_at is None:
                start = text.find(TOOL_CALL_OPEN, self._scan)
                if start < 0:
                    self._scan = max(self._scan, len(text) - len(TOOL_CALL_OPEN) + 1)
                    break
                if self._content_end is None:
                    self._content_end = len(text[:start].rstrip())
                self._open_at = start
                self._scan = start + len(TOOL_CALL_OPEN)
            end = text.find(TOOL_CALL_CLOSE, self._scan)
            if end < 0:
                self._scan = max(self._scan, len(text) - len(TOOL_CALL_CLOSE) + 1)
                if final:
                    self._no_more_calls()  # cut off
                break
            call = parse_call(text[self._open_at + len(TOOL_CALL_OPEN):end], self.names)
            self._open_at, self._scan = None, end + len(TOOL_CALL_CLOSE)
            if call is None:
                self._no_more_calls()
                break
            self.calls.append(call)
            new_calls.append(call)
            self._done = not self.parallel
        end = self._content_until(text, final)
        content = text[self.content_sent:end] if end > self.content_sent else ""
        self.content_sent = max(self.content_sent, end)
        return content, new_calls

    def _no_more_calls(self) -> None:
        """A call cut off or invalid: after valid calls it ends them; as the first, the output is text."""
        if self.calls:
            self._done = True
        else:
            self._plain = True

    def _content_until(self, text: str, final: bool) -> int:
        if self._plain or (final and self._content_end is None):
            return len(text)
        if self._content_end is not None:
            return self._content_end
        # no call yet: hold back what could still become "<tool_call>", and trailing whitespace
        # (dropped before a call, as in the non-streaming content)
        end = len(text) - _partial_overlap(text, TOOL_CALL_OPEN)
        while end > self.content_sent and text[end - 1].isspace():
            end -= 1
        return end


def parse_tool_calls(text: str, parallel: bool = True,
                     names: set[str] | None = None) -> tuple[str | None, list[ParsedToolCall]]:
    """(content, calls) of a finished output: the streaming parser, given the whole text at once.
    Content is None when there are calls and no text before them."""
    content, calls = ToolCallParser(parallel, names).update(text, final=True)
    return (content or None) if calls else content, calls


def ends_inside_tool_call(text: str) -> bool:
    """Whether the text stops inside an unclosed `<tool_call>` region (cut off by max_tokens)."""
    regions = _regions(text)
    return bool(regions) and not regions[-1][1]
