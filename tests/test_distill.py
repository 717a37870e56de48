"""Self-distillation data: prompt loaders, storage, resume after a kill, held-apart val split.

Runs the real pipeline on a tiny random Llama that shares the embedded SmolLM2 tokenizer, so it
needs neither /work/shared nor the real target weights.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from whiflash_core.chat import encode_chat
from whiflash_core.training import distill as D
from whiflash_core.training.prompts import SOURCES, load_prompts

FIXTURES = Path(__file__).parent / "fixtures" / "distill_prompts"
EOS = 2


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from whiflash_core.embedded import EMBEDDED_GGUF, embedded_model_dir

    d = tmp_path_factory.mktemp("tiny_llama")
    AutoTokenizer.from_pretrained(embedded_model_dir(), gguf_file=EMBEDDED_GGUF).save_pretrained(d)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=EOS, pad_token_id=EOS, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(d)
    return str(d)


def settings(model: str, out: Path, **kw) -> D.DistillSettings:
    base = dict(prompts=[str(FIXTURES)], out=str(out), model=model, dtype="float32",
                max_new_tokens=6, batch_size=2, sample_frac=0.5, val_per_source=1, threads=1)
    return D.DistillSettings(**{**base, **kw})


def test_distill_store_resume_and_val(tiny_model_dir, tmp_path):
    out = tmp_path / "distill"

    # first run stops after 3 prompts: as if killed between batches
    first = D.distill(settings(tiny_model_dir, out, limit=3))
    assert not first["complete"]
    partial = {s: D.load_distilled(str(out), s) for s in D.SPLITS}
    assert sum(len(v) for v in partial.values()) == 3
    # a kill during a write leaves only a temp file, which readers ignore
    stray = out / "shards" / "train" / "000-999999.npz.tmp42"
    stray.write_bytes(b"half a shard")

    second = D.distill(settings(tiny_model_dir, out))
    assert second["complete"]
    train, val = D.load_distilled(str(out), "train"), D.load_distilled(str(out), "val")
    ids = [x["id"] for x in train + val]
    assert len(ids) == len(set(ids)) == 6  # nothing lost, nothing twice
    assert {x["source"] for x in val} == {"chat", "tools"}  # one held apart per source
    assert not {x["id"] for x in val} & {x["id"] for x in train}
    assert not any(x["sampled"] for x in val)  # val is greedy
    assert any(x["sampled"] for x in train) and not all(x["sampled"] for x in train)

    # the first run's samples were kept as they were, not regenerated
    by_id = {x["id"]: x for x in train + val}
    for x in partial["train"] + partial["val"]:
        assert np.array_equal(by_id[x["id"]]["response_ids"], x["response_ids"])

    # prompts are the server's rendering; responses are uint16 and at most max_new_tokens long
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    convs = {c["id"]: c for c in load_prompts([str(FIXTURES)])}
    for x in train + val:
        c = convs[x["id"]]
        assert x["prompt_ids"].dtype == np.uint16 and x["response_ids"].dtype == np.uint16
        assert x["prompt_ids"].tolist() == encode_chat(tok, c["messages"], c["tools"])
        assert 0 < len(x["response_ids"]) <= 6
        assert x["finished"] == (x["response_ids"][-1] == EOS)

    # finished: shards merged into one file per split; manifest counts agree
    assert (out / "train.npz").exists() and (out / "val.npz").exists()
    assert not list((out / "shards" / "train").glob("*.npz"))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["splits"]["train"]["samples"] == len(train)
    assert manifest["splits"]["val"]["samples"] == len(val)
    assert manifest["splits"]["train"]["response_tokens"] == sum(len(x["response_ids"]) for x in train)
    assert len(manifest["sessions"]) == 2

    # a rerun has nothing left to do; resuming with other settings is refused
    third = D.distill(settings(tiny_model_dir, out))
    assert third["sessions"][-1]["samples"] == 0
    with pytest.raises(SystemExit):
        D.distill(settings(tiny_model_dir, out, max_new_tokens=7))

    # exclusions may grow on resume (an empty data set made since), never shrink, and never cover
    # answers this directory already holds
    other = tmp_path / "other"
    D.distill(settings(tiny_model_dir, other, limit=0))
    D.distill(settings(tiny_model_dir, out, exclude_done_in=[str(other)]))
    with pytest.raises(SystemExit, match="keep them"):
        D.distill(settings(tiny_model_dir, out))
    with pytest.raises(SystemExit, match="overlap"):
        D.distill(settings(tiny_model_dir, out, exclude_done_in=[str(other), str(out)]))


def test_generate_batch_keeps_eos_and_cuts_after_it():
    class StubModel:
        def generate(self, input_ids, attention_mask, generation_config):
            tail = torch.tensor([[5, 6, EOS, EOS], [7, 8, 9, 10]])
            return torch.cat([input_ids, tail], dim=1)

    jobs = [D.Job("a", "s", [1, 3], "train", False, 0), D.Job("b", "s", [4], "train", False, 0)]
    s = D.DistillSettings(prompts=[], out="", max_new_tokens=4)
    a, b = D.generate_batch(StubModel(), jobs, s, eos_id=EOS, pad_id=EOS)
    assert a.response_ids.tolist() == [5, 6, EOS] and a.finished
    assert b.response_ids.tolist() == [7, 8, 9, 10] and not b.finished


def test_batches_are_length_bucketed_and_val_first():
    s = D.DistillSettings(prompts=[], out="", batch_size=2, max_new_tokens=10, max_batch_tokens=10**6)
    jobs = [D.Job(f"j{i}", "s", [0] * n, "train", False, 0) for i, n in enumerate([9, 2, 7, 3])]
    jobs.append(D.Job("v", "s", [0] * 5, "val", False, 0))
    batches = D.plan_batches(jobs, s)
    assert [[j.id for j in b] for b in batches] == [["v"], ["j1", "j3"], ["j2", "j0"]]
    # a token budget shrinks batches of long prompts
    s.max_batch_tokens = 20
    assert all(len(b) == 1 for b in D.plan_batches(jobs, s))


def _write(path: Path, records, jsonl: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join(json.dumps(r) for r in records) if jsonl else json.dumps(records)
    path.write_text(text)


def test_prompt_loaders(tmp_path):
    _write(tmp_path / "gsm8k_train.jsonl", [{"question": "How many? ", "answer": "#### 3"}], jsonl=True)
    _write(tmp_path / "code_alpaca_2k.json",
           [{"instruction": "Sum the list.", "input": "[1, 2]", "output": "3"}], jsonl=False)
    bfcl = {"id": "simple_python_0", "question": [[{"role": "user", "content": "Area of a 3x4 box?"}]],
            "function": [{"name": "area", "description": "Area.",
                          "parameters": {"type": "dict", "properties": {
                              "w": {"type": "float"}, "dims": {"type": "tuple", "items": {"type": "int"}}}}}]}
    _write(tmp_path / "bfcl" / "BFCL_v4_simple_python.json", [bfcl], jsonl=True)
    _write(tmp_path / "bfcl" / "possible_answer" / "BFCL_v4_simple_python.json",
           [{"id": "simple_python_0", "ground_truth": []}], jsonl=True)
    glaive = {"id": "g0", "tools": [], "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "more"}]}
    _write(tmp_path / "agentic" / "glaive_toolcall_en_demo.openai.jsonl", [glaive], jsonl=True)

    convs = {c["source"]: c for c in load_prompts([str(tmp_path)])}
    assert set(convs) == {"gsm8k", "code_alpaca_2k", "bfcl_simple_python", "glaive_toolcall"}
    # permissive sources come first, CC BY-NC code alpaca last
    assert list(convs)[0] == "gsm8k" and list(convs)[-1] == "code_alpaca_2k"
    assert convs["gsm8k"]["messages"] == [{"role": "user", "content": "How many?"}]
    assert convs["code_alpaca_2k"]["messages"][0]["content"] == "Sum the list.\n\n[1, 2]"
    tool = convs["bfcl_simple_python"]["tools"][0]
    assert tool["type"] == "function" and tool["function"]["name"] == "area"
    params = tool["function"]["parameters"]
    assert params["type"] == "object" and params["properties"]["w"]["type"] == "number"
    assert params["properties"]["dims"] == {"type": "array", "items": {"type": "integer"}}
    assert convs["glaive_toolcall"]["messages"] == [{"role": "user", "content": "hi"}]
    assert convs["glaive_toolcall"]["tools"] is None
    for name in convs:
        assert name in SOURCES and SOURCES[name].licence


def test_train_cli_registers_distill():
    import argparse

    from whiflash_core.training import cli

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train", "distill", "--prompts", "p.jsonl", "--out", "o", "--limit", "4"])
    assert args.func is D.run and args.limit == 4 and args.threads == 1
