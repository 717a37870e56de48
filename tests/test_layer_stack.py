"""kernels/layers.c (layer_stack.py): the decoder layers in one C call give the module forward's bits."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from whiflash_core import decode_ops, layer_stack, q4_1_kernel
from whiflash_core.quant import Q41Linear
from whiflash_core.target import TargetConfig, TargetModel

pytestmark = [pytest.mark.numerics,
              pytest.mark.skipif(not (q4_1_kernel.available() and decode_ops.available()),
                                 reason="needs a C compiler and an x86-64 CPU with AVX2")]

CFG = TargetConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=3, num_heads=4,
                   num_kv_heads=2, head_dim=64, max_position_embeddings=512, tie_word_embeddings=False)
TAPS = (0, 2, 3)   # the embeddings, a middle layer's input and the final-norm output


S = layer_stack.STACK_ROWS   # rows of one request per stack call


def q4_1_target(cfg: TargetConfig = CFG, dense_from_rows: int = 10**9) -> TargetModel:
    """A bf16 target whose decoder linears are random Q4_1 blocks, with the C ops on."""
    torch.manual_seed(0)
    model = TargetModel(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    model = model.bfloat16().eval()
    rng = np.random.default_rng(0)
    for name, mod in list(model.named_modules()):
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            n, k = mod.weight.shape
            q = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
            d = rng.uniform(0.002, 0.01, size=(n, k // 32)).astype(np.float32)
            parent, _, attr = name.rpartition(".")
            dense = mod.weight.data if dense_from_rows < 10**9 else None
            setattr(model.get_submodule(parent), attr, Q41Linear(q, d, -8 * d, dense, dense_from_rows))
    assert decode_ops.use_for(model)
    return model


def run(model: TargetModel, prompt: torch.Tensor, rows: torch.Tensor, stack: bool):
    """(output, the new rows' K/V) of a forward of `rows` after `prompt`, with or without the stack."""
    saved = model.layer_stack
    model.layer_stack = None   # the prompt by the module forward either way (the stack would chunk it)
    try:
        cache = model.new_cache(prompt.shape[0] + rows.shape[0])
        model(prompt, cache)
        model.layer_stack = saved if stack else None
        out = model(rows, cache, TAPS)
        n = prompt.shape[0]
        return out, cache.k[:, :, n:].clone(), cache.v[:, :, n:].clone()
    finally:
        model.layer_stack = saved


@pytest.mark.parametrize("t", [1, 4, 8])
def test_the_stack_is_the_module_forward_bit_for_bit(t):
    model = q4_1_target()
    assert model.layer_stack is not None
    prompt, rows = torch.randint(0, 512, (70,)), torch.randint(0, 512, (t,))
    (ref, k_ref, v_ref), (got, k_got, v_got) = run(model, prompt, rows, False), run(model, prompt, rows, True)
    assert torch.equal(got.logits, ref.logits)
    assert torch.equal(got.taps, ref.taps) and torch.equal(got.last_hidden, ref.last_hidden)
    assert torch.equal(k_got, k_ref) and torch.equal(v_got, v_ref)


def test_shared_forwards_through_the_stack_are_the_module_s():
    """Several requests' rows in one call: each attends over its own cache at its own positions."""
    model = q4_1_target()
    prompts = [torch.randint(0, 512, (n,)) for n in (30, 75)]
    rows = [torch.randint(0, 512, (n,)) for n in (3, 5)]

    def forward_many(stack: bool):
        saved = model.layer_stack
        model.layer_stack = None   # the prompts by the module forward either way
        try:
            caches = [model.new_cache(80) for _ in prompts]
            for p, c in zip(prompts, caches):
                model(p, c)
            model.layer_stack = saved if stack else None
            return model.forward_many(rows, caches, TAPS), caches
        finally:
            model.layer_stack = saved

    (ref, ref_caches), (got, got_caches) = forward_many(False), forward_many(True)
    for r, g, rc, gc in zip(ref, got, ref_caches, got_caches):
        assert torch.equal(g.logits, r.logits) and torch.equal(g.taps, r.taps)
        assert torch.equal(gc.k, rc.k) and torch.equal(gc.v, rc.v) and gc.length == rc.length


def test_the_stack_is_used_only_where_it_applies(monkeypatch):
    model = q4_1_target()
    calls = []
    real_run = layer_stack.LayerStack.run
    monkeypatch.setattr(layer_stack.LayerStack, "run", lambda self, *a: calls.append(a[0].shape[0]) or real_run(self, *a))
    cache = model.new_cache(S + 4 + 8 + 1)
    model(torch.randint(0, 512, (S + 4,)), cache)   # more rows than the stack takes: in chunks
    model(torch.randint(0, 512, (8,)), cache)
    model(torch.randint(0, 512, (1,)), cache)
    assert calls == [S, 4, 8, 1]
    # from the linears' dense_from_rows on, the module forward (the dense copies), not the stack
    calls.clear()
    dense_from_8 = q4_1_target(dense_from_rows=8)
    dense_from_8(torch.randint(0, 512, (20,)), dense_from_8.new_cache(64))
    assert calls == []
    # a copy has other tensors: it runs its modules (and still computes the same)
    twin = copy.deepcopy(model)
    assert twin.layer_stack is None
    # from a linear's dense_from_rows on, the module forward multiplies by the dense copy
    assert q4_1_target(dense_from_rows=4).layer_stack.max_total_rows == 3
    # float32 activations, or a Qwen3 layer (q/k norms): no stack
    converted = q4_1_target().float()
    assert layer_stack.LayerStack.build(converted) is None and not converted.layer_stack.current(converted)
    qwen = TargetConfig(**{**CFG.__dict__, "qk_norm": True})
    assert q4_1_target(qwen).layer_stack is None


@pytest.mark.parametrize("weights", ["int8", "q4_1"])
def test_an_eagle3_chain_step_with_native_ops_is_the_module_step(weights):
    """The drafter side of a q4_1 target (loading.load_engine, decode_ops.use_for): chain steps with
    q/k/v and gate/up stacked and attention in C (int8 weights), or the whole layer in C
    (layer_stack.DraftLayer, Q4_1 weights), give the module path's logits to bf16 rounding, and the
    same chains."""
    from whiflash_core.drafters.base import Context, DraftSampling
    from whiflash_core.loading import random_drafters
    from whiflash_core.quant import quantize_int8, quantize_linears_q4_1

    cfg = TargetConfig(**{**CFG.__dict__, "num_layers": 6, "vocab_size": 2048})
    target = q4_1_target(cfg)
    drafter = random_drafters(target, draft_vocab=512)["eagle3"]
    (quantize_linears_q4_1 if weights == "q4_1" else quantize_int8)(drafter)
    n = 90
    ids = torch.randint(0, cfg.vocab_size, (n + 8,), generator=torch.Generator().manual_seed(1))
    taps = (torch.randn(n + 8, len(drafter.tap_layers), cfg.hidden_size) * 2).bfloat16()
    ctx = Context(ids, n, taps, drafter.tap_layers)

    def chain(native: bool):
        for m in drafter.modules():
            if hasattr(m, "native_ops"):
                m.native_ops = native
        state = drafter.new_state(n + 16)
        logits = []
        real = drafter.logits
        drafter.logits = lambda a: logits.append(real(a)) or logits[-1]
        try:
            # step by step (propose runs a Q4_1 chain in one C call: the next test)
            draft = drafter.propose_many([state], [ctx], [5], [DraftSampling()])[0]
        finally:
            del drafter.logits
        return draft.tokens, torch.cat(logits).float(), state.cache.k[:, :, :n + 5].clone()

    ref, got = chain(False), chain(True)
    assert torch.equal(got[0], ref[0])
    assert (got[1] - ref[1]).abs().max() <= 0.05 * ref[1].abs().max()
    # rotary and the cache writes are PyTorch's bits (decode_ops); attention's output rounds as SDPA's
    assert torch.equal(got[2][:, :, :n], ref[2][:, :, :n])
    assert decode_ops.use_for(drafter) and drafter.layers[0].self_attn.native_ops and drafter.layers[0].mlp.native_ops
    assert (drafter.layers[0].native_layer(0) is not None) == (weights == "q4_1")


def test_requests_of_one_cached_prefix_share_its_reads_and_keep_their_bits(monkeypatch):
    """Caches that copied one prefix-cache entry are of its lineage (KVCache.lineage): the stack
    reads the prefix they share once (attend_segments), and each request's forward is the bits of
    the forward without sharing. A cache of its own lineage shares nothing."""
    from whiflash_core.prefix_cache import PrefixCache

    model = q4_1_target()
    prefix = torch.randint(0, 512, (140,))
    store = PrefixCache(64 * 2**20)
    first = model.new_cache(200)
    model(prefix, first)
    store.store("", (), prefix, first.k, first.v, None, lineage=(first.lineage, first.lineage_len))
    caches = []
    for tail in (5, 9, 0):
        cache = model.new_cache(200)
        hit = store.lookup("", ((),), prefix, limit=140)
        m = hit.length   # 128: whole blocks
        cache.k[:, :, :m], cache.v[:, :, :m] = hit.entry.k[:, :, :m], hit.entry.v[:, :, :m]
        cache.length, cache.lineage, cache.lineage_len = m, hit.entry.lineage, min(hit.entry.lineage_len, m)
        model(torch.randint(0, 512, (tail + 12,)), cache)
        caches.append(cache)
    stranger = model.new_cache(200)
    model(torch.randint(0, 512, (150,)), stranger)
    caches = [first, *caches, stranger]
    rows = [torch.randint(0, 512, (n,)) for n in (1, 1, 2, 4, 1)]

    seen = []
    real = layer_stack.shared_prefixes
    monkeypatch.setattr(layer_stack, "shared_prefixes", lambda segments: seen.append(real(segments)) or seen[-1])
    shared_caches = copy.deepcopy(caches)   # one copy of the list: the lineages stay shared
    got = model.forward_many(rows, shared_caches, TAPS)
    assert seen == [([0, 0, 0, 0, 4], [128, 128, 128, 128, 0])]
    monkeypatch.setattr(layer_stack, "shared_prefixes", lambda segments: None)
    alone_caches = copy.deepcopy(caches)
    ref = model.forward_many(rows, alone_caches, TAPS)
    for r, g, rc, gc in zip(ref, got, alone_caches, shared_caches):
        assert torch.equal(g.logits, r.logits) and torch.equal(g.taps, r.taps)
        assert torch.equal(gc.k, rc.k) and torch.equal(gc.v, rc.v)


@pytest.mark.parametrize("t,logits_from", [(S + 1, 0), (2 * S + 8, 2 * S + 7), (2 * S + 8, 10)])
def test_more_rows_than_the_stack_takes_run_through_it_in_chunks(monkeypatch, t, logits_from):
    """Below the linears' dense copies, a forward of more rows than the stack takes runs as stack
    forwards of its most rows each: the bits of those forwards one after another, logits from
    `logits_from` on, and the module forward's values to within bf16 rounding."""
    model = q4_1_target()
    calls = []
    real_run = layer_stack.LayerStack.run
    monkeypatch.setattr(layer_stack.LayerStack, "run", lambda self, *a: calls.append(a[0].shape[0]) or real_run(self, *a))
    prompt, rows = torch.randint(0, 512, (30,)), torch.randint(0, 512, (t,))
    size = model.layer_stack.max_rows

    def prefilled():
        cache = model.new_cache(30 + t)
        model(prompt, cache)
        return cache

    cache = prefilled()
    calls.clear()
    got = model(rows, cache, TAPS, logits_from=logits_from)
    assert calls == [min(size, t - a) for a in range(0, t, size)]
    assert got.logits.shape == (t - logits_from, 512) and got.taps.shape[0] == got.last_hidden.shape[0] == t
    by_hand = prefilled()   # each chunk's LM head over its rows from logits_from on
    parts = [model(rows[a:a + size], by_hand, TAPS, logits_from=min(max(logits_from - a, 0), size))
             for a in range(0, t, size)]
    assert torch.equal(got.logits, torch.cat([p.logits for p in parts]))
    assert torch.equal(got.taps, torch.cat([p.taps for p in parts])) and torch.equal(cache.k, by_hand.k)
    saved, model.layer_stack = model.layer_stack, None   # the module forward, all rows at once
    try:
        module = model(rows, prefilled(), TAPS, logits_from=logits_from)
    finally:
        model.layer_stack = saved
    assert torch.allclose(got.logits, module.logits, atol=0.1, rtol=0.05)


@pytest.mark.parametrize("fc_norm,norm_output", [(True, False), (False, True)])
def test_an_eagle3_chain_in_one_c_call_is_the_step_by_step_chain(fc_norm, norm_output):
    """Eagle3Drafter.propose for one greedy request runs its catch-up and its whole chain in C
    (layer_stack.EagleChain): the same draft tokens and the same drafter-cache K/V, bit for bit, as
    the module path over the same kernels (the chain switched off), for chains of 1 to 6 tokens
    after catch-ups of 1 to 69 positions, with and without fc norms."""
    from whiflash_core import layer_stack as ls
    from whiflash_core.drafters.base import Context, DraftSampling
    from whiflash_core.drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from whiflash_core.quant import quantize_linears_q4_1

    cfg = TargetConfig(**{**CFG.__dict__, "num_layers": 6, "vocab_size": 2048})
    target = q4_1_target(cfg)
    dcfg = Eagle3Config(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                        vocab_size=cfg.vocab_size, draft_vocab_size=512, tap_layers=[1, 3, 4],
                        fc_norm=fc_norm, norm_output=norm_output)
    rows = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(5))[:512].sort().values
    drafter = Eagle3Drafter.random(dcfg, target.embed_tokens, seed=3, dtype=torch.bfloat16, vocab_rows=rows)
    quantize_linears_q4_1(drafter)
    assert decode_ops.use_for(drafter)
    chain = drafter._chain()
    assert isinstance(chain, ls.EagleChain)
    n = 70
    ids = torch.randint(0, cfg.vocab_size, (n + 8,), generator=torch.Generator().manual_seed(2))
    taps = (torch.randn(n + 8, 3, cfg.hidden_size, generator=torch.Generator().manual_seed(4)) * 2).bfloat16()

    def draft(in_c: bool, k: int, seen: int):
        """A state caught up to `seen` positions, then a k-token draft at n."""
        drafter.__dict__["_chain_c"] = chain if in_c else None
        state = drafter.new_state(n + 1)   # grows to hold the chain
        if seen:
            drafter.catch_up(state, Context(ids, seen + 1, taps, drafter.tap_layers))
        out = drafter.propose(state, Context(ids, n, taps, drafter.tap_layers), k, DraftSampling())
        return out.tokens, state

    try:
        for k, seen in ((1, 0), (3, 68), (6, 40)):
            (got, one), (ref, many) = draft(True, k, seen), draft(False, k, seen)
            assert got.shape == (k,) and torch.equal(got, ref)
            assert (one.n_seen, one.cache.length) == (many.n_seen, many.cache.length) == (n, n)
            end = n + k - 1   # the chain's own positions too: the same K/V written by the same kernels
            assert torch.equal(one.cache.k[:, :, :end], many.cache.k[:, :, :end])
            assert torch.equal(one.cache.v[:, :, :end], many.cache.v[:, :, :end])
    finally:
        drafter.__dict__["_chain_c"] = chain
    # where a piece has no C kernel the drafter keeps its module path
    for m in drafter.modules():
        if hasattr(m, "native_ops"):
            m.native_ops = False
    assert drafter._chain() is None
