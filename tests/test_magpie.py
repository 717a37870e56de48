"""`whiflash train derive --step magpie`: user requests the target writes itself (training/magpie.py)."""
from __future__ import annotations

import json

import pytest

from whiflash_core.training import magpie
from whiflash_core.training.prompts import load_prompts, source_info

BENCH_TURN = "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences."


@pytest.fixture()
def bench_file(tmp_path):
    """A miniature Spec-Bench file: its records hold `turns`."""
    path = tmp_path / "spec_bench.jsonl"
    path.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": [BENCH_TURN, "Rewrite it."]}) + "\n")
    return str(path)


def test_requests_that_repeat_or_share_a_benchmark_run_are_dropped(bench_file):
    banned = magpie.benchmark_shingles(bench_file)
    seen: set[str] = set()
    eight = "an engaging travel blog post about a recent trip"   # 8 words of the benchmark turn
    seven = "engaging travel blog post about a recent"          # 7: not a full run
    kept = magpie.keep([f"Please write {eight} to Peru.", f"Write a {seven} visit to Rome.",
                        "Can you help me plan a garden?", "can you help me   PLAN a garden"], seen, banned)
    assert kept == [f"Write a {seven} visit to Rome.", "Can you help me plan a garden?"]
    # `seen` carries over between batches: a later batch's repeat is dropped too
    assert magpie.keep(["Can you help me plan a garden?", "What is rust?"], seen, banned) == ["What is rust?"]


def test_clean_request_bounds_the_length():
    assert magpie.clean_request("  Hi  ") is None
    assert magpie.clean_request(" How do tides work? ") == "How do tides work?"
    assert magpie.clean_request("word " * (magpie.MAX_WORDS + 1)) is None


@pytest.mark.usefixtures("one_torch_thread")
def test_sampled_requests_load_as_a_licensed_source_and_a_stopped_run_continues(tmp_path, bench_file):
    from whiflash_core.loading import load_hf_model

    model, tokenizer = target = load_hf_model(None)
    prefix = magpie.user_prefix(tokenizer)
    # the served template up to a user turn's content: the default system prompt, then the turn's opening
    assert prefix.endswith("<|im_start|>user\n") and "<|im_start|>system\n" in prefix
    assert magpie.end_of_turn(tokenizer) == tokenizer.convert_tokens_to_ids("<|im_end|>")

    out = tmp_path / "magpie_smollm2.jsonl"   # short turns only (32 tokens), to keep the test short
    first = magpie.write_magpie(str(out), 2, seed=3, batch_size=6, bench=bench_file, max_new_tokens=32, target=target)
    head = out.read_text()   # the next call continues after the last batch this one wrote
    assert first == 2
    total = magpie.write_magpie(str(out), 4, seed=3, batch_size=6, bench=bench_file, max_new_tokens=32, target=target)
    lines = out.read_text().splitlines()
    assert total == len(lines) == 4 and out.read_text().startswith(head)
    records = [json.loads(line) for line in lines]
    assert len({r["id"] for r in records}) == 4
    assert len({r["messages"][0]["content"].lower() for r in records}) == 4
    again = tmp_path / "again" / "magpie_smollm2.jsonl"   # the same seed writes the same requests
    magpie.write_magpie(str(again), 2, seed=3, batch_size=6, bench=bench_file, max_new_tokens=32, target=target)
    assert again.read_text() == head
    conversations = load_prompts([str(out)])
    assert {c["source"] for c in conversations} == {magpie.SOURCE}
    assert source_info(magpie.SOURCE).licence.startswith("Apache-2.0")
    assert all(c["messages"][-1]["role"] == "user" for c in conversations)
