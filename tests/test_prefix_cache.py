"""The prefix cache: the bookkeeping on its own, then exactness of every method with it on and off
(float64 tiny model; the real model in float32 is checked in test_engine_real / test_gateway)."""
from __future__ import annotations

import pytest
import torch

from tiny import VOCAB, tiny_dflash, tiny_eagle, tiny_target
from whiflash_core.engine import METHODS, Engine, GenerationRequest, SpeculationConfig
from whiflash_core.prefix_cache import BLOCK, MAX_SLACK, PrefixCache

TAPS = (1, 3)


def kv(n: int, fill: float = 1.0):
    """Fake K/V of n positions ([layers=2, kv_heads=1, n, head_dim=4]) whose values name their position."""
    k = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1).expand(2, 1, n, 4).clone() * fill
    return k, k.clone()


def ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed))


def test_longest_prefix_to_the_token_and_never_the_whole_prompt():
    cache = PrefixCache(10**8)
    seq = ids(5 * BLOCK + 7)
    cache.store("", TAPS, seq, *kv(len(seq)), None)
    # the same prompt again: everything cached, but the limit leaves the last token to compute
    hit = cache.lookup("", (TAPS,), seq[: 3 * BLOCK], limit=3 * BLOCK - 1)
    assert hit.length == 3 * BLOCK - 1
    # a longer prompt that shares 4 blocks and 10 tokens of the 5th: all of them, past the blocks
    other = torch.cat([seq[: 4 * BLOCK + 10], ids(50, seed=1)])
    assert other[4 * BLOCK + 10] != seq[4 * BLOCK + 10]
    hit = cache.lookup("", (TAPS,), other, limit=len(other) - 1)
    assert hit.length == 4 * BLOCK + 10
    assert torch.equal(hit.entry.k[0, 0, : hit.length, 0], torch.arange(hit.length, dtype=torch.float32))
    # the stored sequence's part block too (its 7 tokens past the 5th block), up to the limit
    longer = torch.cat([seq, ids(20, seed=2)])
    assert cache.lookup("", (TAPS,), longer, limit=len(longer) - 1).length == 5 * BLOCK + 7
    assert cache.lookup("", (TAPS,), longer, limit=5 * BLOCK + 3).length == 5 * BLOCK + 3
    # shares less than one whole block: nothing (a block's key is what finds an entry)
    assert cache.lookup("", (TAPS,), torch.cat([seq[:BLOCK - 1], ids(40, seed=3)]), limit=60) is None
    # differs in the first block: nothing
    changed = seq.clone()
    changed[3] += 1
    assert cache.lookup("", (TAPS,), changed, limit=len(changed) - 1) is None
    s = cache.stats
    assert (s.lookups, s.hits, s.hit_tokens) == (6, 4, (3 * BLOCK - 1) + (4 * BLOCK + 10) + (5 * BLOCK + 7)
                                                 + (5 * BLOCK + 3))


def test_a_sequence_shorter_than_a_block_is_not_stored_and_a_longer_tail_replaces_a_shorter():
    cache = PrefixCache(10**8)
    cache.store("", TAPS, ids(BLOCK - 1), *kv(BLOCK - 1), None)
    assert cache.stats.entries == 0
    seq = ids(2 * BLOCK + 20)
    cache.store("", TAPS, seq[:2 * BLOCK + 5], *kv(2 * BLOCK + 5), None)
    cache.store("", TAPS, seq, *kv(len(seq)), None)            # same blocks, longer tail
    assert cache.lookup("", (TAPS,), seq, limit=len(seq)).length == len(seq)
    assert cache.stats.entries == 1                              # it took over the shorter one's keys
    cache.store("", TAPS, seq[:2 * BLOCK + 5], *kv(2 * BLOCK + 5), None)   # already held: nothing new
    assert cache.stats.entries == 1 and cache.lookup("", (TAPS,), seq, limit=len(seq)).length == len(seq)


def test_namespaces_and_tapped_layers_are_separate():
    cache = PrefixCache(10**8)
    seq = ids(3 * BLOCK)
    cache.store("tenant-a", TAPS, seq, *kv(len(seq)), None)
    assert cache.lookup("tenant-b", (TAPS,), seq, limit=len(seq)) is None
    assert cache.lookup("tenant-a", ((),), seq, limit=len(seq)) is None   # stored with other taps
    assert cache.lookup("tenant-a", ((), TAPS), seq, limit=len(seq)).length == 3 * BLOCK


def test_a_longer_sequence_takes_over_the_shorter_one_it_extends():
    cache = PrefixCache(10**8)
    turn1 = ids(2 * BLOCK)
    cache.store("", TAPS, turn1, *kv(len(turn1)), None)
    turn2 = torch.cat([turn1, ids(2 * BLOCK, seed=5)])
    cache.store("", TAPS, turn2, *kv(len(turn2)), None)
    assert cache.stats.entries == 1   # the first entry had no block the second lacks
    assert cache.lookup("", (TAPS,), turn2, limit=len(turn2)).length == 4 * BLOCK
    # storing what is already cached changes nothing
    before = cache.stats.stored_bytes
    cache.store("", TAPS, turn1, *kv(len(turn1)), None)
    assert (cache.stats.entries, cache.stats.stored_bytes) == (1, before)


def test_least_recently_used_entries_go_beyond_the_budget():
    one = sum(t.numel() * t.element_size() for t in (ids(BLOCK), *kv(BLOCK)))
    cache = PrefixCache(3 * one)
    seqs = [ids(BLOCK, seed=s) for s in range(4)]
    for s in seqs[:3]:
        cache.store("", TAPS, s, *kv(BLOCK), None)
    cache.lookup("", (TAPS,), seqs[0], limit=BLOCK)       # seqs[0] is now the most recent
    cache.store("", TAPS, seqs[3], *kv(BLOCK), None)       # evicts seqs[1], the least recent
    assert cache.stats.stored_bytes <= 3 * one
    found = [cache.lookup("", (TAPS,), s, limit=BLOCK) is not None for s in seqs]
    assert found == [True, False, True, True]
    assert cache.stats.evictions == 1
    # an entry larger than the whole budget is not stored
    cache.store("", TAPS, ids(4 * BLOCK, seed=9), *kv(4 * BLOCK), None)
    assert cache.lookup("", (TAPS,), ids(4 * BLOCK, seed=9), limit=4 * BLOCK) is None


def test_an_entry_views_the_buffers_it_is_given_unless_they_are_much_larger():
    """No copy where the buffers are about the stored size (a request's cache with room for its
    answer): the entry shares their memory and counts all of it. Where they are more than MAX_SLACK
    times larger, it keeps compact copies, so the budget bounds the memory it holds."""
    cache = PrefixCache(10**8)
    seq = ids(4 * BLOCK)
    k, v = kv(4 * BLOCK + 20)                              # 20 spare positions: a view
    cache.store("", TAPS, seq, k, v, None)
    entry = cache.lookup("", (TAPS,), seq, limit=len(seq)).entry
    assert entry.k.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
    assert cache.stats.stored_bytes == entry.nbytes == k.nbytes + v.nbytes + seq.nbytes
    seq2 = ids(2 * BLOCK, seed=2)
    k2, v2 = kv(int(2 * BLOCK * MAX_SLACK) + 1)            # too much spare room: copies
    cache.store("", TAPS, seq2, k2, v2, None)
    entry2 = cache.lookup("", (TAPS,), seq2, limit=len(seq2)).entry
    assert entry2.k.untyped_storage().data_ptr() != k2.untyped_storage().data_ptr()
    assert torch.equal(entry2.k, k2[:, :, :2 * BLOCK]) and entry2.k.shape[2] == 2 * BLOCK


def test_a_hash_collision_is_a_miss_not_a_wrong_prefix(monkeypatch):
    cache = PrefixCache(10**8)
    monkeypatch.setattr(PrefixCache, "_keys", lambda self, ns, taps, id_list, blocks: iter(range(blocks)))
    seq = ids(2 * BLOCK)
    cache.store("", TAPS, seq, *kv(len(seq)), None)
    assert cache.lookup("", (TAPS,), ids(2 * BLOCK, seed=3), limit=2 * BLOCK) is None   # same keys, other ids
    assert cache.lookup("", (TAPS,), seq, limit=2 * BLOCK).length == 2 * BLOCK


# -- the engine: a multi-turn conversation with the cache on and off ------------------------------------


def engine(cache_bytes: int) -> Engine:
    target = tiny_target()
    return Engine(target, None, {"eagle3": tiny_eagle(target), "dflash": tiny_dflash(target)},
                  prefix_cache=PrefixCache(cache_bytes))


def conversation(eng: Engine, spec: SpeculationConfig, turns: int = 4, namespace: str = "") -> list[tuple]:
    """(output, cached tokens) per turn; each turn's prompt is the previous prompt + answer + a new message."""
    prompt = torch.randint(0, VOCAB, (70,), generator=torch.Generator().manual_seed(11)).tolist()
    out = []
    for turn in range(turns):
        gen = eng.generate(GenerationRequest(prompt, 30, speculation=spec, cache_namespace=namespace))
        out.append((gen.output, gen.cached_tokens))
        message = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(100 + turn)).tolist()
        prompt = prompt + gen.output + message
    return out


@pytest.mark.numerics
@pytest.mark.parametrize("method", METHODS)
def test_every_method_gives_the_same_tokens_with_the_prefix_cache_float64(method):
    spec = SpeculationConfig(method=method, entropy_threshold=3.0)
    off = conversation(engine(0), spec)
    on = conversation(engine(10**8), spec)
    assert [o for o, _ in on] == [o for o, _ in off]
    assert [c for _, c in off] == [0, 0, 0, 0]
    cached = [c for _, c in on]
    assert cached[0] == 0
    # turn t reuses turn t-1's prompt and answer, to the token (all but the answer's last token,
    # which no forward had run yet; the new message is not cached yet)
    prompt_len = 70
    for (output, _), c in zip(on, cached[1:]):
        assert c == prompt_len + len(output) - 1, cached
        prompt_len += len(output) + 9


def test_tenants_do_not_share_prefixes():
    eng = engine(10**8)
    spec = SpeculationConfig(method="eagle3")
    a = conversation(eng, spec, turns=2, namespace="a")
    b = conversation(eng, spec, turns=2, namespace="b")
    assert a[1][1] > 0 and b[0][1] == 0   # b's first turn finds nothing of a's identical prompt
    assert [o for o, _ in a] == [o for o, _ in b]


def test_a_plain_decode_request_reuses_a_prefix_stored_by_a_drafting_one():
    eng = engine(10**8)
    prompt = torch.randint(0, VOCAB, (100,), generator=torch.Generator().manual_seed(4)).tolist()
    eng.generate(GenerationRequest(prompt, 10, speculation=SpeculationConfig(method="whiflash")))
    gen = eng.generate(GenerationRequest(prompt, 10, speculation=SpeculationConfig(method="none")))
    assert gen.cached_tokens == 99   # all but the last prompt token, whose logits choose the first


@pytest.mark.numerics
@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_a_reused_prefix_brings_the_drafters_caught_up_on_it(method):
    """The drafters' caches are stored with the target's: a request that reuses a prefix starts with
    its drafter's K/V over it (as far as the prefix determines them: EAGLE-3 pairs position t with
    token t + 1, so it gets one position less), equal to what catching up from scratch computes."""
    eng = engine(10**8)
    spec = SpeculationConfig(method=method)
    first = torch.randint(0, VOCAB, (100,), generator=torch.Generator().manual_seed(7)).tolist()
    eng.generate(GenerationRequest(first, 20, speculation=spec))
    # the new prompt leaves the stored sequence right after the second block, so the token after
    # the reused prefix differs from the one the stored drafter cache was computed with
    prompt = first[:2 * BLOCK] + [(t + 1) % VOCAB for t in first[2 * BLOCK:2 * BLOCK + 10]]
    gen = eng.start(GenerationRequest(prompt, 20, speculation=spec))
    gen.prefill()
    assert gen.cached_tokens == 2 * BLOCK
    state = gen.states[method]
    reused = 2 * BLOCK - (1 if method == "eagle3" else 0)
    assert state.n_seen == reused
    fresh = eng.drafters[method].new_state(len(prompt) + 8)
    eng.drafters[method].catch_up(fresh, gen._context())
    assert torch.allclose(state.cache.k[:, :, :reused], fresh.cache.k[:, :, :reused], rtol=0, atol=1e-12)
    assert torch.allclose(state.cache.v[:, :, :reused], fresh.cache.v[:, :, :reused], rtol=0, atol=1e-12)
    while not gen.finished:
        gen.step()
    off = engine(0).generate(GenerationRequest(prompt, 20, speculation=spec))
    assert gen.output == off.output


@pytest.mark.parametrize("method", ["eagle3", "dflash", "whiflash"])
def test_what_a_running_request_stored_does_not_change_as_it_goes_on(method):
    """A request stores its prompt after prefill as views of its own buffers, then goes on writing
    drafts, verified tokens and rollbacks into them: the stored positions must stay as they were,
    and a later request reusing them must get the same tokens as one without the cache."""
    eng = engine(10**8)
    spec = SpeculationConfig(method=method, entropy_threshold=3.0)
    prompt = torch.randint(0, VOCAB, (6 * BLOCK + 5,), generator=torch.Generator().manual_seed(21)).tolist()
    gen = eng.start(GenerationRequest(prompt, 40, speculation=spec))
    gen.prefill()
    entry = eng.prefix_cache.lookup("", (eng.tap_layers,), torch.tensor(prompt), limit=len(prompt)).entry
    assert entry.k.untyped_storage().data_ptr() == gen.cache.k.untyped_storage().data_ptr()   # a view
    snapshot = [t.clone() for t in entry.tensors()]
    while not gen.finished:
        gen.step()
    assert all(torch.equal(a, b) for a, b in zip(snapshot, entry.tensors()))
    again = eng.generate(GenerationRequest(prompt, 40, speculation=spec))
    assert again.cached_tokens == len(prompt) - 1
    assert again.output == engine(0).generate(GenerationRequest(prompt, 40, speculation=spec)).output
