"""The prepared GPU check (bench/gpu_check.py) runs at toy size on the CPU, so it cannot rot before
a GPU machine runs it: every section completes, identity holds for every method, the imposed
acceptance lengths are the measured ones, and it imports nothing the GPU machine lacks."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from whiflash_core.engine import METHODS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "bench", "gpu_check.py")
# installed here but not on the GPU machine (which has torch, transformers, safetensors, tokenizers)
NOT_ON_GPU_MACHINE = ("fastapi", "pydantic", "pydantic_settings", "uvicorn", "xgrammar", "gguf", "app")


@pytest.fixture(scope="module")
def toy_results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu_check") / "toy.json"
    # one thread: the toy model is far too small to gain from more, and a busy machine loses much
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--size", "toy", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_identity_holds_for_every_method_in_float32_and_float64(toy_results):
    for dtype in ("float32", "float64"):
        per_method = toy_results["identity"][dtype]
        assert set(per_method) == set(METHODS) | {"oracle"}
        for method, r in per_method.items():
            assert r["identical"], (dtype, method, r)
            assert r["sampled_tokens" if method != "oracle" else "tokens"] > 0
        # the oracle's drafts are mostly right: long accepts were exercised, not only rejections
        assert per_method["oracle"]["accepted"] > per_method["oracle"]["rounds"]


def test_checkpoints_round_trip_through_our_loaders(toy_results):
    for name in ("eagle3", "dflash"):
        r = toy_results["checkpoints"][name]
        assert {"config.json", "model.safetensors"} <= set(r["files"])
        assert r["same_drafts_as_saved"], r
        assert r["device"] == "cpu"
    assert "midlayer" not in toy_results["checkpoints"]["eagle3"]["config_keys"]  # a config, not weights
    assert "dflash_config" in toy_results["checkpoints"]["dflash"]["config_keys"]
    target = toy_results["checkpoints"]["target"]
    assert "model.safetensors" in target["files"]
    for loader in ("from_safetensors", "from_hf"):
        r = target[loader]
        assert r["device"] == "cpu" and r["same_argmax"], (loader, r)
        assert r["max_abs_logit_diff"] < 1e-5, (loader, r)  # our logits are float32


def test_verify_curve_and_throughput_at_fixed_acceptance(toy_results):
    curve = toy_results["verify"]["seconds"]
    assert sorted(int(k) for k in curve) == list(range(1, 33))
    assert all(t > 0 for t in curve.values())
    tp = toy_results["throughput"]
    assert tp["target_follows_pi"] and tp["plain_tokens_per_s"] > 0
    assert set(tp["methods"]) == {"ngram", "eagle3", "dflash", "whiflash"}
    for method, rows in tp["methods"].items():
        assert sorted(int(k) for k in rows) == [1, 2, 4, 6]
        for length, row in rows.items():
            # the last round may be cut short by max_tokens, so a little under the imposed length
            assert int(length) - 0.5 <= row["acceptance_length"] <= int(length), (method, length, row)
            assert row["tokens_per_s"] > 0
            assert set(row["round_ms"]) == {"router", "catch_up", "draft", "verify"}
            assert row["round_ms"]["verify"] > 0 and row["round_ms"]["draft"] > 0


def test_imports_only_the_engine_core():
    code = (f"import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('gpu_check', {SCRIPT!r})\n"
            "module = sys.modules['gpu_check'] = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(module)\n"
            f"print([m for m in {NOT_ON_GPU_MACHINE!r} if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"
