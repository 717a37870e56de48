"""schemathesis hooks for tests/test_fuzz.py (loaded through SCHEMATHESIS_HOOKS).

Every generated body that asks for more than MAX_FUZZ_TOKENS tokens asks for MAX_FUZZ_TOKENS
instead: a fuzzed `max_tokens: 10**18` is a valid request that the CPU would answer for minutes
(up to the context length), which is slow, not wrong, and would hide real hangs behind the
per-request timeout. Values that are not positive integers are left alone, so the negative cases
(0, -1, "5", null, ...) still reach the server.
"""
from __future__ import annotations

import schemathesis

MAX_FUZZ_TOKENS = 16


@schemathesis.hook
def map_body(context, body):
    if isinstance(body, dict):
        for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):  # chat, completions; responses
            value = body.get(field)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_FUZZ_TOKENS:
                body[field] = MAX_FUZZ_TOKENS
    return body
