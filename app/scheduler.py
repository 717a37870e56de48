"""One engine worker thread, many requests.

The model is owned by a single thread (torch here is not re-entrant, and one CPU model gains
nothing from concurrent forwards). The worker round-robins every active generation one `step()`
at a time, so requests interleave fairly by speculation round, and pushes each round's tokens to
the request's asyncio queue with `loop.call_soon_threadsafe`.

Admission is bounded: at most `max_active` generations are stepped, at most `max_queue` more wait;
beyond that `submit` raises a 429. A handle's `cancel()` (client gone, stop string found) is
honoured before that request's next round, and a request past its deadline is stopped there too.
An exception in one request's round fails that request only.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from whiflash_core.engine import Engine, Generation, GenerationRequest
from whiflash_core.logits import TokenLogprob

from .errors import APIError, bad_request, internal_error, overloaded
from .events import EventBus
from .metrics import Metrics

log = logging.getLogger(__name__)


# --- what a request's queue receives -----------------------------------------------------------


@dataclass
class TokenBatch:
    """Tokens emitted by one round (several under speculation)."""
    token_ids: list[int]
    sources: list[str]
    round: int
    logprobs: list[TokenLogprob] | None = None  # per token, when the request asked for logprobs


@dataclass
class Finished:
    finish_reason: str          # the engine's: stop / length / cancelled
    stats: dict                 # Generation.stats()
    timing: dict                # Generation.timing()
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Failed:
    error: APIError


def timeout_error(seconds: float) -> APIError:
    return APIError(f"Request timed out after {seconds:g} s", 504, "timeout_error", None, "request_timeout",
                    headers={"x-should-retry": "false"})


class RequestHandle:
    """The async side of one request. Iterate it for TokenBatch items, then one Finished or Failed."""

    def __init__(self, scheduler: Scheduler, request_id: str, request: GenerationRequest,
                 loop: asyncio.AbstractEventLoop, deadline: float, info: dict):
        self.id, self.request, self.info = request_id, request, info
        self._scheduler, self._loop = scheduler, loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self.arrival = time.perf_counter()
        self.deadline = deadline
        self.cancel_reason: str | None = None
        self.done = False

    def cancel(self, reason: str = "abort") -> None:
        """Thread-safe; stops the generation before its next round. No-op once finished."""
        if self.cancel_reason is None and not self.done:
            self.cancel_reason = reason
            self._scheduler._wake()

    def _push(self, item) -> None:  # worker thread
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the request's event loop is gone
            self.cancel_reason = self.cancel_reason or "abort"

    async def get(self):
        return await self._queue.get()

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, (Finished, Failed)):
            self.done = True
        return item


@dataclass
class _Slot:
    handle: RequestHandle
    gen: Generation
    delivered: int = 0
    first_token_at: float | None = None


class Scheduler:
    def __init__(self, engine: Engine, metrics: Metrics | None = None, events: EventBus | None = None,
                 max_active: int = 16, max_queue: int = 64, request_timeout: float = 600.0):
        self.engine = engine
        self.metrics = metrics
        self.events = events or EventBus()
        self.max_active, self.max_queue, self.request_timeout = max_active, max_queue, request_timeout
        self._waiting: deque[RequestHandle] = deque()
        self._active: list[_Slot] = []        # touched by the worker thread only
        self._admitted = 0                    # requests submitted and not yet finished (under _cv)
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.healthy = True
        if metrics is not None:
            metrics.bind_queue_gauges(lambda: len(self._active), lambda: len(self._waiting))

    # -- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="whiflash-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_running(self) -> int:
        return len(self._active)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # -- the async side -----------------------------------------------------------------------------

    def submit(self, request: GenerationRequest, request_id: str, info: dict | None = None) -> RequestHandle:
        """Queue a generation; raises a 429 APIError when the server is full. Call from the event loop."""
        handle = RequestHandle(self, request_id, request, asyncio.get_running_loop(),
                               time.perf_counter() + self.request_timeout, info or {})
        with self._cv:
            if self._admitted >= self.max_active + self.max_queue:
                if self.metrics:
                    self.metrics.reject("queue_full")
                raise overloaded()
            self._admitted += 1
            self._waiting.append(handle)
            self._cv.notify_all()
        return handle

    def _release(self) -> None:
        """A request left the scheduler (finished, failed or cancelled): its place is free."""
        with self._cv:
            self._admitted -= 1

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    # -- the worker ---------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._waiting and not self._active:
                    self._cv.wait()
                if self._stopping:
                    break
                admitted = []
                while self._waiting and len(self._active) + len(admitted) < self.max_active:
                    admitted.append(self._waiting.popleft())
            for handle in admitted:
                self._start(handle)
            for slot in list(self._active):
                self._step(slot)
        for slot in self._active:  # shutting down
            slot.gen.cancel()
            slot.handle._push(Failed(APIError("server shutting down", 503, "server_error", None, "shutdown")))
        self._active.clear()

    def _start(self, handle: RequestHandle) -> None:
        now = time.perf_counter()
        if handle.cancel_reason is not None:
            self._record_finish(handle, handle.cancel_reason, now - handle.arrival)
            return
        if now > handle.deadline:
            self._fail(handle, timeout_error(self.request_timeout), "timeout")
            return
        try:
            gen = self.engine.start(handle.request)
            self.events.publish("request_started", id=handle.id, prompt_tokens=len(handle.request.prompt_ids),
                                max_tokens=handle.request.max_new_tokens, method=gen.spec.method,
                                alpha=gen.spec.alpha, **handle.info)
            if self.metrics:
                self.metrics.started(len(handle.request.prompt_ids), now - handle.arrival)
            gen.prefill()
        except ValueError as exc:  # the engine's own request checks (context length, method)
            self._fail(handle, bad_request(str(exc)), "error")
            return
        except Exception as exc:
            log.exception("prefill failed for %s", handle.id)
            self._fail(handle, internal_error(f"generation failed: {type(exc).__name__}: {exc}"), "error")
            return
        slot = _Slot(handle, gen)
        self._active.append(slot)
        self._deliver(slot)

    def _step(self, slot: _Slot) -> None:
        handle, gen = slot.handle, slot.gen
        if handle.cancel_reason is not None:
            gen.cancel()
            self._finish(slot)
            return
        if time.perf_counter() > handle.deadline:
            gen.cancel()
            self._active.remove(slot)
            self._fail(handle, timeout_error(self.request_timeout), "timeout")
            return
        try:
            r = gen.step()
        except Exception as exc:
            log.exception("round failed for %s", handle.id)
            gen.cancel()
            self._active.remove(slot)
            self._fail(handle, internal_error(f"generation failed: {type(exc).__name__}: {exc}"), "error")
            return
        if r is not None:
            if self.metrics:
                self.metrics.round(gen.spec.method, r)
            self.events.publish("round", id=handle.id, **r.event())
        self._deliver(slot)

    def _deliver(self, slot: _Slot) -> None:
        gen, handle = slot.gen, slot.handle
        new = gen.output[slot.delivered:]
        if new:
            sources = gen.sources[slot.delivered:]
            logprobs = gen.logprobs[slot.delivered:] if gen.request.logprobs is not None else None
            slot.delivered = len(gen.output)
            handle._push(TokenBatch(new, sources, gen.rounds, logprobs))
            if slot.first_token_at is None:
                slot.first_token_at = time.perf_counter()
                if self.metrics:
                    self.metrics.first_token(slot.first_token_at - handle.arrival)
            if self.metrics:
                self.metrics.tokens(len(new))
            if self.events.active:
                tok = self.engine.tokenizer
                self.events.publish("tokens", id=handle.id, round=gen.rounds, tokens=[
                    {"id": t, "text": tok.decode([t]) if tok is not None else "", "source": s}
                    for t, s in zip(new, sources)])
        if gen.finished:
            self._finish(slot)

    def _finish(self, slot: _Slot) -> None:
        gen, handle = slot.gen, slot.handle
        if slot in self._active:
            self._active.remove(slot)
        stats, timing = gen.stats(), gen.timing()
        handle._push(Finished(gen.finish_reason or "stop", stats, timing, gen.prompt_len, len(gen.output)))
        reason = handle.cancel_reason if gen.finish_reason == "cancelled" and handle.cancel_reason else \
            gen.finish_reason or "stop"
        self._record_finish(handle, reason, time.perf_counter() - handle.arrival)
        self.events.publish("request_finished", id=handle.id, finish_reason=reason, stats=stats, timing=timing)

    def _fail(self, handle: RequestHandle, error: APIError, reason: str) -> None:
        handle._push(Failed(error))
        self._release()
        if self.metrics:
            self.metrics.failed(reason)
        self.events.publish("request_finished", id=handle.id, finish_reason=reason, error=error.message)

    def _record_finish(self, handle: RequestHandle, reason: str, seconds: float) -> None:
        self._release()
        if self.metrics:
            self.metrics.finished(reason, seconds)
