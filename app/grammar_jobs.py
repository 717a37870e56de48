"""Grammar compilation off the request path: a bounded executor with a deadline.

Compiling a grammar for a schema takes from milliseconds to minutes (xgrammar, in C++, cannot be
interrupted). So compilations run in their own small pool, never in the threads that prepare
plain requests, and never under a lock those requests need: a plain request never waits behind
a grammar. A request waits for its grammar at most `timeout` seconds (then a 400 naming the
limit; the compilation finishes in the background and lands in xgrammar's cache), and at most
`max_pending` distinct grammars compile or wait at once (beyond that a 429). Requests for a grammar
already in flight (agent loops send the same tools on every turn, often from several streams at
once) share its slot: after the first compilation the others are cache hits in xgrammar.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from .errors import APIError, bad_request

T = TypeVar("T")


class GrammarJobs:
    def __init__(self, timeout: float, max_pending: int, workers: int = 1):
        self.timeout, self.max_pending = timeout, max_pending
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="whiflash-grammar")
        self._in_flight: dict[str, int] = {}   # grammar key -> jobs compiling or waiting for it
        self._lock = threading.Lock()

    @property
    def pending(self) -> int:
        """Distinct grammars compiling or waiting."""
        return len(self._in_flight)

    async def run(self, compile: Callable[[], T], param: str, key: str | None = None) -> T:
        """`compile()` in the pool; its result, or the APIError it raised, within the deadline.
        Jobs with the same `key` take one slot of `max_pending` (no key: a slot of its own)."""
        key = key or f"job:{id(compile)}"
        with self._lock:
            if key not in self._in_flight and len(self._in_flight) >= self.max_pending:
                raise APIError(f"Too many grammars are being compiled (at most {self.max_pending} at once); "
                               "please retry shortly.", 429, "rate_limit_error", param, "grammar_queue_full",
                               headers={"Retry-After": "1"})
            self._in_flight[key] = self._in_flight.get(key, 0) + 1
        future = self._pool.submit(compile)
        future.add_done_callback(lambda _: self._done(key))  # counts the job until it really ends, deadline or not
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout)
        except asyncio.TimeoutError:
            raise bad_request(f"Compiling the grammar for `{param}` took longer than {self.timeout:g} s "
                              "(the server's grammar_timeout); simplify the schema.", param,
                              "grammar_timeout") from None

    def _done(self, key: str) -> None:
        with self._lock:
            self._in_flight[key] -= 1
            if not self._in_flight[key]:
                del self._in_flight[key]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
