"""Handing freed heap back to the OS, so that the server's RSS returns to its level once work ends.

glibc keeps freed memory in its arenas: without a trim, RSS stays at its busiest level after a
burst of generations (their KV caches, the float32 scratch of long prefills) or after a refused
request whose body was parsed (a 2 MB body is ~15 MB of Python objects). The scheduler trims when
it goes idle; `ReleaseMemoryAfterRefusals` trims after refused API requests, which never reach it.

Even trimmed, each malloc arena keeps its partly used pages, and glibc gives threads their own
arenas (up to 8 per core): every request-preparation thread that once parsed a large body kept a
few MB, so RSS crept up in steps (+10-20 MB over ten rounds of tests/test_hostile_live.py's refused
inputs) where with two arenas it stayed flat (+9 MB, once). `limit_malloc_arenas` caps them as
MALLOC_ARENA_MAX does (the server's `malloc_arena_max`, default 2), as many Python servers are run.
Threads then share arenas: the engine thread allocates a few tensors per round, so contention for
an arena's lock should cost it little (not benchmarked: 0 restores glibc's default).

Python's cyclic garbage collector is the other pause a server sees: `freeze_startup_heap` keeps its
full collections off the objects that live as long as the server.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import gc
import os

from .limits import is_api_post

TRIM_DELAY_SECONDS = 0.5  # a trim waits for this long a pause in the refusals...
TRIM_MAX_WAIT_SECONDS = 5.0  # ...but no longer than this after the first one, so a flood still trims
M_ARENA_MAX = -8          # glibc's mallopt() parameter behind MALLOC_ARENA_MAX


def release_free_memory() -> None:
    """Return freed heap memory to the OS (glibc's malloc_trim: ~1-4 ms on a 1 GB heap). A no-op
    where the C library has no malloc_trim (musl, macOS)."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


def freeze_startup_heap() -> int:
    """Take every object alive now out of the cyclic garbage collector's reach (gc.freeze, as vLLM
    does once its engine is up) and return how many that is. A server starts with ~400k tracked
    objects (the target, tokenizer, drafters, transformers and FastAPI modules) that live as long as
    it does; a full collection traverses them all with the GIL held, and under 8 agent streams one
    came every ~40 s and took 300-415 ms, a stall of every stream (bench/gc_freeze_ab.sh,
    bench/results/gc_freeze_ab_zen3_s14.txt). Called once the engine and app are built, before
    serving; objects made later are collected as usual."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def limit_malloc_arenas(count: int) -> None:
    """At most `count` glibc malloc arenas for the threads that start from now on (0: glibc's own
    default). MALLOC_ARENA_MAX in the environment, which glibc has already read, takes precedence."""
    mallopt = getattr(_libc(), "mallopt", None)
    if count > 0 and mallopt is not None and "MALLOC_ARENA_MAX" not in os.environ:
        mallopt(M_ARENA_MAX, count)


# glibc serves allocations below its mmap threshold from its heap arenas, and raises that threshold
# (up to 32 MB) each time it frees a block it had mapped; so request KV caches, prefix-cache entries
# and prefill scratch (1-50 MB each, freed in another order than allocated) soon come from the heap
# and fragment it. Under the 64-stream agent load, RSS grew 1.8 -> 4.6 GB over 300 requests while
# the prefix cache stayed at its 512 MB, all of it handed back by a malloc_trim
# (bench/memory_soak.py). With a fixed threshold, every buffer of MMAP_THRESHOLD or more is its own
# mapping, returned to the OS when freed; smaller ones (activations of a few rows) stay on the heap.
MMAP_THRESHOLD = 4 * 2**20
M_MMAP_THRESHOLD = -3   # mallopt's parameter number (malloc.h)


def keep_large_buffers_off_the_heap(threshold: int = MMAP_THRESHOLD) -> None:
    """Fix glibc's mmap threshold at `threshold` bytes for the rest of the process (see above). A
    no-op where the C library has no mallopt (musl, macOS)."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, threshold)


# PyTorch runs bf16 matmuls through oneDNN (on CPUs with AVX-512 or AMX), and keeps what it built for
# each shape in two caches, each of 1,024 entries by default: oneDNN's primitive cache and PyTorch's
# ideep cache (LRU_CACHE_CAPACITY) in front of it. Every new row count of a dense forward (prefill
# lengths, drafter catch-up) is a new shape, and each costs ~0.25 MB in each cache, so the server's
# heap grew with the variety of prompt lengths it had seen: up to ~0.5 GB more in each (heaptrack:
# oneDNN brgemm primitives were the growth under the 64-stream agent load; 300 row counts x 4 linear
# shapes grew the heap 577 MB). Building a primitive costs ~1 ms (a 3 ms matmul of 230 rows took
# 4.2-4.5 ms the first time), and the shapes that recur (the drafters' few row counts) stay in a
# least-recently-used cache of a few hundred entries; a prefill's dozen new ones go in and out.
KERNEL_CACHE_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_kernel_caches(entries: int) -> None:
    """At most `entries` shapes in each of oneDNN's and ideep's kernel caches (see above). Both read
    their capacity from the environment when first used, so this must run before the first bf16
    matmul; a capacity already set in the environment wins. 0 is refused: ideep crashes with an
    empty cache (segmentation fault in PyTorch 2.13)."""
    if entries < 1:
        raise ValueError("kernel caches need at least one entry")
    for name in KERNEL_CACHE_ENV:
        os.environ.setdefault(name, str(entries))


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


class ReleaseMemoryAfterRefusals:
    """ASGI middleware around the API's POSTs: after one is refused (4xx), trim the heap once the
    request's objects are gone. Debounced on the trailing edge: the trim runs once the refusals pause
    for TRIM_DELAY_SECONDS (at the latest TRIM_MAX_WAIT_SECONDS after the first of them), so a burst
    gets one trim however fast or slow it arrives, and a flood costs a trim every few seconds. The
    trim runs off the event loop."""

    def __init__(self, app):
        self.app = app
        self._timer: asyncio.TimerHandle | None = None
        self._first_refusal = 0.0  # loop time of the oldest refusal not yet trimmed after

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not is_api_post(scope):
            return await self.app(scope, receive, send)
        status = 0

        async def noting_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, noting_status)
        finally:
            if 400 <= status < 500:
                self._trim_soon()

    def _trim_soon(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._timer is None:
            self._first_refusal = now
        else:
            self._timer.cancel()  # another refusal: wait for the pause after it instead
        due = min(now + TRIM_DELAY_SECONDS, self._first_refusal + TRIM_MAX_WAIT_SECONDS)

        def trim():
            self._timer = None
            loop.run_in_executor(None, release_free_memory)

        self._timer = loop.call_at(due, trim)
