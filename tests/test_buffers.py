"""The buffer pool (whiflash_core/buffers.py): a buffer is lent again only once nothing views it,
and a recycled buffer's old contents never reach a request's tokens (every pooled buffer poisoned
with NaN gives the same tokens as fresh zeros: tiny model in float64 and the served int4 model)."""
from __future__ import annotations

import pytest
import torch

from tiny import VOCAB, tiny_dflash, tiny_eagle, tiny_target
from whiflash_core.buffers import MAX_WASTE, BufferPool, size_class
from whiflash_core.chat import encode_chat
from whiflash_core.engine import Engine, GenerationRequest, SpeculationConfig
from whiflash_core.prefix_cache import PrefixCache

MB = 2**20


def test_a_buffer_is_lent_again_only_once_nothing_views_it():
    pool = BufferPool()
    a = pool.empty((4, 1000), torch.float32)
    ptr = a.untyped_storage().data_ptr()
    kept = a[:, :10]                  # what a prefix-cache entry keeps: a view
    del a
    b = pool.empty((4, 1000), torch.float32)
    assert b.untyped_storage().data_ptr() != ptr   # still viewed: not lent
    del kept
    c = pool.empty((4, 1000), torch.float32)
    assert c.untyped_storage().data_ptr() == ptr   # free again: the same buffer
    assert (pool.allocated, pool.reused) == (2, 1)
    del b, c


def test_a_buffer_much_larger_than_asked_for_is_not_lent():
    pool = BufferPool()
    big = pool.empty((10 * MB,), torch.uint8)
    ptr = big.untyped_storage().data_ptr()
    del big
    small = pool.empty((MB,), torch.uint8)          # 10x smaller: a new buffer
    assert small.untyped_storage().data_ptr() != ptr
    near = pool.empty((int(10 * MB / MAX_WASTE) + 1,), torch.uint8)   # within MAX_WASTE: the big one
    assert near.untyped_storage().data_ptr() == ptr


def test_free_buffers_are_bounded_and_trimmed():
    pool = BufferPool(keep_bytes=3 * MB)
    held = [pool.empty((MB,), torch.uint8) for _ in range(5)]
    del held
    small = pool.empty((16,), torch.uint8)    # collects: 5 MB free, 3 kept (none of them lent for 16 bytes)
    assert pool.free_bytes == 3 * MB
    again = pool.empty((MB,), torch.uint8)
    assert pool.free_bytes == 2 * MB and pool.reused == 1
    del again, small
    pool.trim()
    assert pool.free_bytes == 0


def test_size_classes_round_up_by_at_most_an_eighth():
    for n in (5000, 4 * MB + 1, 17 * MB, 123_456_789):
        assert n <= size_class(n) <= n * 1.125 + 1
    assert size_class(4 * MB) == 4 * MB


class PoisonedPool(BufferPool):
    """Every lent buffer filled with NaN: a position read before its request wrote it shows."""

    def empty(self, shape, dtype, device="cpu"):
        return super().empty(shape, dtype, device).fill_(float("nan"))


class FreshZeros:
    """No pool: fresh zeros, as before the pool."""

    def empty(self, shape, dtype, device="cpu"):
        return torch.zeros(shape, dtype=dtype, device=device)


def run_agent_turns(eng: Engine, prompts: list[list[int]], spec: SpeculationConfig, turns: int, max_new: int,
                    extend) -> list[tuple[list[int], int]]:
    """Several conversations stepped together (shared forwards), each turn's prompt the last one
    + its answer + a new message (prefix-cache hits): every turn's (output, accepted tokens)."""
    outputs = []
    for turn in range(turns):
        gens = [eng.start(GenerationRequest(p, max_new, speculation=spec)) for p in prompts]
        for g in gens:
            g.prefill()
        while not all(g.finished for g in gens):
            results = eng.step_many([g for g in gens if not g.finished])
            assert not any(isinstance(r, Exception) for r in results), results
        # the tokens, and what the drafters had accepted (stale drafter inputs would not change the
        # tokens, which the target verifies, but would change what was accepted)
        outputs += [(g.output, g.stats()["accepted_tokens"]) for g in gens]
        prompts = [p + g.output + extend(turn, i) for i, (p, g) in enumerate(zip(prompts, gens))]
    return outputs


@pytest.mark.numerics
@pytest.mark.parametrize("method", ["whiflash", "eagle3", "dflash", "ngram", "none"])
def test_recycled_buffers_never_reach_the_tokens_tiny_float64(method):
    def engine(buffers) -> Engine:
        target = tiny_target()
        eng = Engine(target, None, {"eagle3": tiny_eagle(target), "dflash": tiny_dflash(target)},
                     prefix_cache=PrefixCache(10**8))
        eng.buffers = buffers
        return eng

    def message(turn, i):
        return torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(100 * turn + i)).tolist()

    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (70, 41)]
    spec = SpeculationConfig(method=method, entropy_threshold=3.0)
    poisoned = PoisonedPool()
    got = run_agent_turns(engine(poisoned), prompts, spec, 4, 30, message)
    want = run_agent_turns(engine(FreshZeros()), prompts, spec, 4, 30, message)
    assert got == want
    assert poisoned.reused > 0   # the check has teeth: later turns ran in earlier turns' buffers


def test_recycled_buffers_never_reach_the_tokens_served_int4(one_torch_thread):
    """What `make run` serves (int4 where this CPU decodes it fastest, bf16; its C attention and
    layer stack): both runs have the same forward shapes, so the same bits, unless a recycled
    buffer's contents were read."""
    from whiflash_core.loading import load_engine

    # one thread, as the server steps requests on 2 cores: the formats timed are the server's (cached)
    eng = load_engine(dtype="bfloat16", weights="auto", measure_costs=False)
    eng.prefix_cache = PrefixCache(256 * MB)
    tok = eng.tokenizer
    prompts = [encode_chat(tok, [{"role": "user", "content": q}]) for q in
               ("What is a hash table? Answer in two sentences.", "Write a haiku about the sea.")]

    def message(turn, i):
        return tok.encode(f"\nUser: and then, question {turn}-{i}?\nAssistant:")

    # one drafter each, at its fixed draft length: the same forward shapes in both runs (a routed
    # method's choices follow the round timings it measures)
    for method in ("eagle3", "dflash"):
        spec = SpeculationConfig(method=method)
        runs = {}
        for name, buffers in (("poisoned", PoisonedPool()), ("zeros", FreshZeros())):
            eng.prefix_cache.clear()
            eng.buffers = buffers
            runs[name] = run_agent_turns(eng, prompts, spec, 3, 24, message)
        assert runs["poisoned"] == runs["zeros"], method
        assert all(len(o) > 0 for o, _ in runs["zeros"])
