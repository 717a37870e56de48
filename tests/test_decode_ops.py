"""kernels/decode_ops.c against the PyTorch ops it replaces (layers.py, target.py) in bf16."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from whiflash_core import decode_ops
from whiflash_core.layers import RMSNorm, Rotary, apply_rope, attend, attention_mask
from whiflash_core.target import TargetConfig, TargetModel

pytestmark = [pytest.mark.numerics,
              pytest.mark.skipif(not decode_ops.available(), reason="needs a C compiler and an x86-64 CPU with AVX2")]


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps apart two bf16 tensors of the same signs are."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def test_rms_norm_is_the_module_s():
    torch.manual_seed(0)
    norm = RMSNorm(576, 1e-5).bfloat16()
    norm.weight.data = (torch.rand(576) + 0.5).bfloat16()
    for rows in (1, 4, 17):
        x = (torch.randn(rows, 576) * 3).bfloat16()
        ref, got = norm(x), decode_ops.rms_norm(x, norm.weight, 1e-5)
        # the same roundings; only the sum of squares may be added in another order
        assert (ref == got).float().mean() > 0.99
        assert _ulps_apart(ref, got).max() <= 1


def test_silu_mul_is_swiglu_s():
    torch.manual_seed(1)
    gate_up = (torch.randn(5, 2 * 1536) * 4).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    ref, got = F.silu(gate) * up, decode_ops.silu_mul(gate_up)
    assert (ref == got).float().mean() > 0.99
    assert _ulps_apart(ref, got).max() <= 1


def _pytorch_attention(qkv, cos, sin, k_cache, v_cache, start, nh, nkv, hd, dtype=None):
    """target.Attention.attend_rows' PyTorch path (optionally run in another dtype)."""
    t = qkv.shape[0]
    q3 = qkv.view(t, nh + 2 * nkv, hd)
    qk = apply_rope(q3[:, :nh + nkv].transpose(0, 1), cos, sin)
    k_cache[:, start:start + t] = qk[nh:]
    v_cache[:, start:start + t] = q3[:, nh + nkv:].transpose(0, 1)
    q, k, v = qk[:nh], k_cache[:, :start + t], v_cache[:, :start + t]
    if dtype is not None:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    return attend(q, k, v, attention_mask(t, start, nh, nkv, q.dtype))


HAS_TILES = decode_ops.available() and decode_ops.use_amx_attention(True)
decode_ops.use_amx_attention(False)


@pytest.fixture(params=["fma", "tiles"])
def attention_path(request):
    """Each attention test twice where the CPU has AMX: with the float32 FMA path and with the tile
    path (kernels/decode_ops.c attend_lanes_task_amx, 8 or more queries a kv head, hd = 64)."""
    if request.param == "tiles" and not HAS_TILES:
        pytest.skip("this CPU (or this build: AVX2 class) has no AMX tiles: the FMA path is the only one")
    decode_ops.use_amx_attention(request.param == "tiles")
    yield request.param
    from whiflash_core import tiles
    tiles.apply(tiles.current())   # what the process had chosen (tests alone: off)


@pytest.mark.parametrize("hd", [32, 64, 128])
@pytest.mark.parametrize("t,start", [(1, 0), (1, 63), (2, 63), (2, 200), (3, 62), (8, 64), (5, 300), (16, 50),
                                     (4, 17), (11, 100)])
def test_attention_writes_the_cache_and_attends_as_sdpa(hd, t, start, attention_path):
    """Rotary and the cache writes are PyTorch's bits; the attention output is as close to a
    float64 attention over the same q/k/v as SDPA's bf16 result is (chunks of 64 keys: both sides
    of a chunk edge; t = 2 after 63: the last chunk holds keys of row 1 only, none of row 0's)."""
    torch.manual_seed(hd + t + start)
    nh, nkv = 9, 3
    rotary = Rotary.default(hd, 10000.0, 1024)
    cos, sin = rotary.tables(slice(start, start + t), torch.bfloat16)
    qkv = (torch.randn(t, (nh + 2 * nkv) * hd) * 2).bfloat16()
    k_ref, v_ref = torch.randn(nkv, start + t + 7, hd).bfloat16(), torch.randn(nkv, start + t + 7, hd).bfloat16()
    k_ref[:, start + t:] = v_ref[:, start + t:] = float("nan")   # past the sequence: never read
    k_got, v_got = k_ref.clone(), v_ref.clone()
    sdpa = _pytorch_attention(qkv, cos, sin, k_ref, v_ref, start, nh, nkv, hd)
    got = decode_ops.attend_rows(qkv, cos, sin, k_got, v_got, start, nh, nkv)
    assert torch.equal(k_got.nan_to_num(), k_ref.nan_to_num())
    assert torch.equal(v_got.nan_to_num(), v_ref.nan_to_num())
    exact = _pytorch_attention(qkv, cos, sin, k_ref.clone(), v_ref.clone(), start, nh, nkv, hd, torch.float64)
    sdpa_err = (sdpa.double() - exact).abs().max()
    assert not got.isnan().any()
    assert (got.double() - exact).abs().max() <= 1.5 * sdpa_err + 1e-6


@pytest.mark.parametrize("t", [2, 6, 16])
def test_attention_rows_do_not_mix(t, attention_path):
    """Row i of a t-row call does not depend on the other rows' queries, bit for bit: every query is
    computed alone (in its own lane where AVX-512 puts 16 queries in a vector), over keys cut into
    chunks at fixed positions. (A 1-row call may take the other kernel path: see decode_ops.c.)"""
    torch.manual_seed(3 + t)
    nh, nkv, hd, start = 9, 3, 64, 120
    rotary = Rotary.default(hd, 10000.0, 1024)
    qkv = (torch.randn(t, (nh + 2 * nkv) * hd) * 2).bfloat16()
    k, v = torch.randn(nkv, 256, hd).bfloat16(), torch.randn(nkv, 256, hd).bfloat16()
    cos, sin = rotary.tables(slice(start, start + t), torch.bfloat16)
    together = decode_ops.attend_rows(qkv, cos, sin, k.clone(), v.clone(), start, nh, nkv)
    for i in range(t):
        other = qkv.clone()   # every other row's query heads changed, the keys and values kept
        rest = [r for r in range(t) if r != i]
        other[rest, :nh * hd] = (torch.randn(len(rest), nh * hd) * 2).bfloat16()
        changed = decode_ops.attend_rows(other, cos, sin, k.clone(), v.clone(), start, nh, nkv)
        assert torch.equal(changed[i], together[i])
        assert not torch.equal(changed[rest], together[rest])


def test_a_target_with_the_ops_computes_what_pytorch_s_ops_do():
    """A bf16 target of real head size with the C ops on: forwards of 1 and 4 rows after a prompt
    (so both the C path and the SDPA path of longer forwards are used) give the logits PyTorch's
    ops give, to bf16 rounding, and pick the same next tokens."""
    torch.manual_seed(4)
    cfg = TargetConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=3, num_heads=4,
                       num_kv_heads=2, head_dim=64, max_position_embeddings=512, tie_word_embeddings=False)
    model = TargetModel(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    model = model.bfloat16().eval()
    prompt, rows = torch.randint(0, 512, (40,)), torch.randint(0, 512, (4,))

    def run():
        cache = model.new_cache(64)
        model(prompt, cache)
        one = model(rows[:1], cache).logits
        four = model(rows, cache).logits
        return one, four

    ref = run()
    assert decode_ops.use_for(model) and model.layers[0].self_attn.native_ops
    got = run()
    for r, g in zip(ref, got):
        assert (g - r).abs().max() < 0.05 * r.abs().max()
        assert torch.equal(g.argmax(-1), r.argmax(-1))


@pytest.mark.parametrize("scale", [0.1, 3.0, 40.0])
def test_softmax_stats_are_the_router_s_entropy_and_top1(scale):
    """The router's entropy and top-1 probability in one C pass (decode_ops.softmax_stats) against
    float64 PyTorch, masked (-inf) logits included, odd lengths too (the scalar tail)."""
    torch.manual_seed(int(scale * 10))
    for n in (49152, 1003):
        logits = torch.randn(n) * scale
        logits[::97] = float("-inf")
        entropy, top1 = decode_ops.softmax_stats(logits)
        logp = torch.log_softmax(logits.double(), dim=-1)
        p = logp.exp()
        ref_entropy = float(-(p[p > 0] * logp[p > 0]).sum())
        assert entropy == pytest.approx(ref_entropy, rel=1e-5, abs=1e-5)
        assert top1 == pytest.approx(float(p.max()), rel=1e-5)
    assert decode_ops.softmax_stats(torch.randn(8).double()) is None   # not float32: PyTorch's ops decide


def test_softmax_stats_of_a_mostly_masked_row_and_on_any_thread_count():
    """The row is reduced in fixed spans shared among the pool's threads: the same bits on one
    thread and on two; spans with every logit masked (-inf) add nothing (no NaN)."""
    torch.manual_seed(5)
    masked = torch.full((49152,), float("-inf"))
    masked[[7, 30000, 49151]] = torch.tensor([2.0, 1.0, -3.0])
    rows = [torch.randn(49152) * 4, masked, torch.randn(50001) * 40]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [decode_ops.softmax_stats(r) for r in rows]
        torch.set_num_threads(2)
        two = [decode_ops.softmax_stats(r) for r in rows]
    finally:
        torch.set_num_threads(threads)
    assert one == two
    p = torch.softmax(torch.tensor([2.0, 1.0, -3.0], dtype=torch.float64), -1)
    entropy, top1 = one[1]
    assert entropy == pytest.approx(float(-(p * p.log()).sum()), rel=1e-5)
    assert top1 == pytest.approx(float(p.max()), rel=1e-6)


def _segments_case(rows: list[int], starts: list[int], lead: list[int], shared: list[int], nh: int = 9, nkv: int = 3,
                   hd: int = 64):
    """Random q/k/v rows and caches for attend_segments: segment s's cache holds its lead's first
    shared[s] keys and values (as two requests that copied one prefix-cache entry)."""
    torch.manual_seed(sum(rows) + len(rows))
    caches = [(torch.randn(nkv, st + 40, hd).bfloat16(), torch.randn(nkv, st + 40, hd).bfloat16()) for st in starts]
    for s, (head, n) in enumerate(zip(lead, shared)):
        if head != s:
            caches[s][0][:, :n] = caches[head][0][:, :n]
            caches[s][1][:, :n] = caches[head][1][:, :n]
    t = sum(rows)
    return (torch.randn(t, (nh + 2 * nkv) * hd).bfloat16(), torch.randn(t, hd).bfloat16(),
            torch.randn(t, hd).bfloat16(), caches)


def _attend_alone(qkv, cos, sin, rows, starts, caches, nh=9, nkv=3):
    outs, r = [], 0
    for n, st, (k, v) in zip(rows, starts, caches):
        outs.append(decode_ops.attend_rows(qkv[r:r + n], cos[r:r + n], sin[r:r + n], k, v, st, nh, nkv))
        r += n
    return torch.cat(outs)


@pytest.mark.parametrize("rows,starts,lead,shared", [
    ([1, 1, 1], [700, 650, 800], [0, 0, 0], [640, 640, 640]),            # decode rows sharing 10 chunks
    ([1, 2, 4, 1], [700, 650, 800, 300], [0, 0, 0, 3], [640, 576, 640, 0]),   # 4 rows attend in lanes
    ([3, 1, 1, 2], [130, 200, 64, 90], [0, 0, 2, 2], [128, 128, 64, 64]),   # two groups
    ([1, 1], [63, 100], [0, 1], [0, 0]),                                  # nothing shared
])
def test_attention_of_requests_sharing_a_prefix_is_each_request_s_alone(rows, starts, lead, shared):
    """attend_segments reads a shared prefix once for every request of it, and each request gets the
    bits of its own attend_rows call (caches included)."""
    qkv, cos, sin, caches = _segments_case(rows, starts, lead, shared)
    alone_caches = [(k.clone(), v.clone()) for k, v in caches]
    ref = _attend_alone(qkv, cos, sin, rows, starts, alone_caches)
    got = decode_ops.attend_segments(qkv, cos, sin, [(n, st, k, v) for n, st, (k, v) in zip(rows, starts, caches)],
                                     lead, shared, 9, 3)
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
    for (k, v), (rk, rv) in zip(caches, alone_caches):
        assert torch.equal(k, rk) and torch.equal(v, rv)


def test_a_shared_prefix_is_read_from_the_lead_s_cache():
    """The shared chunks really come from the lead: with the follower's own copy spoilt, its output
    is what it would be with the lead's keys, not with its own."""
    rows, starts, lead, shared = [1, 1], [300, 280], [0, 0], [256, 256]
    qkv, cos, sin, caches = _segments_case(rows, starts, lead, shared)
    good = [(k.clone(), v.clone()) for k, v in caches]
    caches[1][0][:, :256].mul_(-1.0)   # the follower's copy of the prefix, spoilt
    spoilt = [(k.clone(), v.clone()) for k, v in caches]
    got = decode_ops.attend_segments(qkv, cos, sin, [(n, st, k, v) for n, st, (k, v) in zip(rows, starts, caches)],
                                     lead, shared, 9, 3)
    assert torch.equal(got, _attend_alone(qkv, cos, sin, rows, starts, good))
    assert not torch.equal(got, _attend_alone(qkv, cos, sin, rows, starts, spoilt))


@pytest.mark.parametrize("rows,n,k", [(1, 49152, 8), (5, 1000, 8), (3, 37, 5), (2, 8, 8)])
def test_topk_indices_are_torch_topk_s(rows, n, k):
    """The LM head's candidates: the k largest of each row, largest first (torch.topk's)."""
    torch.manual_seed(n + k)
    x = torch.randn(rows, n) * 4
    x[0, n // 2] = float("-inf")
    got = decode_ops.topk_indices(x, k)
    ref = x.topk(k, dim=-1)
    assert torch.equal(got, ref.indices)   # distinct random values: one answer
    assert torch.equal(x.gather(1, got), ref.values)


def test_topk_ties_rank_by_the_lower_index():
    x = torch.zeros(2, 100)
    x[0, [7, 3, 90]] = 5.0                    # three tied largest, then zeros tied for the rest
    x[1, 50:] = float("-inf")
    got = decode_ops.topk_indices(x, 6)
    assert got[0].tolist() == [3, 7, 90, 0, 1, 2]
    assert got[1].tolist() == [0, 1, 2, 3, 4, 5]
    assert decode_ops.topk_indices(x.double(), 6) is None and decode_ops.topk_indices(x, 0) is None


def test_argmax_rows_is_torch_argmax_ties_nans_and_all():
    torch.manual_seed(0)
    x = torch.randn(6, 49152)
    x[1, [300, 9000]] = 50.0                      # a tie: the first
    x[2, [70, 40000]] = float("nan")              # NaNs: the first NaN
    x[3] = float("-inf")                          # masked out entirely
    x[4, :100] = float("-inf")
    x[5, 49151] = 99.0                            # past the last whole vector
    assert decode_ops.argmax_rows(x) == x.argmax(-1).tolist()
    small = torch.tensor([[1.0, 3.0, 3.0], [float("nan"), 1.0, float("nan")]])
    assert decode_ops.argmax_rows(small) == small.argmax(-1).tolist() == [1, 0]
    assert decode_ops.argmax_rows(x.double()) is None


def test_argmax_rows_within_a_grammar_s_packed_masks_is_torch_argmax_of_the_masked_logits():
    """With a grammar's packed masks (xgrammar's layout: bit b of word w allows token 32 w + b) the
    C argmax reads the row as masked_fill(~mask, -inf) would leave it: ties, NaNs (a forbidden one
    does not count), every token forbidden, a row all -inf where allowed, ids past the mask."""
    torch.manual_seed(2)
    rows, V = 7, 49152
    x = torch.randn(rows, V)
    allowed = torch.randint(-2**31, 2**31 - 1, (rows, V // 32), dtype=torch.int32)   # random bits
    allowed[0] = -1                                  # all allowed
    x[1, [300, 9000]] = 50.0                         # a tie among allowed tokens: the first
    allowed[1, 300 // 32] |= 1 << (300 % 32)
    allowed[1, 9000 // 32] |= 1 << (9000 % 32)
    x[2, 5] = 80.0                                   # the largest is forbidden
    allowed[2, 0] &= ~(1 << 5)
    x[3, [70, 40000]] = float("nan")                 # a forbidden NaN, then an allowed one
    allowed[3, 70 // 32] &= ~(1 << (70 % 32))
    allowed[3, 40000 // 32] |= 1 << (40000 % 32)
    allowed[4] = 0                                   # nothing allowed: every logit -inf, index 0
    x[5] = float("-inf")
    allowed[6, -1] = -1
    x[6, V - 1] = 99.0                               # past the last whole vector
    bits = (allowed.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    mask = bits.view(rows, -1).bool()
    expected = x.masked_fill(~mask, float("-inf")).argmax(-1).tolist()
    assert decode_ops.argmax_rows(x, allowed) == expected
    assert expected[2] != 5 and expected[3] == 40000 and expected[4] == 0
    # a padded head: logits past the mask's 32 * words tokens are never chosen
    wide = torch.cat([x, torch.full((rows, 40), 1e9)], dim=1)
    assert decode_ops.argmax_rows(wide, allowed) == expected
    small = torch.tensor([[1.0, 3.0, 3.0, 7.0]])
    assert decode_ops.argmax_rows(small, torch.tensor([[0b0110]], dtype=torch.int32)) == [1]
    assert decode_ops.argmax_rows(x, allowed.long()) is None and decode_ops.argmax_rows(x, allowed[:2]) is None


def test_refining_the_top_logits_in_c_is_pytorch_s_refinement():
    """TargetModel.logits' refinement: the k largest of each row become their float32 dot products,
    everything else stays as the light head computed it."""
    torch.manual_seed(1)
    rows, V, H, k = 5, 3000, 64, 8
    h, w = torch.randn(rows, H).bfloat16(), (torch.randn(V, H) * 0.1).bfloat16()
    coarse = (h @ w.T).float()           # a bf16 product: the coarse logits
    top = coarse.topk(k, dim=-1).indices
    ref = coarse.scatter(-1, top, torch.einsum("rkh,rh->rk", w[top].float(), h.float()))
    got = coarse.clone()
    assert decode_ops.refine_top(got, h, w, k)
    changed = got != coarse
    assert changed.sum(-1).le(k).all() and changed.any()
    assert torch.equal(got.masked_fill(torch.zeros_like(got, dtype=torch.bool).scatter(-1, top, True), 0.0),
                       coarse.masked_fill(torch.zeros_like(got, dtype=torch.bool).scatter(-1, top, True), 0.0))
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)
    assert not decode_ops.refine_top(coarse.clone(), h.float(), w, k)   # float32 hidden states: PyTorch's ops
