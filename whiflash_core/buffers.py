"""A pool of the large per-request buffers (the target's KV cache and the tapped hidden states),
recycled from one request to the next. (The drafters' caches are a few % of those, below glibc's
mmap threshold: the heap serves them without page faults.)

Why: a request's buffers are megabytes (a 750-token agent turn: ~20 MB of K/V and taps in bf16),
and each is its own fresh mapping (app/memory.py fixes glibc's mmap threshold so
that freed buffers go back to the OS): the first write to every 4 KB page faults and the kernel
zeroes it. Under an 8-stream agent load that was 18% of the engine thread (py-spy: ~23 ms a
request in `Generation.__init__` and the prefix copy), and it sat inside every time to first token.
A recycled buffer's pages are already mapped.

Ownership needs no bookkeeping: the pool keeps every buffer it lends and counts the tensors that
view its storage (torch's storage use count). A buffer is free again when the pool's is the only
one left: the request that took it has finished and no prefix-cache entry views it any more
(those keep views of a finished request's buffers, prefix_cache.py), whatever order that
happens in.

Contents: a recycled buffer holds an earlier request's numbers (it is not zeroed: that is the
cost this saves). Nothing reads a position that its own request has not written (attention reads
positions < cache.length, drafters < n_seen, the taps < the verified length), which
tests/test_buffers.py checks by poisoning every recycled buffer with NaN.

Bounded: free buffers are kept up to `keep_bytes`; beyond that the largest free ones are
dropped (their memory goes back to the OS), and `trim()` drops them all (the server does when it
has been idle a moment).
"""
from __future__ import annotations

import math
import threading

import torch

# A buffer is lent only for a request of at most this much less than its size, so that a short
# request does not pin a long one's buffer (the prefix cache counts the whole buffer an entry views).
MAX_WASTE = 1.25
# Sizes are rounded up to one of 8 classes per power of two (at most +12.5%), so that the buffers
# of requests of slightly different lengths (a conversation's consecutive turns) fit each other.
CLASSES_PER_OCTAVE = 8


def size_class(nbytes: int) -> int:
    """nbytes rounded up to the next of CLASSES_PER_OCTAVE sizes per power of two."""
    if nbytes <= 4096:
        return 4096
    step = 2 ** (math.ceil(math.log2(nbytes)) - 1) // CLASSES_PER_OCTAVE
    return -(-nbytes // step) * step


def _users(t: torch.Tensor) -> int:
    """How many references hold t's storage (tensors viewing it, and the Python storage object
    this call makes)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


_ALONE = _users(torch.empty(1))   # a tensor nothing else views


class BufferPool:
    def __init__(self, keep_bytes: int = 256 * 2**20):
        self.keep_bytes = keep_bytes
        self._lent: list[torch.Tensor] = []    # flat uint8 buffers in use (someone views them)
        self._free: list[torch.Tensor] = []    # flat uint8 buffers nobody views
        self.free_bytes = 0                     # their bytes (read by /metrics from another thread)
        self._lock = threading.Lock()
        self.reused = 0      # buffers handed out again
        self.allocated = 0   # buffers newly allocated

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """An uninitialised tensor of `shape` (a view of a pooled buffer: it may hold an earlier
        request's values; write before you read). Off the CPU it is a plain torch.empty."""
        if torch.device(device).type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        need = math.prod(shape) * dtype.itemsize
        with self._lock:
            self._collect()
            buf = self._take(need)
            if buf is None:
                buf = torch.empty(size_class(need), dtype=torch.uint8)
                self.allocated += 1
            else:
                self.reused += 1
            self._lent.append(buf)
        return buf[:need].view(dtype).view(shape)

    def trim(self) -> None:
        """Drop every free buffer (their memory goes back to the OS)."""
        with self._lock:
            self._collect()
            self._free.clear()
            self.free_bytes = 0

    def _collect(self) -> None:
        """Move the lent buffers that no tensor views any more to the free list, then drop the
        largest free ones beyond keep_bytes."""
        still = []
        for buf in self._lent:
            (self._free if _users(buf) <= _ALONE else still).append(buf)
        self._lent = still
        self._free.sort(key=lambda b: b.numel())
        free = sum(b.numel() for b in self._free)
        while self._free and free > self.keep_bytes:
            free -= self._free.pop().numel()
        self.free_bytes = free

    def _take(self, need: int) -> torch.Tensor | None:
        """The smallest free buffer of at least `need` bytes and at most MAX_WASTE times them."""
        for i, buf in enumerate(self._free):   # sorted by size
            if buf.numel() >= need:
                if buf.numel() > MAX_WASTE * size_class(need):
                    return None
                self.free_bytes -= buf.numel()
                return self._free.pop(i)
        return None
