"""One engine worker thread, many requests.

The model is owned by a single thread (torch here is not re-entrant, and one CPU model gains
nothing from concurrent forwards). Each pass of the worker gives every active generation one
speculation round, so requests interleave fairly by round; with `shared_forwards` (default) the
rounds of a pass share one target forward (`Engine.step_many`: drafting per request, the verify
rows of all of them through the weights at once), else each request runs its own. Each round's
tokens go to the request's asyncio queue with `loop.call_soon_threadsafe`.

Admission is bounded: at most `max_active` generations are stepped, at most `max_queue` more wait;
beyond that `submit` raises a 429. A handle's `cancel()` (client gone, stop string found) is
honoured before that request's next round, and a request past its deadline is stopped there too.
An exception in one request's round fails that request only; one that escapes the worker's own
code fails every open request with a 503 and marks the server unhealthy (`_run`).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from whiflash_core.engine import Engine, Generation, GenerationRequest
from whiflash_core.logits import TokenLogprob

from .errors import APIError, bad_request, engine_unavailable, internal_error, overloaded
from .events import EventBus
from .memory import keep_large_buffers_off_the_heap, release_free_memory
from .metrics import Metrics

log = logging.getLogger(__name__)

IDLE_TRIM_SECONDS = 1.0   # how long the worker waits, idle, before it gives memory back


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
    cached_tokens: int = 0      # prompt tokens reused from the prefix cache


@dataclass
class Failed:
    error: APIError


def timeout_error(seconds: float) -> APIError:
    return APIError(f"Request timed out after {seconds:g} s", 504, "timeout_error", None, "request_timeout",
                    headers={"x-should-retry": "false"})


class RequestHandle:
    """The async side of one request. Iterate it for TokenBatch items, then one Finished or Failed."""

    def __init__(self, scheduler: Scheduler, request_id: str, request: GenerationRequest,
                 loop: asyncio.AbstractEventLoop, deadline: float, info: dict, owner: str | None = None):
        self.id, self.request, self.info = request_id, request, info
        self.owner = owner  # who made the request (app/viewers.py): the stats feed shows its text to them only
        self._scheduler, self._loop = scheduler, loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self.arrival = time.perf_counter()
        self.deadline = deadline
        self.cancel_reason: str | None = None
        self.done = False

    def cancel(self, reason: str = "abort") -> None:
        """Thread-safe; stops the generation before its next round, or takes it out of the waiting
        queue at once (its place is free for the next request). No-op once finished."""
        if self.cancel_reason is None and not self.done:
            self.cancel_reason = reason
            self._scheduler._cancelled(self)

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
                 max_active: int = 16, max_queue: int = 64, request_timeout: float = 600.0,
                 shared_forwards: bool = True):
        self.shared_forwards = shared_forwards
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
        self.crashed: str | None = None      # why the worker thread died, once it has
        if metrics is not None:
            metrics.bind_queue_gauges(lambda: len(self._active), lambda: len(self._waiting))

    # -- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            keep_large_buffers_off_the_heap()
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
        return self._thread is not None and self._thread.is_alive() and self.crashed is None

    @property
    def num_running(self) -> int:
        return len(self._active)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # -- the async side -----------------------------------------------------------------------------

    def submit(self, request: GenerationRequest, request_id: str, info: dict | None = None,
               owner: str | None = None) -> RequestHandle:
        """Queue a generation; raises a 429 APIError when the server is full. Call from the event loop.
        `info` goes into the request_started event; `owner` (app/viewers.py) into every event of it."""
        handle = RequestHandle(self, request_id, request, asyncio.get_running_loop(),
                               time.perf_counter() + self.request_timeout, info or {}, owner)
        with self._cv:
            if self.crashed is not None or (self._thread is not None and not self._thread.is_alive()):
                raise engine_unavailable()
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

    def _cancelled(self, handle: RequestHandle) -> None:
        with self._cv:
            try:
                self._waiting.remove(handle)  # at most max_queue long
            except ValueError:  # already admitted: the worker stops it before its next round
                self._cv.notify_all()
                return
        self._end_unstarted(handle)

    def _end_unstarted(self, handle: RequestHandle) -> None:
        """A request cancelled before it started: finished with no tokens."""
        self._record_finish(handle, handle.cancel_reason or "abort", time.perf_counter() - handle.arrival)
        handle._push(Finished("cancelled", {}, {}, len(handle.request.prompt_ids), 0))
        self._publish("request_finished", handle, finish_reason=handle.cancel_reason or "abort")

    # -- the worker ---------------------------------------------------------------------------------

    def _run(self) -> None:
        """The worker thread. Failures in one request's round are that request's (`_step`); anything
        escaping them is a fault of the worker itself: every open request then gets a 503 at once
        (instead of waiting forever behind SSE pings), /health turns unhealthy and `submit` answers 503."""
        try:
            self._serve()
        except BaseException as exc:
            log.critical("the engine worker thread died: %s: %s", type(exc).__name__, exc, exc_info=exc)
            self.crashed = f"{type(exc).__name__}: {exc}"
            with self._cv:
                waiting, self._waiting = list(self._waiting), deque()
            for handle in [slot.handle for slot in self._active] + waiting:
                try:
                    self._fail(handle, engine_unavailable(), "engine_failure")
                except Exception:  # the fault may lie in the bookkeeping itself: the answer comes first
                    handle._push(Failed(engine_unavailable()))
            self._active.clear()

    def _serve(self) -> None:
        while True:
            with self._cv:
                # idle for IDLE_TRIM_SECONDS: hand the recycled buffers and the freed heap back to
                # the OS (not at once: an agent's next turn, or one stream's next request, comes
                # within milliseconds and reuses them)
                if self._idle():
                    self._cv.wait(IDLE_TRIM_SECONDS)
                    if self._idle():
                        self.engine.buffers.trim()
                        release_free_memory()
                while self._idle():
                    self._cv.wait()
                if self._stopping:
                    break
                admitted = []
                while self._waiting and len(self._active) + len(admitted) < self.max_active:
                    admitted.append(self._waiting.popleft())
            starting = [s for s in (self._start(handle) for handle in admitted) if s is not None]
            if self.shared_forwards:
                self._step_together([slot for slot in list(self._active) if self._may_step(slot)], starting)
            else:
                for slot in list(self._active):
                    self._step(slot)
        for slot in self._active:  # shutting down
            slot.gen.cancel()
            slot.handle._push(Failed(APIError("server shutting down", 503, "server_error", None, "shutdown")))
        self._active.clear()

    def _idle(self) -> bool:
        """Nothing to do and not stopping (called with _cv held)."""
        return not self._stopping and not self._waiting and not self._active

    def _start(self, handle: RequestHandle) -> tuple[RequestHandle, Generation, torch.Tensor] | None:
        """Start a request: its prefill runs now, or, when it is a few rows and other requests are
        stepping (`Engine.prefill_rides`), comes back as (handle, generation, prompt rows) for their
        shared step (`_step_together`), whose forward it rides in where it fits."""
        now = time.perf_counter()
        if handle.cancel_reason is not None:
            self._end_unstarted(handle)
            return None
        if now > handle.deadline:
            self._fail(handle, timeout_error(self.request_timeout), "timeout")
            return None
        try:
            gen = self.engine.start(handle.request)
            self._publish("request_started", handle, prompt_tokens=len(handle.request.prompt_ids),
                          max_tokens=handle.request.max_new_tokens, method=gen.spec.method,
                          alpha=gen.spec.alpha, policy=gen.spec.policy, **handle.info)
            if self.metrics:
                self.metrics.started(len(handle.request.prompt_ids), now - handle.arrival)
            if self.shared_forwards and self._active and self.engine.rides_prefills():
                rows = gen.begin_prefill()
                if self.engine.prefill_rides(rows.shape[0]):
                    return handle, gen, rows   # step_many runs it, in the shared forward where it fits
                gen.run_prefill(rows)
            else:
                gen.prefill()
        except ValueError as exc:  # the engine's own request checks (context length, method)
            self._fail(handle, bad_request(str(exc)), "error")
            return None
        except Exception as exc:
            log.exception("prefill failed for %s", handle.id)
            self._fail(handle, internal_error(f"generation failed: {type(exc).__name__}: {exc}"), "error")
            return None
        self._started(handle, gen)
        return None

    def _started(self, handle: RequestHandle, gen: Generation) -> None:
        """A request whose prefill is done: stepped from now on, its first token delivered."""
        if self.metrics:
            self.metrics.prefix_cache_lookup(gen.prompt_len, gen.cached_tokens)
        slot = _Slot(handle, gen)
        self._active.append(slot)
        self._deliver(slot)

    def _may_step(self, slot: _Slot) -> bool:
        """False (and the request ended) when it was cancelled or is past its deadline."""
        handle, gen = slot.handle, slot.gen
        if handle.cancel_reason is not None:
            gen.cancel()
            self._finish(slot)
            return False
        if time.perf_counter() > handle.deadline:
            gen.cancel()
            self._active.remove(slot)
            self._fail(handle, timeout_error(self.request_timeout), "timeout")
            return False
        return True

    def _step(self, slot: _Slot) -> None:
        """One round of one request, its own forward."""
        if not self._may_step(slot):
            return
        try:
            r = slot.gen.step()
        except Exception as exc:
            r = exc
        self._after_round(slot, r)

    def _step_together(self, slots: list[_Slot], starting: list[tuple[RequestHandle, Generation, torch.Tensor]] = ()
                       ) -> None:
        """One round of every active request, their verify rows in one target forward
        (Engine.step_many): the weights are read once for all of them; the prompt rows of the
        requests `starting` ride in it too (their prefill)."""
        if not slots and not starting:
            return
        results = self.engine.step_many([slot.gen for slot in slots], [(gen, rows) for _, gen, rows in starting])
        for slot, r in zip(slots, results):
            self._after_round(slot, r)
        for (handle, gen, _), r in zip(starting, results[len(slots):]):
            if isinstance(r, Exception):
                log.error("prefill failed for %s", handle.id, exc_info=r)
                self._fail(handle, internal_error(f"generation failed: {type(r).__name__}: {r}"), "error")
            else:
                self._started(handle, gen)

    def _after_round(self, slot: _Slot, r) -> None:
        handle, gen = slot.handle, slot.gen
        if isinstance(r, Exception):
            log.error("round failed for %s", handle.id, exc_info=r)
            gen.cancel()
            self._active.remove(slot)
            self._fail(handle, internal_error(f"generation failed: {type(r).__name__}: {r}"), "error")
            return
        if r is not None:
            if self.metrics:
                self.metrics.round(gen.spec.method, r)
            self._publish("round", handle, **r.event())
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
                self._publish("tokens", handle, round=gen.rounds, tokens=[
                    {"id": t, "text": tok.decode([t]) if tok is not None else "", "source": s}
                    for t, s in zip(new, sources)])
        if gen.finished:
            self._finish(slot)

    def _finish(self, slot: _Slot) -> None:
        gen, handle = slot.gen, slot.handle
        if slot in self._active:
            self._active.remove(slot)
        stats, timing = gen.stats(), gen.timing()
        reason = handle.cancel_reason if gen.finish_reason == "cancelled" and handle.cancel_reason else \
            gen.finish_reason or "stop"
        # the place is free before the client hears the end: a client that sends its next request
        # the moment it has this answer must not find the server still full (429)
        self._record_finish(handle, reason, time.perf_counter() - handle.arrival)
        handle._push(Finished(gen.finish_reason or "stop", stats, timing, gen.prompt_len, len(gen.output),
                              gen.cached_tokens))
        self._publish("request_finished", handle, finish_reason=reason, stats=stats, timing=timing)

    def _fail(self, handle: RequestHandle, error: APIError, reason: str) -> None:
        self._release()   # before the client hears it (see _finish)
        handle._push(Failed(error))
        if self.metrics:
            self.metrics.failed(reason)
        self._publish("request_finished", handle, finish_reason=reason, error=error.message)

    def _publish(self, type: str, handle: RequestHandle, **data) -> None:
        """One event of a request. Its owner goes with it so that the stats feed can give the text to
        that viewer only (the feed removes it: app/stats.py)."""
        self.events.publish(type, id=handle.id, owner=handle.owner, **data)

    def _record_finish(self, handle: RequestHandle, reason: str, seconds: float) -> None:
        self._release()
        if self.metrics:
            self.metrics.finished(reason, seconds)
