"""Bounds on the work one request can cause: JSON nesting depth, and (see `RequestBodyLimits`)
content type and body size, checked before the body is parsed.
"""
from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from .errors import APIError, bad_request

# Containers ({} or []) inside one another, counted from the outermost. Real tool schemas and
# arguments stay well under this; deeper input only serves to exhaust recursion (Python's JSON
# decoder, Jinja's tojson, schema compilation) and would fail with RecursionError -> 500.
MAX_JSON_DEPTH = 64

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
