"""Grammar compilation off the request path: a bounded executor with a deadline.

Compiling a grammar for a schema takes from milliseconds to minutes (xgrammar, in C++, cannot be
interrupted). So compilations run in their own small pool, never in the threads that prepare
plain requests, and never under a lock those requests need: a plain request never waits behind
a grammar. A request waits for its grammar at most `timeout` seconds (then a 400 naming the
limit; the compilation finishes in the background and lands in xgrammar's cache), and at most
`max_pending` compilations run or wait at once (beyond that a 429).
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
        self._pending = 0
        self._lock = threading.Lock()

    @property
    def pending(self) -> int:
        return self._pending

    async def run(self, compile: Callable[[], T], param: str) -> T:
        """`compile()` in the pool; its result, or the APIError it raised, within the deadline."""
        with self._lock:
            if self._pending >= self.max_pending:
                raise APIError(f"Too many grammars are being compiled (at most {self.max_pending} at once); "
                               "please retry shortly.", 429, "rate_limit_error", param, "grammar_queue_full",
                               headers={"Retry-After": "1"})
            self._pending += 1
        future = self._pool.submit(compile)
        future.add_done_callback(self._done)  # counts the job until it really ends, deadline or not
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout)
        except asyncio.TimeoutError:
            raise bad_request(f"Compiling the grammar for `{param}` took longer than {self.timeout:g} s "
                              "(the server's grammar_timeout); simplify the schema.", param,
                              "grammar_timeout") from None

    def _done(self, _) -> None:
        with self._lock:
            self._pending -= 1

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
