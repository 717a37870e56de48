"""Prefix cache: the K/V of earlier requests, reused by later requests that start with the same tokens.

An agent loop resends the whole conversation every turn (system prompt, tool schemas, earlier turns,
tool results) and asks for a few dozen tokens; without this cache every turn prefills all of it again.
vLLM (automatic prefix caching), SGLang (RadixAttention) and llama.cpp server (`cache_prompt`) keep
the shared prefix; so do we, with the scheme of vLLM's automatic prefix caching:

    blocks    a sequence is cut into blocks of BLOCK tokens, the keys of its lookup
    key       block i's key = hash(key of block i-1, tokens of block i), seeded with the namespace
              (tenant) and the tapped layers, so one dict lookup per block walks the longest cached
              prefix, and one tenant's prefix can never be found by another
    entry     the K/V (and tapped hidden states, which the drafters catch up from) of one stored
              sequence, positions 0..n-1 (all of them: past its last whole block too), and the K/V
              the request's drafters had built over it (EAGLE-3's and DFlash's caches), so a
              request that reuses the prefix starts with its drafters caught up on it too; views
              of the request's own buffers, not copies (below)
    lookup    walk the new prompt's block keys while they hit; the entry of the deepest hit holds
              the whole matched prefix (entries always start at position 0); its ids are compared
              to the prompt's, so a hash collision can only cost a miss, never a wrong answer; then
              the match goes on token by token into the entry's part block (as SGLang's radix
              tree matches): an agent turn reuses everything up to where it differs, not only
              whole blocks, which left ~BLOCK / 2 tokens a turn to prefill again (under the
              8-stream agent load the cache answered 95.0 % of ~750 prompt tokens a turn with
              whole blocks, 97.0 % to the token: ~15 of the ~35 tokens a turn prefilled)

A request stores its prompt after prefill (so concurrent requests that share a system prompt hit)
and its whole sequence when it finishes (so the next turn of the conversation hits). A newer entry
takes over the keys of the blocks it shares with older ones; an entry left with no keys is dropped,
and beyond the memory budget the least recently used entries go. Hits are copied into the new
request's own cache, so an entry is never in use and eviction never has to wait.

Positions 0..n-1 of a request's cache never change after they are verified (rollback only cuts
drafted positions), so what is stored is exactly what a fresh prefill would have produced up to the
rounding of a differently shaped forward: in float32 the outputs with and without the cache are the
same tokens (tests/test_prefix_cache.py).

The same fact lets an entry keep views of the request's buffers instead of copies: the request goes
on writing past position n-1 only, and when it finishes the entry is what keeps the buffers alive.
Copies of a 1,500-token agent turn (K/V, taps, drafter caches: ~40 MB in bf16, into freshly mapped
pages) cost 70-80 ms a turn, after prefill (inside the time to first token) and at the end. The
budget counts the memory an entry keeps alive: the whole buffers it views (a request's buffers
have room for its answer; they double when they grow), so where those hold more than
MAX_SLACK times the stored positions the entry takes compact copies instead.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

BLOCK = 32  # tokens per cached block: small enough to keep most of a turn, large enough to hash cheaply
MAX_SLACK = 1.5  # an entry keeps views while the buffers they view hold at most this times the stored bytes


@dataclass
class Entry:
    ids: torch.Tensor            # [n] token ids (keys for the n // BLOCK whole blocks)
    k: torch.Tensor              # [layers, kv_heads, n, head_dim]
    v: torch.Tensor
    taps: torch.Tensor | None    # [n, n_taps, hidden], or None when the request tapped no layers
    # drafter name -> its (k, v) over positions 0..s-1, s <= n (s: how far that drafter had caught up)
    drafters: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    keys: list[int] = field(default_factory=list)   # block keys that point at this entry
    nbytes: int = 0
    # the KVCache.lineage of the K/V and the length they are of it (a request that copies them
    # takes both: its prefix is then known to be these bits)
    lineage: object = field(default_factory=object)
    lineage_len: int = 0

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.ids, self.k, self.v, self.taps, *(t for kv in self.drafters.values() for t in kv))
                if t is not None]

    def measure(self) -> int:
        """The bytes this entry keeps alive: the whole buffers under its tensors (views or not)."""
        self.nbytes = held_bytes(self.tensors())
        return self.nbytes

    @property
    def length(self) -> int:
        return self.ids.shape[0]


def held_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct buffers (storages) under `tensors`."""
    storages = {}
    for t in tensors:
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


def _common_length(cached: torch.Tensor, ids: torch.Tensor, start: int, limit: int) -> int:
    """How far `cached` and `ids` agree, knowing they do below `start`, up to `limit` tokens."""
    end = min(cached.shape[0], ids.shape[0], limit)
    differ = (cached[start:end] != ids[start:end]).nonzero()
    return start + int(differ[0]) if differ.numel() else end


def viewed_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _compact(views: tuple) -> tuple:
    """The views (None allowed) as they are, or as compact copies where the buffers under them
    hold more than MAX_SLACK times their bytes."""
    tensors = [t for t in views if t is not None]
    if held_bytes(tensors) <= MAX_SLACK * viewed_bytes(tensors):
        return views
    return tuple(None if t is None else t.clone() for t in views)


@dataclass
class Hit:
    entry: Entry
    length: int                  # tokens reused (at least one BLOCK)


@dataclass
class PrefixCacheStats:
    lookups: int = 0
    hits: int = 0
    prompt_tokens: int = 0       # tokens looked up
    hit_tokens: int = 0          # of which reused
    stored_bytes: int = 0
    entries: int = 0
    evictions: int = 0


class PrefixCache:
    def __init__(self, budget_bytes: int, block: int = BLOCK):
        self.budget = budget_bytes
        self.block = block
        self._entries: OrderedDict[int, Entry] = OrderedDict()   # id(entry) -> entry, least recent first
        self._by_key: dict[int, Entry] = {}
        self._lock = threading.Lock()   # the engine thread writes; /metrics reads the stats
        self.stats = PrefixCacheStats()

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def _keys(self, namespace: str, taps: tuple[int, ...], ids: list[int], blocks: int):
        key = hash((namespace, taps))
        b = self.block
        for i in range(blocks):
            key = hash((key, tuple(ids[i * b:(i + 1) * b])))
            yield key

    def lookup(self, namespace: str, taps_options: tuple[tuple[int, ...], ...], ids: torch.Tensor,
               limit: int) -> Hit | None:
        """The longest cached prefix of `ids` of at most `limit` tokens (one whole block at least)
        among entries stored with any of the given tapped layers."""
        if not self.enabled:
            return None
        id_list = ids[: (limit // self.block) * self.block].tolist()
        with self._lock:
            self.stats.lookups += 1
            self.stats.prompt_tokens += ids.shape[0]
            best: Hit | None = None
            for taps in taps_options:
                hit = self._longest(namespace, taps, id_list)
                if hit is not None and (best is None or hit.length > best.length):
                    best = hit
            if best is None or not torch.equal(best.entry.ids[:best.length], ids[:best.length]):
                return None
            best.length = _common_length(best.entry.ids, ids, best.length, limit)
            self._entries.move_to_end(id(best.entry))
            self.stats.hits += 1
            self.stats.hit_tokens += best.length
            return best

    def _longest(self, namespace: str, taps: tuple[int, ...], id_list: list[int]) -> Hit | None:
        hit = None
        for i, key in enumerate(self._keys(namespace, taps, id_list, len(id_list) // self.block)):
            entry = self._by_key.get(key)
            if entry is None:
                break
            hit = Hit(entry, (i + 1) * self.block)
        return hit

    def store(self, namespace: str, taps: tuple[int, ...], ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              tap_states: torch.Tensor | None,
              drafters: dict[str, tuple[torch.Tensor, torch.Tensor, int]] | None = None,
              lineage: tuple[object, int] | None = None) -> None:
        """Keep positions 0..n-1 of a sequence (at least one whole block): ids [n], k/v [layers, kv_heads, >=n, head_dim];
        `drafters`: name -> (k, v, s), a drafter's cache, valid at positions < s; `lineage`: the
        (KVCache.lineage, lineage_len) of k/v (default: a lineage of their own).

        The entry views k, v, tap_states and the drafter caches (a compact copy where the buffers
        are much larger than what is kept, MAX_SLACK): the caller must never write their first n
        positions again (a request's verified positions, the module docstring)."""
        n = ids.shape[0]
        if not self.enabled or n < self.block:
            return
        keys = list(self._keys(namespace, taps, ids.tolist(), n // self.block))
        drafter_kv = {name: _compact((dk[:, :, :min(s, n)], dv[:, :, :min(s, n)]))
                      for name, (dk, dv, s) in (drafters or {}).items() if s > 0}
        with self._lock:
            last = self._by_key.get(keys[-1])
            if last is not None and last.length >= n and torch.equal(last.ids[:n], ids[:n]):
                # already cached (an earlier turn or request): keep whichever drafter caches reach further
                for name, kv in drafter_kv.items():
                    if name not in last.drafters or last.drafters[name][0].shape[2] < kv[0].shape[2]:
                        last.drafters[name] = kv
                before = last.nbytes
                self.stats.stored_bytes += last.measure() - before
                self._entries.move_to_end(id(last))
                self._evict()
                return
        k, v, tap_states = _compact((k[:, :, :n], v[:, :, :n], None if tap_states is None else tap_states[:n]))
        entry = Entry(ids[:n].clone(), k, v, tap_states, drafter_kv)
        if lineage is not None:
            entry.lineage, entry.lineage_len = lineage[0], min(lineage[1], n)
        else:
            entry.lineage_len = n
        if entry.measure() > self.budget:
            return
        with self._lock:
            for key in keys:
                old = self._by_key.get(key)
                if old is not None:
                    old.keys.remove(key)
                    if not old.keys:   # every block it had is in the new entry too
                        self._drop(old)
                self._by_key[key] = entry
            entry.keys = keys
            self._entries[id(entry)] = entry
            self.stats.stored_bytes += entry.nbytes
            self.stats.entries += 1
            self._evict()

    def _evict(self) -> None:
        """Least recently used entries go until the budget holds (called with the lock held)."""
        while self.stats.stored_bytes > self.budget:
            self._drop(next(iter(self._entries.values())))
            self.stats.evictions += 1

    def _drop(self, entry: Entry) -> None:
        for key in entry.keys:
            if self._by_key.get(key) is entry:
                del self._by_key[key]
        entry.keys = []
        del self._entries[id(entry)]
        self.stats.stored_bytes -= entry.nbytes
        self.stats.entries -= 1

    def clear(self) -> None:
        with self._lock:
            for entry in list(self._entries.values()):
                self._drop(entry)
