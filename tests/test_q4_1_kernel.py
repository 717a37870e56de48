"""The Q4_1 x Q8 kernel (whiflash_core/kernels/q4_1.c) built on this machine: the function it
computes, its fallback where it cannot be built, and a target running on it (the embedded model on
its own blocks through it: test_quant.py)."""
from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest
import torch

from whiflash_core import native, q4_1_kernel
from whiflash_core.machine import cpu_flags
from whiflash_core.quant import Q41Linear, apply_weight_format

# rerun with the AVX2 kernels forced (.ci/run): the kernel is then built for the AVX2 class
pytestmark = pytest.mark.numerics

BUILDABLE = native.isa() is not None and native.compiler() is not None
needs_kernel = pytest.mark.skipif(not BUILDABLE, reason="no C compiler or no x86-64 CPU with AVX2 here: "
                                  "the engine keeps PyTorch's int4 kernel (test_fallback_* checks that)")


def _blocks(n: int, k: int, seed: int = 0):
    """Random Q4_1 blocks with fp16-exact d and m (the kernel keeps them in fp16, as the GGUF does)."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
    d = rng.uniform(0.001, 0.05, size=(n, k // 32)).astype(np.float16).astype(np.float32)
    m = (-8 * d * rng.uniform(0.5, 1.5, size=d.shape)).astype(np.float16).astype(np.float32)
    return q, d, m


@pytest.fixture(autouse=True)
def tiles_off_after():
    """Every test here starts with the tiles off (an earlier test's model load may have applied
    this machine's choice) and leaves the process's choice as it found it."""
    q4_1_kernel.use_amx(0)
    q4_1_kernel.use_bf16_tiles(0)
    yield
    from whiflash_core import tiles
    tiles.apply(tiles.current())   # what the process had chosen (tests alone: off)


@needs_kernel
def test_the_kernel_builds_where_a_compiler_and_avx2_exist():
    assert q4_1_kernel.available()


@needs_kernel
@pytest.mark.parametrize("k", [64, 96, 192, 448, 576, 1536])  # every mix of groups of 8, 4 and 2 blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [52, 48])   # blocks in lanes; outputs in lanes (n % 16 == 0)
def test_kernel_computes_the_q4_1_times_q8_function(k, dtype, n):
    """Against the same function in float64 (activations quantized per block of 32 to int8, exact
    integer dot products, then the scales): equal up to float32 rounding, for 1 to 9 rows (tiles of
    4 and 2 rows, the single-row path, several passes over a group of outputs) in both layouts."""
    assert q4_1_kernel.outputs_in_lanes(n) == (n % 16 == 0)
    q, d, m = _blocks(n, k, seed=k)
    qw, dw, mw = q4_1_kernel.pack(q, d, m)
    for rows in (1, 2, 3, 4, 5, 9):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
        got = q4_1_kernel.matmul(x, qw, dw, mw)
        want = q4_1_kernel.reference(x, torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m))
        assert got.shape == (rows, n) and got.dtype == torch.float32
        err = (got.double() - want).abs().max() / want.abs().max()
        assert err < 1e-5, (k, rows, float(err))
        # and it is Q4_1: close to the dequantised weights times the unquantized x
        w = torch.from_numpy((q.reshape(n, -1, 32) * d[..., None] + m[..., None]).reshape(n, k)).double()
        exact = x.double() @ w.T
        assert (got.double() - exact).abs().max() < 0.02 * exact.abs().max()


@needs_kernel
def test_a_zero_row_stays_zero_and_rows_do_not_mix():
    q, d, m = _blocks(40, 576)
    qw, dw, mw = q4_1_kernel.pack(q, d, m)
    x = torch.randn(4, 576)
    x[1] = 0
    both = q4_1_kernel.matmul(x, qw, dw, mw)
    assert torch.equal(both[1], torch.zeros(40))
    for r in range(4):  # a row's result does not depend on the rows beside it
        assert torch.equal(both[r], q4_1_kernel.matmul(x[r:r + 1], qw, dw, mw)[0])


@needs_kernel
def test_the_avx2_and_vnni_builds_give_the_same_bits(tmp_path):
    """Outputs in lanes, the AVX2 class (maddubs, two 8-output halves of a group), AVX-VNNI (256-bit
    dpbusd) and AVX-512 VNNI (16 outputs a vector) run the same integer sums and the same float
    steps in the same order: a target quantized to Q4_1 gives a user the same numbers on a laptop
    and on a server. bench/q4_1_kernel_bench.c built for each class this CPU can run hashes the
    outputs of 1 to 16 rows (random blocks, the same on every build)."""
    flags = cpu_flags()
    classes = ["haswell"] + [a for a, need in (("alderlake", "avx_vnni"), ("icelake-server", "avx512_vnni"))
                             if need in flags]
    if len(classes) < 2:
        pytest.skip("this CPU runs only the AVX2 class: nothing to compare it with")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    hashes = {}
    for arch in classes:
        exe = tmp_path / arch
        subprocess.run([native.compiler(), "-O3", f"-march={arch}", "-fopenmp", "-I", root,
                        os.path.join(root, "bench", "q4_1_kernel_bench.c"), "-o", str(exe), "-lm"], check=True)
        runs = [subprocess.run([str(exe), *shape, "1"], check=True, capture_output=True, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout for shape in (("64", "576"), ("32", "1536"))]
        hashes[arch] = [line.split(":")[0] + line.rsplit(" ", 1)[1] for out in runs for line in out.splitlines()]
    assert len(hashes["haswell"]) == 10
    assert all(h == hashes["haswell"] for h in hashes.values()), hashes


@needs_kernel
def test_every_token_of_a_q4_1_target_is_the_argmax_of_its_verify_forward():
    from test_any_cpu import PROMPTS, ForwardLog, replay_greedy
    from whiflash_core.chat import encode_chat
    from whiflash_core.engine import GenerationRequest, SpeculationConfig
    from whiflash_core.loading import load_engine

    # costs unmeasured: the router then prices every round alike and drafts all it can (the tokens
    # are the argmax of their verify forwards whatever it picks; measuring took ~80 s on a cold Zen 3)
    engine = load_engine(dtype="bfloat16", weights="q4_1", measure_costs=False)
    assert isinstance(engine.target.layers[0].mlp.down_proj, Q41Linear)
    assert engine.target.layers[0].self_attn.native_ops  # and the rest of the layer in C (decode_ops)
    ids = encode_chat(engine.tokenizer, PROMPTS[1])
    log = ForwardLog(engine.target)
    try:
        gen = engine.generate(GenerationRequest(ids, 40, speculation=SpeculationConfig(method="whiflash")))
    finally:
        log.close()
    assert gen.output == replay_greedy(log.calls)[:len(gen.output)]
    assert len(log.calls) - 1 < len(gen.output)  # multi-token verifies decided tokens


def test_fallback_without_a_compiler(monkeypatch):
    """No compiler: the kernel is not available, q4_1 is not among the formats `--weights auto`
    times, and asking for it by name is a clear error."""
    from whiflash_core.machine import head_kinds, light_formats
    from tiny import tiny_target

    monkeypatch.setattr(native, "compiler", lambda: None)
    q4_1_kernel._library.cache_clear()
    try:
        assert not q4_1_kernel.available()
        assert "q4_1" not in light_formats("model.gguf") and "int4" in light_formats("model.gguf")
        assert "q4_1" not in head_kinds()
        with pytest.raises(ValueError, match="q4_1 weights need the Q4_1 kernel"):
            apply_weight_format(tiny_target(torch.bfloat16), "q4_1", "model.gguf")
    finally:
        q4_1_kernel._library.cache_clear()


def test_a_failed_build_is_a_fallback_too(monkeypatch, tmp_path):
    monkeypatch.setenv("WHIFLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(q4_1_kernel, "SOURCE", tmp_path / "broken.c")
    (tmp_path / "broken.c").write_text("this is not C\n")
    q4_1_kernel._library.cache_clear()
    try:
        assert not q4_1_kernel.available()
        assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half-built left behind
    finally:
        q4_1_kernel._library.cache_clear()


@needs_kernel
@pytest.mark.parametrize("n", [52, 48])   # blocks in lanes; outputs in lanes
def test_bf16_results_are_the_float32_ones_rounded_as_pytorch_rounds(n):
    """Q41Linear asks the kernel for bf16 directly (no float32 tensor and cast per call): the same
    bits as .to(torch.bfloat16) of the float32 result."""
    q, d, m = _blocks(n, 576)
    qw, dw, mw = q4_1_kernel.pack(q, d, m)
    for rows in (1, 3, 4, 9):
        x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).bfloat16()
        y = q4_1_kernel.matmul(x, qw, dw, mw, out_dtype=torch.bfloat16)
        assert y.dtype == torch.bfloat16
        assert torch.equal(y, q4_1_kernel.matmul(x, qw, dw, mw).to(torch.bfloat16))
    lin = Q41Linear(q, d, m)
    assert torch.equal(lin(x), q4_1_kernel.matmul(x, qw, dw, mw).to(torch.bfloat16))


# AMX tiles (kernels/q4_1.c amx_matmul): only where this CPU and its OS have them
HAS_TILES = BUILDABLE and q4_1_kernel.use_amx(1)
q4_1_kernel.use_amx(0)
needs_tiles = pytest.mark.skipif(not HAS_TILES, reason="this CPU (or this build: AVX2 class) has no AMX tiles; "
                                 "the VNNI path the other tests check is then the only one")




@needs_tiles
@pytest.mark.parametrize("n,k", [(16, 32), (960, 576), (576, 1536), (48, 96)])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_the_tile_path_is_the_vnni_path_bit_for_bit(n, k, x_dtype, tiles_off_after):
    """The same integer dot products (TDPBSUD instead of dpbusd) and the same float32 scaling in the
    same order: equal results for every row count (whole tiles of 16 rows, partial ones, one row),
    stored as float32 and as bf16."""
    q, d, m = _blocks(n, k, seed=n + k)
    qw, dw, mw = q4_1_kernel.pack(q, d, m)
    for rows in (1, 5, 15, 16, 17, 40):
        x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3).to(x_dtype)
        for out in (torch.float32, torch.bfloat16):
            q4_1_kernel.use_amx(0)
            plain = q4_1_kernel.matmul(x, qw, dw, mw, out)
            assert q4_1_kernel.use_amx(1)
            tiled = q4_1_kernel.matmul(x, qw, dw, mw, out)
            assert torch.equal(plain, tiled), (n, k, rows, out)


@needs_tiles
def test_tiles_start_at_their_row_count(tiles_off_after):
    """use_amx(from_rows): calls of fewer rows keep the VNNI path, as do all calls after use_amx(0)
    (the results are the same either way: the kernel counts the calls that took tiles)."""
    q, d, m = _blocks(64, 576)
    qw, dw, mw = q4_1_kernel.pack(q, d, m)

    def tiled(rows: int) -> bool:
        before = q4_1_kernel.amx_calls()
        q4_1_kernel.matmul(torch.randn(rows, 576), qw, dw, mw)
        return q4_1_kernel.amx_calls() == before + 1

    assert q4_1_kernel.use_amx(16)
    assert not tiled(15) and tiled(16) and tiled(40)
    assert not q4_1_kernel.use_amx(0)
    assert not tiled(16) and not tiled(40)


# bf16 tiles on dequantized weights (kernels/q4_1.c bf16_matmul): only where this CPU has AMX-BF16
HAS_BF16_TILES = BUILDABLE and q4_1_kernel.use_bf16_tiles(1)
q4_1_kernel.use_bf16_tiles(0)
needs_bf16_tiles = pytest.mark.skipif(not HAS_BF16_TILES, reason="this CPU (or this build: AVX2 class) has no "
                                      "AMX-BF16 tiles; the integer paths the other tests check are then the only ones")


def _dequantized_bf16(q, d, m) -> torch.Tensor:
    """The weights as bf16_matmul dequantizes them: d * q + m rounded once to float32 (an FMA; exact
    in float64 first), then to bf16."""
    blocks = lambda a: a.double().repeat_interleave(32, dim=1)   # noqa: E731
    return (q.double() * blocks(d) + blocks(m)).float().to(torch.bfloat16)


@needs_bf16_tiles
@pytest.mark.parametrize("n,k", [(16, 32), (960, 576), (576, 1536), (48, 96)])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_bf16_tiles_multiply_the_dequantized_weights(n, k, x_dtype, tiles_off_after):
    """x (rounded to bf16) times the weights dequantized to bf16, summed in float32: within float32
    summation error of the float64 product of those same bf16 values, for whole tiles of 16 rows,
    partial ones, one row, several passes of 32 rows, odd and even numbers of output groups; and
    closer to the exact Q4_1 product than the integer path (which rounds x to int8 per block)."""
    q, d, m = (torch.as_tensor(a) for a in _blocks(n, k, seed=n + k))
    qw, dw, mw = q4_1_kernel.pack(q, d, m)
    w = _dequantized_bf16(q, d, m).double()
    exact_w = q.double() * d.double().repeat_interleave(32, 1) + m.double().repeat_interleave(32, 1)
    for rows in (1, 5, 16, 17, 40, 70):
        x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3).to(x_dtype)
        assert q4_1_kernel.use_bf16_tiles(1)
        before = q4_1_kernel.bf16_calls()
        tiled = q4_1_kernel.matmul(x, qw, dw, mw).double()
        assert q4_1_kernel.bf16_calls() == before + 1
        expected = x.to(torch.bfloat16).double() @ w.T
        scale = x.to(torch.bfloat16).double().abs() @ w.abs().T   # the sums' magnitudes
        assert ((tiled - expected).abs() <= 1e-5 * scale + 1e-30).all(), (n, k, rows)
        q4_1_kernel.use_bf16_tiles(0)
        integer = q4_1_kernel.matmul(x, qw, dw, mw).double()
        exact = x.double() @ exact_w.T
        assert (tiled - exact).norm() < (integer - exact).norm(), (n, k, rows)
        assert q4_1_kernel.use_bf16_tiles(1)
        as_bf16 = q4_1_kernel.matmul(x, qw, dw, mw, torch.bfloat16)
        assert torch.equal(as_bf16, tiled.float().to(torch.bfloat16))   # stored bf16: the float32 result rounded


@needs_bf16_tiles
def test_bf16_tiles_a_row_does_not_depend_on_the_others(tiles_off_after):
    """Each row's result is the same whether it is multiplied alone (padded to a tile) or among 40."""
    q, d, m = _blocks(960, 576, seed=3)
    qw, dw, mw = q4_1_kernel.pack(q, d, m)
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert q4_1_kernel.use_bf16_tiles(1)
    together = q4_1_kernel.matmul(x, qw, dw, mw)
    for r in (0, 15, 16, 39):
        assert torch.equal(q4_1_kernel.matmul(x[r:r + 1], qw, dw, mw)[0], together[r]), r


@needs_bf16_tiles
def test_bf16_tiles_start_at_their_row_count_before_the_integer_tiles(tiles_off_after):
    """use_bf16_tiles(from_rows): calls of at least that many rows take bf16 tiles, whatever the
    integer tiles' threshold; fewer rows go on to the integer tiles or the VNNI path."""
    q, d, m = _blocks(64, 576)
    qw, dw, mw = q4_1_kernel.pack(q, d, m)

    def path(rows: int) -> str:
        bf16, integer = q4_1_kernel.bf16_calls(), q4_1_kernel.amx_calls()
        q4_1_kernel.matmul(torch.randn(rows, 576), qw, dw, mw)
        return "bf16" if q4_1_kernel.bf16_calls() > bf16 else "integer" if q4_1_kernel.amx_calls() > integer else "vnni"

    assert q4_1_kernel.use_bf16_tiles(32) and q4_1_kernel.use_amx(16)
    assert [path(r) for r in (8, 16, 31, 32, 64)] == ["vnni", "integer", "integer", "bf16", "bf16"]
    assert not q4_1_kernel.use_bf16_tiles(0)
    assert path(64) == "integer"
    q4_1_kernel.use_amx(0)
