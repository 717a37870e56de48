"""Bounds on the work one request can cause: JSON nesting depth; the number and length of stop
strings and tools; a prompt too long for the context found by counting characters, before it is
tokenized; and (`RequestBodyLimits`) content type and body size, checked before the body is parsed.
"""
from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError
from starlette.datastructures import Headers

from .errors import APIError, bad_request

# Containers ({} or []) inside one another, counted from the outermost. Real tool schemas and
# arguments stay well under this; deeper input only serves to exhaust recursion (Python's JSON
# decoder, Jinja's tojson, schema compilation) and would fail with RecursionError -> 500.
MAX_JSON_DEPTH = 64

# OpenAI's own limit on tools per request; each one's schema also goes into the prompt and may be
# compiled into a grammar, so the count bounds that work.
MAX_TOOLS = 128
# Stop strings: matching is linear in the output whatever their length (app/output.py), but each
# costs per-character work for every generated character, so both count and length are bounded.
MAX_STOPS = 16
MAX_STOP_CHARS = 1000

# The smallest top_p passed to the engine. Every top_p at or below the most likely token's
# probability keeps that token alone, and that probability is at least 1/vocabulary (> 1e-6 for any
# vocabulary under a million tokens), so raising a smaller top_p to this changes no distribution; a
# top_p as small as 5e-324 is 0 once cast to float32, which dropped every token (NaN -> 500).
MIN_TOP_P = 1e-6

_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_BRACKET = re.compile(r"[\[\]{}]")


def json_text_depth(text: str) -> int:
    """Deepest nesting of the JSON text `text` (valid or not), without parsing it: strings are
    removed, then brackets are counted. Iterative, so any depth is safe to measure."""
    depth = deepest = 0
    for m in _BRACKET.finditer(_JSON_STRING.sub("", text)):
        if m.group() in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def _value_depth(value: Any, limit: int) -> int:
    """Deepest nesting of a parsed value, stopping once past `limit`. A string under the key
    "arguments" is JSON text (tool-call arguments), and counts as the nesting it encodes."""
    deepest = 0
    stack: list[tuple[Any, Any, int]] = [(None, value, 0)]
    while stack and deepest <= limit:
        key, v, depth = stack.pop()
        if isinstance(v, dict):
            stack.extend((k, c, depth + 1) for k, c in v.items())
            deepest = max(deepest, depth + 1)
        elif isinstance(v, (list, tuple)):
            stack.extend((None, c, depth + 1) for c in v)
            deepest = max(deepest, depth + 1)
        elif key == "arguments" and isinstance(v, str):
            deepest = max(deepest, depth + json_text_depth(v))
    return deepest


def check_nesting(fields: dict[str, Any], limit: int = MAX_JSON_DEPTH) -> None:
    """400 naming the limit if any top-level field of a request nests deeper than `limit`."""
    for name, value in fields.items():
        if _value_depth(value, limit) > limit:
            raise nesting_too_deep(name, limit)


def nesting_too_deep(param: str | None, limit: int = MAX_JSON_DEPTH) -> APIError:
    where = f"`{param}`" if param else "The request body"
    return bad_request(f"{where} is nested too deeply: at most {limit} levels of objects and arrays "
                       "are accepted.", param, "nesting_too_deep")


def is_too_deep(exc: ValidationError) -> bool:
    """Whether pydantic's JSON parser gave up on the body's nesting (its own limit is 200 levels)."""
    first = (exc.errors() or [{}])[0]
    return first.get("type") == "json_invalid" and "recursion limit" in str(first.get("ctx", {}).get("error", ""))


def check_tools(tools: list | None) -> None:
    if tools and len(tools) > MAX_TOOLS:
        raise bad_request(f"Too many tools: {len(tools)} given, at most {MAX_TOOLS} are accepted.", "tools",
                          "too_many_tools")


def stop_error(stops: list[str]) -> str | None:
    """Why `stops` is not accepted (None: it is). Raised as a validation error by the request model."""
    if len(stops) > MAX_STOPS:
        return f"at most {MAX_STOPS} stop sequences are accepted"
    if any(s == "" for s in stops):
        return "stop sequences must be non-empty"
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        return f"each stop sequence may be at most {MAX_STOP_CHARS} characters long"
    return None


# --- prompt length, before tokenizing ---------------------------------------------------------------


def longest_token_chars(tokenizer) -> int | None:
    """Characters in the longest token of the vocabulary (None if the tokenizer cannot tell).
    A byte-level BPE vocabulary spells each byte as one character, so this is also an upper bound
    on the characters any single token decodes to."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    vocab = get_vocab()
    return max(map(len, vocab)) if vocab else None


def text_chars(value: Any) -> int:
    """Characters in the strings of a parsed JSON value (messages, tools), iteratively."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return total


def certainly_too_long(chars: int, max_context: int, token_chars: int | None) -> bool:
    """Whether a prompt of `chars` characters cannot fit `max_context` tokens whatever its
    tokenization: no token covers more than `token_chars` characters, so it needs at least
    chars / token_chars tokens. Tokenizing a prompt of megabytes takes seconds and gigabytes;
    this answers such a prompt at once and never refuses one that could fit."""
    return token_chars is not None and chars > max_context * token_chars


# --- the body of a POST to the API ----------------------------------------------------------------


def is_api_post(scope) -> bool:
    path = scope["path"]
    return scope["method"] == "POST" and (path.startswith("/v1/") or path == "/chat/completions")


class RequestBodyLimits:
    """ASGI middleware for POSTs to the API: the body must be JSON (else 415) of at most `max_bytes`
    (else 413). Both are checked before the app parses or tokenizes anything: Content-Length up
    front, and a chunked body (no Content-Length, or a false one) by counting bytes as they arrive,
    so at most `max_bytes` are ever held."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not is_api_post(scope):
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        # OpenAI's clients always send application/json (a charset parameter is fine); a body with no
        # Content-Type at all is read as JSON, as vLLM and llama.cpp do (`curl -d` without -H)
        content_type = headers.get("content-type")
        if content_type is not None and content_type.partition(";")[0].strip().lower() != "application/json":
            error = APIError(f"Unsupported Content-Type {content_type!r}: request bodies must be "
                             "application/json.", 415, "invalid_request_error", None, "unsupported_media_type")
            return await error.response()(scope, receive, send)
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self._too_large()(scope, receive, send)

        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nothing to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._too_large()(scope, receive, send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break

        body, replayed = b"".join(chunks), False

        async def replay():
            # the body once, then the real channel (a streaming response listens there for disconnects)
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _too_large(self):
        return APIError(f"Request body too large: at most {self.max_bytes} bytes are accepted (the server's "
                        "max_request_bytes).", 413, "invalid_request_error", None, "request_too_large").response()
