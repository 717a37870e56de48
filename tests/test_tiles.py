"""whiflash_core/tiles.py: the kernels' AMX paths are timed at load and turned on only where they win
(the kernels themselves: test_q4_1_kernel.py and test_decode_ops.py, with and without tiles)."""
from __future__ import annotations

import pytest

from whiflash_core import decode_ops, machine, q4_1_kernel, tiles
from whiflash_core.target import TargetConfig

pytestmark = pytest.mark.numerics

SMOLLM2 = TargetConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                       num_kv_heads=3, head_dim=64, max_position_embeddings=2048)
HAS_TILES = q4_1_kernel.available() and q4_1_kernel.use_amx(1)
q4_1_kernel.use_amx(0)


@pytest.fixture(autouse=True)
def restore():
    before = tiles.current()
    yield
    tiles.apply(before)


def test_off_switch_keeps_every_kernel_off(monkeypatch):
    monkeypatch.setenv("WHIFLASH_TILES", "0")
    settings, timings = tiles.choose(SMOLLM2)
    assert settings == tiles.TileSettings() == tiles.current() and timings == {}
    assert not q4_1_kernel.use_amx(0) and not decode_ops.use_amx_attention(False)


@pytest.mark.skipif(not HAS_TILES, reason="this CPU (or this build: AVX2 class) has no AMX tiles")
def test_choose_applies_what_its_timings_say(monkeypatch, tmp_path):
    """The settings follow from the timings: bf16 tiles from the smallest timed row count where they
    beat both other ways by WIN_MARGIN at that and every larger count (else 0), integer tiles the
    same against the VNNI path among the counts below that, attention on iff the tile path was
    faster; the next load reads them from the cache (no timing), use_cache=False times again."""
    monkeypatch.setenv("WHIFLASH_CACHE_DIR", str(tmp_path))
    settings, timings = tiles.choose(SMOLLM2)
    assert len(list(tmp_path.glob("tiles-*.json"))) == 1
    monkeypatch.setattr(tiles, "_linear_from_rows", lambda n, k: pytest.fail("timed again despite the cache"))
    again, cached = tiles.choose(SMOLLM2)
    assert again == settings and cached == timings
    monkeypatch.undo()
    monkeypatch.setenv("WHIFLASH_CACHE_DIR", str(tmp_path))
    timed = []
    real = tiles._linear_from_rows
    monkeypatch.setattr(tiles, "_linear_from_rows", lambda n, k: timed.append((n, k)) or real(n, k))
    settings, timings = tiles.choose(SMOLLM2, use_cache=False)
    assert timed == [(2 * SMOLLM2.intermediate_size, SMOLLM2.hidden_size)]
    assert settings == tiles.current()
    linear = {int(r): ways for r, ways in timings["linear_gate_up_ms"].items()}
    assert sorted(linear) == list(tiles.LINEAR_ROWS)

    def start(way: int, rows: list[int]) -> int:
        winning = [r for r in rows
                   if all(linear[s][way] <= tiles.WIN_MARGIN * min(linear[s][:way]) for s in rows if s >= r)]
        return min(winning) if winning else 0
    bf16 = start(2, list(tiles.LINEAR_ROWS)) if len(linear[4]) == 3 else 0
    assert settings.bf16_from_rows == bf16
    assert settings.linear_from_rows == start(1, [r for r in tiles.LINEAR_ROWS if not bf16 or r < bf16])
    plain, tiled = timings["attention_ms"]
    assert settings.attention == (tiled < plain)


def test_without_tiles_nothing_changes():
    """apply() reports what took effect: where the build has no tiles, asking for them leaves them off."""
    got = tiles.apply(tiles.TileSettings(linear_from_rows=8, attention=True, bf16_from_rows=48))
    assert got == tiles.current()
    if not HAS_TILES:
        assert got == tiles.TileSettings()
    else:
        assert got == tiles.TileSettings(8, True, 48 if q4_1_kernel.use_bf16_tiles(48) else 0)


def test_the_verify_tables_are_cached_per_tile_setting():
    """The router's verify-cost tables are timed with the kernels as they run: a tile setting is
    part of their cache key."""
    class Target:
        cfg = SMOLLM2
        dtype = "bfloat16"
        formats = None

        class device:
            type = "cpu"

        def modules(self):
            return []

    tiles.apply(tiles.TileSettings())
    off = machine._target_key(Target(), ())
    tiles._current = tiles.TileSettings(12, True)   # as if applied: the key reads the settings
    on = machine._target_key(Target(), ())
    tiles._current = tiles.TileSettings(12, True, 48)
    bf16 = machine._target_key(Target(), ())
    assert off["tiles"] == {"linear_from_rows": 0, "attention": False, "bf16_from_rows": 0}
    assert on["tiles"] == {"linear_from_rows": 12, "attention": True, "bf16_from_rows": 0} and off != on
    assert bf16["tiles"]["bf16_from_rows"] == 48 and bf16 != on
