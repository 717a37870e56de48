"""`--weights auto`: formats timed on the machine at hand, and the float32 prefill twin."""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import time

import pytest
import torch

from tiny import tiny_target
from whiflash_core.engine import METHODS, Engine, GenerationRequest, SpeculationConfig
from whiflash_core import machine
from whiflash_core.machine import PREFILL_ROWS, Formats, choose, envelope, head_kinds, measure, out_of_order, verify_tables

CANDIDATES = [("bfloat16", "int4"), ("bfloat16", "int8"), ("bfloat16", "dense"), ("float32", "dense")]


def table(bf16_ms_per_row: float, f32_ms_per_row: float) -> dict:
    """A synthetic timing table: light formats cost 8 ms + 2 ms/row, dense ones 12-20 ms + rows x ms/row."""
    rows = (1, 4, 8) + PREFILL_ROWS
    return {
        "bfloat16/int4": {r: (8 + 2 * r) / 1e3 for r in rows},
        "bfloat16/int8": {r: (9 + 2 * r) / 1e3 for r in rows},
        "bfloat16/dense": {r: (12 + bf16_ms_per_row * r) / 1e3 for r in rows},
        "float32/dense": {r: (20 + f32_ms_per_row * r) / 1e3 for r in rows},
    }


def test_choice_on_a_cpu_that_emulates_bf16():
    # bf16 GEMMs slow (emulated), float32 ones fast: int4 decode, float32 prefill twin
    f = choose(table(bf16_ms_per_row=20, f32_ms_per_row=1), CANDIDATES)
    assert (f.dtype, f.weights, f.prefill_dtype) == ("bfloat16", "int4", "float32")
    # the twin takes over from the first measured row count where it is cheaper: 20+r < 8+2r from r=16
    assert f.prefill_from_rows == 16


def test_choice_on_a_cpu_with_native_bf16():
    f = choose(table(bf16_ms_per_row=0.5, f32_ms_per_row=1), CANDIDATES)
    assert (f.dtype, f.weights, f.prefill_dtype) == ("bfloat16", "int4", "bfloat16")
    assert f.prefill_from_rows == 8  # 12 + r/2 < 8 + 2r from r=3 on; 8 is the first measured count


def test_choice_prefers_the_lighter_format_within_noise_and_dense_when_it_is_faster():
    t = table(bf16_ms_per_row=0.5, f32_ms_per_row=1)
    t["bfloat16/int8"] = {r: v * 0.97 for r, v in t["bfloat16/int4"].items()}  # 3 % faster: noise
    assert choose(t, CANDIDATES).weights == "int4"
    t["bfloat16/dense"] = {r: v / 10 for r, v in t["bfloat16/dense"].items()}
    f = choose(t, CANDIDATES)
    assert (f.weights, f.prefill_dtype, f.prefill_from_rows) == ("dense", "bfloat16", 10**9)


def test_choice_takes_the_faster_lm_head_and_float32_activations_where_they_win():
    t = table(bf16_ms_per_row=20, f32_ms_per_row=1)
    heads = {"head:bfloat16/int8": {r: 3e-3 for r in (1, 4, 8)}, "head:bfloat16/dynint8": {r: 2e-3 for r in (1, 4, 8)}}
    f = choose({**t, **heads}, CANDIDATES)
    assert (f.weights, f.head) == ("int4", "dynint8")
    heads["head:bfloat16/dynint8"] = {r: 4e-3 for r in (1, 4, 8)}
    assert choose({**t, **heads}, CANDIDATES).head == "int8"
    # bf16 element-wise work emulated: float32 activations around the same int4 kernel cost less
    t["float32/int4"] = {r: v * 0.8 for r, v in t["bfloat16/int4"].items()}
    f = choose(t, CANDIDATES + [("float32", "int4")])
    assert (f.dtype, f.weights, f.prefill_dtype) == ("float32", "int4", "float32")


@pytest.fixture
def quiet_machine(monkeypatch):
    """No other work on our CPUs, whatever else runs beside the tests (the caching tests below)."""
    monkeypatch.setattr(machine, "_busy_seconds", lambda cpus: None)


@pytest.fixture
def no_spot_check(monkeypatch):
    """The synthetic verify tables of a test stand for this machine's own timings: a start's spot
    check of a cached one (real forwards of the tiny target, well under a millisecond) would find
    every one of them stale."""
    monkeypatch.setattr(machine, "_spot_verify", lambda target, taps, rows: {})


def test_measure_times_the_candidates_and_caches_them(tmp_path, monkeypatch, quiet_machine):
    monkeypatch.setenv("WHIFLASH_CACHE_DIR", str(tmp_path))
    # A model this small is all noise on some CPUs (an AMX Xeon timed a 64-row bf16 forward at 87 ms,
    # 32 rows at 2.3 ms: a kernel compiled on first use), so its tables may be out of order in every
    # attempt; what is tested here is the timing and caching, the order checks are tested below.
    monkeypatch.setattr(machine, "out_of_order", lambda table, slack=None: False)
    cfg = dataclasses.replace(tiny_target(torch.float32).cfg, hidden_size=64, intermediate_size=128, head_dim=16)
    first = measure(cfg, ("int8",))
    heads = {f"head:{d}/{h}" for d in ("bfloat16", "float32") for h in head_kinds()}
    assert set(first["table"]) == {"bfloat16/int8", "float32/int8", "bfloat16/dense", "float32/dense"} | heads
    assert all(t > 0 for row in first["table"].values() for t in row.values())
    assert Formats(**first["formats"]).weights in ("int8", "dense")
    assert first["machine"]["kernels"] and first["machine"]["torch"] == torch.__version__
    (cached,) = tmp_path.glob("formats-*.json")
    assert json.loads(cached.read_text()) == first
    assert measure(cfg, ("int8",)) == first  # read back, not timed again


def test_out_of_order_tables_are_spotted_and_read_from_below():
    quiet = {1: 2.94e-3, 2: 3.6e-3, 4: 5.43e-3, 8: 8.1e-3}
    contended = {1: 25.0e-3, 2: 21.0e-3, 4: 17.2e-3, 8: 30.0e-3}  # timed beside a training job
    assert not out_of_order(quiet)
    assert not out_of_order({1: 1.0e-4, 4: 0.9e-4})  # a tiny model's noise: within the absolute slack
    assert out_of_order(contended)
    assert envelope(contended) == {1: 17.2e-3, 2: 17.2e-3, 4: 17.2e-3, 8: 30.0e-3}
    assert envelope(quiet) == quiet


def test_a_contended_verify_timing_is_timed_again_and_cached_from_its_best_times(tmp_path, monkeypatch, quiet_machine,
                                                                                 no_spot_check):
    monkeypatch.setenv("WHIFLASH_CACHE_DIR", str(tmp_path))
    target = tiny_target(torch.float32)
    quiet = ({1: 3e-3, 4: 5e-3}, {4: 5e-3, 8: 9e-3})
    contended = ({1: 25e-3, 4: 17e-3}, {4: 5e-3, 8: 9e-3})
    timings = iter([contended, quiet])
    monkeypatch.setattr(machine, "_time_verify", lambda *a: next(timings))
    assert verify_tables(target) == quiet             # the second attempt, in order
    assert len(list(tmp_path.glob("verify-*.json"))) == 1
    assert verify_tables(target) == quiet             # read back from the cache (the iterator is spent)

    for f in tmp_path.glob("verify-*.json"):
        f.unlink()
    # every attempt out of order, each differently (no two agree): each row count's best over the
    # attempts, read from below, cached (a noisy VM's starts would otherwise each time it again)
    attempts = iter([({1: 25e-3, 4: 17e-3}, contended[1]), ({1: 40e-3, 4: 19e-3}, contended[1]),
                     ({1: 31e-3, 4: 16e-3}, contended[1])])
    calls = []
    monkeypatch.setattr(machine, "_time_verify", lambda *a: calls.append(1) or next(attempts))
    table, shared = verify_tables(target)
    assert len(calls) == machine.MEASURE_ATTEMPTS
    assert table == {1: 16e-3, 4: 16e-3} and shared == contended[1]   # T(1) 25 ms, T(4) 16 ms: enveloped
    (cached,) = tmp_path.glob("verify-*.json")
    assert verify_tables(target) == (table, shared) and len(calls) == machine.MEASURE_ATTEMPTS   # read back
    cached.unlink()
    # a contended table cached by an older build is not trusted either
    (tmp_path / "verify-old.json").write_text("{}")
    monkeypatch.setattr(machine, "_cache_path", lambda key, kind="formats": str(tmp_path / "verify-old.json"))
    (tmp_path / "verify-old.json").write_text(json.dumps({"table": {"1": 25e-3, "4": 17e-3}, "shared": {"4": 5e-3}}))
    monkeypatch.setattr(machine, "_time_verify", lambda *a: quiet)
    assert verify_tables(target) == quiet


def test_an_out_of_order_timing_is_not_timed_again_once_the_attempts_took_the_budget(tmp_path, monkeypatch,
                                                                                      quiet_machine, no_spot_check):
    monkeypatch.setenv("WHIFLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(machine, "MEASURE_BUDGET_S", 0.0)   # as if the first attempt ran long (float32, one thread)
    target = tiny_target(torch.float32)
    attempts = iter([({1: 25e-3, 4: 17e-3}, {4: 5e-3}), ({1: 3e-3, 4: 5e-3}, {4: 5e-3})])
    calls = []
    monkeypatch.setattr(machine, "_time_verify", lambda *a: calls.append(1) or next(attempts))
    table, shared = verify_tables(target)
    assert len(calls) == 1                                   # the in-order second attempt never ran
    assert table == {1: 17e-3, 4: 17e-3} and shared == {4: 5e-3}   # the first, read from below
    assert verify_tables(target) == (table, shared) and len(calls) == 1   # and cached


def test_a_cpu_that_runs_more_rows_faster_is_timed_twice_and_cached_as_it_runs(tmp_path, monkeypatch, quiet_machine,
                                                                                no_spot_check):
    """Seen on an AMX Xeon: a float32 verify of 16 rows ran faster than one of 12 in every attempt
    (the GEMM library changes kernels). Two attempts that agree are the CPU, not interference: the
    table is used as timed (the better of the two at each row count) and the next start reads it
    back instead of spending three attempts again."""
    monkeypatch.setenv("WHIFLASH_CACHE_DIR", str(tmp_path))
    target = tiny_target(torch.float32)
    first = ({1: 50.1e-3, 12: 139.1e-3, 16: 114.0e-3}, {4: 86.4e-3, 12: 147.7e-3, 16: 120.9e-3})
    second = ({1: 49.8e-3, 12: 137.9e-3, 16: 115.4e-3}, {4: 85.8e-3, 12: 150.2e-3, 16: 120.6e-3})
    assert out_of_order(first[0]) and out_of_order(second[1])
    calls = []
    timings = iter([first, second])
    monkeypatch.setattr(machine, "_time_verify", lambda *a: calls.append(1) or next(timings))
    table, shared = verify_tables(target)
    assert len(calls) == 2
    assert table == {1: 49.8e-3, 12: 137.9e-3, 16: 114.0e-3}       # not the envelope: T(12) as timed
    assert shared == {4: 85.8e-3, 12: 147.7e-3, 16: 120.6e-3}
    (cached,) = tmp_path.glob("verify-*.json")
    assert json.loads(cached.read_text())["reproduced"] is True
    assert verify_tables(target) == (table, shared)   # read back: the iterator is spent, no third timing
    assert len(calls) == 2


def test_a_contended_format_timing_is_timed_again(tmp_path, monkeypatch, quiet_machine):
    monkeypatch.setenv("WHIFLASH_CACHE_DIR", str(tmp_path))
    cfg = tiny_target(torch.float32).cfg
    rows = (1, 4, 8) + PREFILL_ROWS
    good = table(0.5, 0.3)
    good["float32/int4"] = {r: 2 * t for r, t in good["bfloat16/int4"].items()}
    del good["bfloat16/int8"]
    bad = copy.deepcopy(good)
    bad["bfloat16/int4"][1] = 0.5   # one row timed at 500 ms: the machine was busy
    timings = iter([bad, good])
    monkeypatch.setattr(machine, "time_formats", lambda *a, **k: next(timings))
    result = measure(cfg, ("int4",))
    assert result["table"]["bfloat16/int4"] == {str(r): round(good["bfloat16/int4"][r], 6) for r in rows}
    assert len(list(tmp_path.glob("formats-*.json"))) == 1


def other_work(cores: float):
    """A fake machine-wide busy-seconds reading: this process's CPU time plus `cores` of other work."""
    t0 = time.perf_counter()
    return lambda cpus: time.process_time() + cores * (time.perf_counter() - t0)


def test_timings_beside_other_work_are_timed_again_once_the_machine_is_quiet(tmp_path, monkeypatch, no_spot_check):
    """In order, but other processes kept more of our CPUs busy than our threads leave free: the
    timings are used and cached marked as contended (no retry); a start that still finds the
    machine busy reads them back at once, the first that finds it quiet times them again."""
    monkeypatch.setenv("WHIFLASH_CACHE_DIR", str(tmp_path))
    target = tiny_target(torch.float32)
    busy_table = ({1: 9e-3, 4: 15e-3}, {4: 15e-3, 8: 27e-3})
    quiet_table = ({1: 3e-3, 4: 5e-3}, {4: 5e-3, 8: 9e-3})
    calls = []
    monkeypatch.setattr(machine, "_our_cpus", lambda: {0, 1})
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)          # we need both CPUs
    monkeypatch.setattr(machine, "_busy_seconds", other_work(1.0))   # a one-core job beside us
    assert machine.others_load(lambda: time.sleep(0.2))[1] == pytest.approx(1.0, abs=0.1)
    monkeypatch.setattr(machine, "_time_verify", lambda *a: calls.append(time.sleep(0.2)) or busy_table)
    assert verify_tables(target) == busy_table
    (cached,) = tmp_path.glob("verify-*.json")
    assert len(calls) == 1 and json.loads(cached.read_text())["contended"] == pytest.approx(1.0, abs=0.1)
    assert verify_tables(target) == busy_table and len(calls) == 1   # still busy: read back
    monkeypatch.setattr(machine, "_busy_seconds", other_work(0.0))   # the job ended
    monkeypatch.setattr(machine, "_time_verify", lambda *a: calls.append(time.sleep(0.2)) or quiet_table)
    assert verify_tables(target) == quiet_table and len(calls) == 2
    assert "contended" not in json.loads(cached.read_text())
    assert verify_tables(target) == quiet_table and len(calls) == 2   # trusted now
    # with one thread a CPU is ours alone: the same job beside it does not compete
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert not machine.contended(1.0) and machine.contended(1.3)


def test_a_cached_verify_table_slower_than_this_start_runs_is_timed_again(tmp_path, monkeypatch,
                                                                          quiet_machine):
    """Seen on an AMD EPYC Zen 3: a verify table cached beside other work that no check caught read
    T(4) 11.2 ms where the machine ran 7.4. Each start times a few row counts again; a cached table
    clearly slower than they run now is timed again, one within the slack (or faster: a busy start)
    is read back."""
    monkeypatch.setenv("WHIFLASH_CACHE_DIR", str(tmp_path))
    target = tiny_target(torch.float32)
    inflated = ({1: 5.4e-3, 4: 11.2e-3}, {4: 11e-3, 8: 19e-3})
    quiet = ({1: 5.4e-3, 4: 7.4e-3}, {4: 7.5e-3, 8: 13e-3})
    timings, calls = iter([inflated, quiet]), []
    monkeypatch.setattr(machine, "_time_verify", lambda *a: calls.append(1) or next(timings))
    spot = {1: 5.5e-3, 4: 11.0e-3}   # what this start runs at SPOT_ROWS
    monkeypatch.setattr(machine, "_spot_verify", lambda target, taps, rows: {r: spot[r] for r in rows})
    assert verify_tables(target) == inflated and len(calls) == 1      # timed, cached
    assert verify_tables(target) == inflated and len(calls) == 1      # the spot check agrees: read back
    spot = {1: 5.1e-3, 4: 7.3e-3}   # T(4) now runs 1.5x faster than cached
    assert verify_tables(target) == quiet and len(calls) == 2         # timed again
    assert verify_tables(target) == quiet and len(calls) == 2         # and the new table cached
    spot = {1: 9e-3, 4: 14e-3}      # a busy start runs slower: interference only adds time
    assert verify_tables(target) == quiet and len(calls) == 2
    assert machine._stale({1: 5e-3}, {1: 4.4e-3}) is False             # within SPOT_SLACK
    assert machine._stale({1: 5e-3}, {1: 4.1e-3}) is True


def test_the_spot_check_times_real_forwards(monkeypatch):
    """_spot_verify runs the target's verify forwards at the asked row counts (not mocked here)."""
    target = tiny_target(torch.float32)
    forwards, real = [], type(target).forward

    def counted(self, ids, *args, **kwargs):
        forwards.append(len(ids))
        return real(self, ids, *args, **kwargs)

    monkeypatch.setattr(type(target), "forward", counted)
    times = machine._spot_verify(target, (), (1, 4))
    assert set(times) == {1, 4} and all(0 < t < 1 for t in times.values())
    assert forwards.count(4) == machine.SPOT_REPS and forwards.count(1) >= 2 + machine.SPOT_REPS   # warm-up, then timed


def test_other_work_is_read_from_the_cpus_we_may_run_on(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    stat.write_text("cpu  900 0 100 5000 0 0 0 0 0 0\n"
                    "cpu0 100 0 50 2000 10 0 0 0 0 0\n"
                    "cpu1 700 0 30 1000 5 0 0 20 0 0\n"
                    "cpu2 100 0 20 2000 0 0 0 0 0 0\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(stat if path == "/proc/stat" else path, *a, **k))
    ticks = os.sysconf("SC_CLK_TCK")
    assert machine._busy_seconds({0, 1}) == pytest.approx((150 + 750) / ticks)   # idle, iowait left out; steal in


def _run(model, chunks: list[torch.Tensor], taps=(1, 3)):
    cache = model.new_cache(8)
    outs = [model(c, cache, taps, logits_from=0) for c in chunks]
    return outs, cache


@pytest.mark.numerics
def test_prefill_twin_computes_the_same_forward():
    """A twin of the same dtype must give bit-identical logits, taps and cache: the plumbing (the
    cached prefix handed over, the new K/V written back at the right offsets) is exact."""
    model = tiny_target(torch.float64)
    plain = copy.deepcopy(model)
    model.set_prefill_twin(copy.deepcopy(model), from_rows=5)
    ids = torch.randint(0, model.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    chunks = [ids[:12], ids[12:13], ids[13:16], ids[16:30], ids[30:31]]  # twin, 1 row, 3 rows, twin again
    got, cache = _run(model, chunks)
    want, ref = _run(plain, chunks)
    for a, b in zip(got, want):
        assert torch.equal(a.logits, b.logits) and torch.equal(a.taps, b.taps)
        assert torch.equal(a.last_hidden, b.last_hidden)
    assert cache.length == ref.length == 31
    assert torch.equal(cache.k[:, :, :31], ref.k[:, :, :31]) and torch.equal(cache.v[:, :, :31], ref.v[:, :, :31])


@pytest.mark.numerics
def test_float32_twin_of_a_bf16_model_keeps_its_dtypes_and_stays_lossless():
    model = tiny_target(torch.float32)
    twin = copy.deepcopy(model)
    model = model.to(torch.bfloat16)
    model.set_prefill_twin(twin, from_rows=8)
    assert model.prefill_twin is twin and "prefill_twin" not in dict(model.named_modules())
    ids = torch.randint(0, model.cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(2))
    (out,), cache = _run(model, [ids])
    assert out.taps.dtype == out.last_hidden.dtype == cache.k.dtype == torch.bfloat16
    (ref,), _ = _run(twin, [ids])
    torch.testing.assert_close(out.logits, ref.logits)  # the twin computed it
    # every method on a bf16 target with a float32 prefill twin emits the argmax of its verify forwards
    from test_any_cpu import ForwardLog, replay_greedy
    from tiny import tiny_dflash, tiny_eagle

    engine = Engine(model, None, {"eagle3": tiny_eagle(model), "dflash": tiny_dflash(model)})
    for method in METHODS:
        log = ForwardLog(model)
        gen = engine.generate(GenerationRequest(ids.tolist(), 24, stop_token_ids=[],
                                                speculation=SpeculationConfig(method=method)))
        log.close()
        assert gen.output == replay_greedy(log.calls)[:24], method


@pytest.mark.numerics
@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_light_formats_run_with_float32_activations(weights):
    """The int4/int8 kernels take float32 activations too (what a float32 light target would use)."""
    from whiflash_core.quant import Int4Linear, Int8Linear

    w = torch.randn(64, 96)
    x = torch.randn(3, 96)
    if weights == "int8":
        lin = Int8Linear(w)
    else:
        q = torch.randint(0, 16, (64, 96), dtype=torch.uint8).numpy()
        d = (torch.rand(64, 3) * 0.1 + 0.01).numpy()
        lin = Int4Linear(q, d, -8 * d)
        w = torch.from_numpy((q.reshape(64, 3, 32) * d[..., None] - 8 * d[..., None]).reshape(64, 96))
    y = lin(x)
    assert y.dtype == torch.float32
    ref = x @ w.T
    torch.testing.assert_close(y, ref, rtol=0.02, atol=0.02 * float(ref.abs().max()))


def test_int8_drafters_keep_off_dense_weights_where_dense_gemms_are_slow():
    """The drafters of a light target switch to their dense weights for many rows only where the
    machine found dense GEMMs fast in their dtype: not where it prefills through a float32 twin."""
    from whiflash_core.loading import drafter_dense_from_rows
    from whiflash_core.quant import DENSE_FROM_ROWS

    emulated = choose(table(bf16_ms_per_row=20, f32_ms_per_row=1), CANDIDATES)
    native = choose(table(bf16_ms_per_row=0.5, f32_ms_per_row=1), CANDIDATES)
    assert emulated.prefill_dtype == "float32" and native.prefill_dtype == "bfloat16"
    assert drafter_dense_from_rows(emulated) == 10**9
    assert drafter_dense_from_rows(native) == drafter_dense_from_rows(None) == DENSE_FROM_ROWS


def test_the_context_table_is_timed_once_and_read_back(tmp_path, monkeypatch, quiet_machine):
    """The per-cached-position cost of a verify (machine.context_table) is cached like the verify
    tables: timed at the first start, read back at the next."""
    monkeypatch.setenv("WHIFLASH_CACHE_DIR", str(tmp_path))
    target = tiny_target(torch.float32)
    calls = []
    monkeypatch.setattr(machine, "_time_context", lambda *a: calls.append(1) or {1: 2.5e-6, 4: 5.25e-6})
    assert machine.context_table(target) == {1: 2.5e-6, 4: 5.25e-6}
    assert machine.context_table(target) == {1: 2.5e-6, 4: 5.25e-6} and len(calls) == 1
    assert len(list(tmp_path.glob("context-*.json"))) == 1


def test_a_context_timing_runs_real_forwards_at_both_contexts(monkeypatch):
    """_time_context on a real (tiny) target: every row count timed after CONTEXT and after
    LONG_CONTEXT cached positions, each forward from the right cache length. (A tiny model's
    attention is too cheap to time against the noise; the sizes are bench/context_cost_ab.py's.)"""
    monkeypatch.setattr(machine, "LONG_CONTEXT", 600)
    target = tiny_target(torch.float32, layers=2)
    starts = []
    forward = type(target).forward
    monkeypatch.setattr(type(target), "forward", lambda self, tokens, cache, *a, **k: (
        starts.append((cache.length, tokens.shape[0])), forward(self, tokens, cache, *a, **k))[1])
    table = machine._time_context(target, (), 2)
    assert set(table) == set(machine.CONTEXT_ROWS) and min(table.values()) >= 0.0
    for r in machine.CONTEXT_ROWS:
        assert starts.count((machine.CONTEXT, r)) >= 2 and starts.count((600, r)) == 2


def test_the_start_that_times_a_verify_table_prices_as_the_starts_that_read_it(tmp_path, monkeypatch, quiet_machine,
                                                                             no_spot_check):
    """The table is cached to the microsecond; the start that timed it returns it so too, or its
    rounds would be priced a hair apart from every later start's (and route apart at a near-tie)."""
    monkeypatch.setenv("WHIFLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(machine, "_time_verify", lambda *a: ({1: 3.0004567e-3, 4: 5.0001234e-3},
                                                             {4: 5.1234567e-3, 8: 9.7654321e-3}))
    target = tiny_target(torch.float32)
    timed = verify_tables(target)
    assert timed == ({1: 3.000e-3, 4: 5.000e-3}, {4: 5.123e-3, 8: 9.765e-3})
    assert verify_tables(target) == timed
