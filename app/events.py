"""In-process pub/sub for per-request events (the feed of a live stats page).

The engine worker thread publishes; asyncio consumers subscribe. Publishing never blocks the
engine: each subscriber has a bounded queue and loses its oldest events when it falls behind,
and with no subscribers `publish` is a cheap no-op.

Events are plain dicts with a "type":
    request_started  {id, method, alpha, policy, prompt_tokens, max_tokens}
    round            {id, round, drafter, draft_tokens, accepted, decided, switched, entropy, seconds}
                     (a `Round` record's fields: whiflash_core/rounds.py, `Round.event`)
    tokens           {id, round, tokens: [{id, text, source}]}
    request_finished {id, finish_reason, stats, timing}
each with "time" (Unix seconds) added by `publish`.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any


class Subscription:
    def __init__(self, bus: EventBus, loop: asyncio.AbstractEventLoop, maxsize: int):
        self._bus, self._loop = bus, loop
        self._queue: asyncio.Queue[dict] = asyncio.Queue(maxsize)
        self.dropped = 0

    def _put(self, event: dict) -> None:  # runs on the subscriber's loop
        if self._queue.full():
            self._queue.get_nowait()
            self.dropped += 1
        self._queue.put_nowait(event)

    async def get(self) -> dict:
        return await self._queue.get()

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        return await self._queue.get()

    def close(self) -> None:
        self._bus._remove(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class EventBus:
    def __init__(self):
        self._subs: list[Subscription] = []
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        """Whether anyone listens (lets publishers skip building expensive events)."""
        return bool(self._subs)

    def subscribe(self, maxsize: int = 10_000) -> Subscription:
        """Call from a coroutine; events are delivered on that coroutine's event loop."""
        sub = Subscription(self, asyncio.get_running_loop(), maxsize)
        with self._lock:
            self._subs = self._subs + [sub]
        return sub

    def _remove(self, sub: Subscription) -> None:
        with self._lock:
            self._subs = [s for s in self._subs if s is not sub]

    def publish(self, type: str, **data: Any) -> None:
        """Thread-safe."""
        subs = self._subs  # copy-on-write list: no lock needed to read
        if not subs:
            return
        event = {"type": type, "time": time.time(), **data}
        for sub in subs:
            try:
                sub._loop.call_soon_threadsafe(sub._put, event)
            except RuntimeError:  # the subscriber's loop is closed
                self._remove(sub)
