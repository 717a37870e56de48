"""Drafter trainers on a tiny random target: attention semantics, learning, resume, export.

The dataset is real self-distillation in miniature: the tiny target greedily answers random
prompts, written with the distillation pipeline's own writer, so the trainers read it exactly as
they read `whiflash train distill` output.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tiny import tiny_dflash, tiny_eagle, tiny_target
from whiflash_core.drafters.dflash import DFlashDrafter
from whiflash_core.drafters.eagle3 import Eagle3Drafter
from whiflash_core.training import dflash as TD
from whiflash_core.training import eagle3 as TE
from whiflash_core.training.data import Example, build_draft_vocab, load_examples, plan_epoch, repeat_sources
from whiflash_core.training.logs import read_log
from whiflash_core.training.loop import load_checkpoint, train
from whiflash_core.training.distill import Sample, write_samples

VOCAB = 64


# training tests run on one torch thread (conftest.one_torch_thread)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def greedy(target, prompt: list[int], n: int) -> list[int]:
    cache = target.new_cache(len(prompt) + n)
    out = target(torch.tensor(prompt), cache, logits_from=len(prompt) - 1)
    tokens = [int(out.logits[-1].argmax())]
    for _ in range(n - 1):
        out = target(torch.tensor(tokens[-1:]), cache)
        tokens.append(int(out.logits[-1].argmax()))
    return tokens


@pytest.fixture(scope="module")
def target():
    """A tiny target with confident predictions (a random init's are nearly uniform), so the soft
    cross-entropy has room to fall above its floor, the target's entropy."""
    model = tiny_target(torch.float32, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(5.0)
    return model


def write_dataset(target, d: Path, n_train: int, n_val: int, seed: int = 0, prefix: str = "") -> str:
    """Random prompts, greedy answers of the tiny target, in the distillation pipeline's format.
    Sample ids are `{prefix}{split}-{i}` (another directory of the same run needs another prefix)."""
    gen = torch.Generator().manual_seed(seed)
    for split, count in (("train", n_train), ("val", n_val)):
        samples = []
        for i in range(count):
            p_len = int(torch.randint(6, 20, (1,), generator=gen))
            prompt = torch.randint(0, VOCAB, (p_len,), generator=gen).tolist()
            r_len = int(torch.randint(16, 32, (1,), generator=gen))
            samples.append(Sample(f"{prefix}{split}-{i}", "chat" if i % 2 else "tools", np.array(prompt, dtype=np.uint16),
                                  np.array(greedy(target, prompt, r_len), dtype=np.uint16), False, False))
        os.makedirs(d / "shards" / split)
        write_samples(str(d / "shards" / split / "000-000000.npz"), samples)
    return str(d)


@pytest.fixture(scope="module")
def data_dir(target, tmp_path_factory) -> str:
    return write_dataset(target, tmp_path_factory.mktemp("distilled"), 24, 4)


@pytest.fixture(scope="module")
def small_data_dir(target, tmp_path_factory) -> str:
    """4 train sequences (one batch): a drafter that trains at all must fit them quickly."""
    return write_dataset(target, tmp_path_factory.mktemp("distilled_small"), 4, 2)


def eagle_settings(data, out, **kw) -> TE.Eagle3Settings:
    base = dict(data=data, out=str(out), steps=30, lr=3e-3, warmup=3, batch_tokens=160, draft_vocab=48,
                ttt_steps=3, log_every=1, val_every=1000, ckpt_every=1000, autocast=False)
    return TE.Eagle3Settings(**{**base, **kw})


def dflash_settings(data, out, **kw) -> TD.DFlashSettings:
    base = dict(data=data, out=str(out), steps=30, lr=3e-3, warmup=3, batch_tokens=160, draft_vocab=48,
                block_size=4, layers=1, gamma=4.0, anchors_per_seq=8, log_every=1, val_every=1000,
                ckpt_every=1000, autocast=False)
    return TD.DFlashSettings(**{**base, **kw})


def train_losses(out: Path, name: str) -> list[float]:
    return [r["loss"] for r in read_log(str(out / f"{name}.log.jsonl")) if r["kind"] == "train"]


# --------------------------------------------------------------------------- semantics

def test_ttt_attention_matches_dense_mask():
    """Step-0 keys causal, later-step keys only on the diagonal: against one masked softmax."""
    torch.manual_seed(0)
    nh, nkv, n, hd, q_start = 4, 2, 7, 8, 2
    m = n - q_start
    q = torch.randn(nh, m, hd, dtype=torch.float64)
    k0, v0 = torch.randn(2, nkv, n, hd, dtype=torch.float64)
    dk = [torch.randn(nkv, m, hd, dtype=torch.float64) for _ in range(2)]
    dv = [torch.randn(nkv, m, hd, dtype=torch.float64) for _ in range(2)]
    got = TE.ttt_attention(q, k0, v0, dk, dv, q_start)

    keys = torch.cat([k0] + dk, dim=1)
    values = torch.cat([v0] + dv, dim=1)
    rows = torch.arange(m) + q_start
    causal = torch.arange(n).unsqueeze(0) <= rows.unsqueeze(1)
    mask = torch.cat([causal] + [torch.eye(m, dtype=torch.bool)] * 2, dim=1)
    ref = F.scaled_dot_product_attention(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask,
                                         enable_gqa=True)[0].transpose(0, 1).reshape(m, -1)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)


@torch.no_grad()
def test_ttt_unroll_equals_chain_drafting():
    """Training-time test row t, step k == the drafter's own inference chain started at t, fed the
    teacher tokens: same keys, same diagonal, RoPE position t+k."""
    target = tiny_target(torch.float64)
    drafter = tiny_eagle(target, fc_norm=True)
    ids = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(5))
    taps = target(ids, target.new_cache(30), taps=drafter.tap_layers).taps
    steps, first = 4, 9
    outs = TE.unroll(drafter, ids, taps, steps, first_row=first)
    n = len(ids) - 2
    for t in range(first, n):
        cache = drafter.new_state(64).cache
        a = drafter.run(cache, drafter.embed_tokens(ids[1:t + 2]), drafter.fuse(taps[:t + 1]), 0)[-1:]
        for k in range(steps):
            if k:
                if t + 1 + k > len(ids) - 1:
                    break
                a = drafter.run(cache, drafter.embed_tokens(ids[t + 1 + k:t + 2 + k]), a, t + k)
            torch.testing.assert_close(outs[k][t - first], a[0], rtol=0, atol=1e-10)


@torch.no_grad()
def test_dflash_many_blocks_equal_single_blocks():
    """One masked forward over many anchors == drafting each block alone with context < anchor."""
    target = tiny_target(torch.float64)
    drafter = tiny_dflash(target, block=4)
    ids = torch.randint(0, VOCAB, (25,), generator=torch.Generator().manual_seed(6))
    taps = target(ids, target.new_cache(25), taps=drafter.tap_layers).taps
    anchors = torch.tensor([3, 4, 11, 20, 24])
    block = torch.full((len(anchors), 4), drafter.cfg.mask_token_id)
    block[:, 0] = ids[anchors]
    ctx_kv = drafter.context_kv(taps[:24], 0)
    many = TD.block_hidden_many(drafter, ctx_kv, anchors, block)
    for i, a in enumerate(anchors.tolist()):
        single = drafter.block_hidden(block[i], a, [(k[:, :a], v[:, :a]) for k, v in ctx_kv])
        torch.testing.assert_close(many[i], single, rtol=0, atol=1e-10)


def test_draft_vocab_and_batches():
    ex = [Example("a", "s", torch.tensor([9, 9, 1, 1, 2, 3]), 2),  # response 1 1 2 3
          Example("b", "s", torch.tensor([9, 1, 2, 5]), 1)]        # response 1 2 5
    ids, coverage = build_draft_vocab(ex, 2, 16)
    assert ids.tolist() == [1, 2] and coverage == pytest.approx(5 / 7)
    ids, _ = build_draft_vocab(ex, 6, 16)  # fewer seen tokens than asked: padded with low ids
    assert ids.tolist() == [0, 1, 2, 3, 4, 5]
    plan = plan_epoch(ex * 3, 10, seed=0, epoch=0)
    assert sum(len(b) for b in plan) == 6 and plan == plan_epoch(ex * 3, 10, seed=0, epoch=0)


def test_exclude_sources_drops_them_from_training_only(data_dir):
    everything = load_examples(data_dir, "train", 2048)
    kept = load_examples(data_dir, "train", 2048, exclude="tools, unknown")
    assert {e.source for e in everything} == {"chat", "tools"}
    assert [e.id for e in kept] == [e.id for e in everything if e.source == "chat"]


def test_repeat_sources_weights_an_epoch(data_dir):
    everything = load_examples(data_dir, "train", 2048)
    repeated = repeat_sources(everything, "tools=3")
    count = {src: sum(e.source == src for e in repeated) for src in ("chat", "tools")}
    assert count == {"chat": sum(e.source == "chat" for e in everything),
                     "tools": 3 * sum(e.source == "tools" for e in everything)}
    plan = plan_epoch(repeated, 4096, seed=0, epoch=0)
    assert sorted(i for b in plan for i in b) == sorted(e.id for e in repeated)
    assert repeat_sources(everything, "") == everything
    for bad in ("tools", "tools=0", "tools=x", "=2"):
        with pytest.raises(ValueError, match="SOURCE=N"):
            repeat_sources(everything, bad)
    with pytest.raises(ValueError, match="no training samples from nowhere"):
        repeat_sources(everything, "nowhere=2")


# --------------------------------------------------------------------------- EAGLE-3 trainer

def test_eagle3_learns_and_exports(target, small_data_dir, data_dir, tmp_path, monkeypatch):
    out = tmp_path / "e"
    s = eagle_settings(small_data_dir, out, val_every=30, lr=1e-2)
    summary = train(TE.build_task, "eagle3", s, target=target, quiet=True)
    losses = train_losses(out, "eagle3")
    assert len(losses) == 30
    # the (re-scaled) init starts near a uniform guess; 30 steps on 4 sequences must cut the loss
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5]), losses
    val = summary["last_val"]
    assert len(val["acc"]) == 3 and val["tau"] >= 1.0 and (out / "eagle3.loss.png").exists()

    # the export is the published speculators layout and reloads to the same drafter (bf16 weights)
    raw = json.loads((out / "eagle3" / "config.json").read_text())
    assert raw["speculators_model_type"] == "eagle3" and raw["fc_norm"] and not raw["norm_before_residual"]
    assert raw["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3] and raw["draft_vocab_size"] == 48
    loaded = Eagle3Drafter.load(str(out / "eagle3"), target, torch.float32)
    ckpt = load_checkpoint(str(out / "eagle3.ckpt.pt"))
    trained = TE.build_task(target, ckpt["vocab_ids"], s, ckpt["config"])
    trained.load_state_dict(ckpt["model"])
    with torch.no_grad():
        for name, p in trained.model.named_parameters():
            if not name.startswith("embed_tokens."):
                p.copy_(p.bfloat16().float())
        e = load_examples(data_dir, "val", 2048)[0]
        taps = target(e.ids, target.new_cache(e.length), taps=loaded.tap_layers).taps
        for a, b in zip(TE.unroll(loaded, e.ids, taps, 3), TE.unroll(trained.model, e.ids, taps, 3)):
            assert torch.equal(loaded.logits(a), trained.model.logits(b))
    assert torch.equal(loaded.d2t, trained.model.d2t) and torch.equal(loaded.t2d, trained.model.t2d)

    # `whiflash train ship` copies the export unchanged and writes a card from the run's own files
    from whiflash_core.training.ship import ship
    (Path(small_data_dir) / "manifest.json").write_text(json.dumps({
        "splits": {"train": {"by_source": {"chat": {"samples": 2, "response_tokens": 40},
                                           "tools": {"samples": 2, "response_tokens": 44}}}},
        "sources": {"chat": {"licence": "MIT"}, "tools": {"licence": "Apache-2.0"}}}))
    dest = Path(ship(str(out), "eagle3", str(tmp_path / "models"), None))
    assert (dest / "model.safetensors").read_bytes() == (out / "eagle3" / "model.safetensors").read_bytes()
    card = (dest / "README.md").read_text()
    tokens = sum(e.length for e in load_examples(small_data_dir, "train", 2048)) * 30  # one batch per epoch
    assert "Steps: 30 (epoch 29)" in card and f"tokens seen: {tokens:,}" in card, card
    assert f"| chat | MIT | {Path(small_data_dir).name} | 2 | 40 |" in card and (dest / "loss.png").exists()

    # --draft-vocab N keeps the N most frequent of the trained head rows, unchanged (size budget)
    pruned = Path(ship(str(out), "eagle3", str(tmp_path / "pruned"), None, draft_vocab=16))
    small = Eagle3Drafter.load(str(pruned), target, torch.float32)
    st = ckpt["settings"]
    kept, _ = build_draft_vocab(load_examples(st["data"], "train", st["max_len"]), 16, target.cfg.vocab_size)
    full_ids, small_ids = torch.arange(48) + loaded.d2t, torch.arange(16) + small.d2t
    assert torch.equal(small_ids, kept) and set(kept.tolist()) < set(full_ids.tolist())
    assert torch.equal(small.lm_head.weight, loaded.lm_head.weight[torch.searchsorted(full_ids, kept)])
    assert small.t2d.sum() == 16 and small.t2d[kept].all()
    assert "Shipped with the 16 most frequent" in (pruned / "README.md").read_text()

    # weights over the per-file budget ship as shards, each under it, and load as the one file did
    from whiflash_core.training import ship as ship_module
    budget = (out / "eagle3" / "model.safetensors").stat().st_size * 2 // 3
    monkeypatch.setattr(ship_module, "MAX_FILE_BYTES", budget)
    sharded = Path(ship(str(out), "eagle3", str(tmp_path / "pruned"), None))   # over the pruned ship
    files = sorted(f.name for f in sharded.iterdir() if f.name.startswith("model"))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                     "model.safetensors.index.json"], files
    assert all((sharded / f).stat().st_size < budget for f in files)
    again = Eagle3Drafter.load(str(sharded), target, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), loaded.state_dict().values()))
    assert "in 2 files" in (sharded / "README.md").read_text()


def test_eagle3_resume_after_kill_equals_straight_run(target, data_dir, tmp_path):
    kw = dict(steps=12, ckpt_every=4, val_every=6)
    straight = tmp_path / "straight"
    train(TE.build_task, "eagle3", eagle_settings(data_dir, straight, **kw), target=target, quiet=True)
    killed = tmp_path / "killed"
    # "killed" after step 10: its last checkpoint is step 8, steps 9-10 are lost and redone
    train(TE.build_task, "eagle3", eagle_settings(data_dir, killed, stop_at=10, **kw), target=target, quiet=True)
    assert load_checkpoint(str(killed / "eagle3.ckpt.pt"))["step"] == 8
    with pytest.raises(SystemExit):  # an existing run is never silently overwritten
        train(TE.build_task, "eagle3", eagle_settings(data_dir, killed, **kw), target=target, quiet=True)
    train(TE.build_task, "eagle3", eagle_settings(data_dir, killed, resume=True, **kw), target=target, quiet=True)
    _assert_same_run(straight, killed, "eagle3")


def _assert_same_run(a: Path, b: Path, name: str) -> None:
    ca, cb = load_checkpoint(str(a / f"{name}.ckpt.pt")), load_checkpoint(str(b / f"{name}.ckpt.pt"))
    assert ca["step"] == cb["step"] == 12
    for k in ca["model"]:
        assert torch.equal(ca["model"][k], cb["model"][k]), k
    for sa, sb in zip(ca["optimizer"]["state"].values(), cb["optimizer"]["state"].values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    ra, rb = read_log(str(a / f"{name}.log.jsonl")), read_log(str(b / f"{name}.log.jsonl"))
    assert [(r["kind"], r["step"]) for r in ra] == [(r["kind"], r["step"]) for r in rb]
    for x, y in zip(ra, rb):
        assert x["loss"] == y["loss"] and x["acc"] == y["acc"]


# --------------------------------------------------------------------------- DFlash trainer

def test_dflash_learns_and_exports(target, small_data_dir, data_dir, tmp_path):
    out = tmp_path / "d"
    s = dflash_settings(small_data_dir, out, val_every=30, lr=1e-2, anchors_per_seq=32)
    summary = train(TD.build_task, "dflash", s, target=target, quiet=True)
    losses = train_losses(out, "dflash")
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), losses
    assert len(summary["last_val"]["acc"]) == 3

    raw = json.loads((out / "dflash" / "config.json").read_text())
    assert raw["block_size"] == 4 and raw["draft_vocab_size"] == 48 and raw["dflash_config"]["mask_token_id"] == 16
    loaded = DFlashDrafter.load(str(out / "dflash"), target, torch.float32)
    ckpt = load_checkpoint(str(out / "dflash.ckpt.pt"))
    trained = TD.build_task(target, ckpt["vocab_ids"], s, ckpt["config"])
    trained.load_state_dict(ckpt["model"])
    with torch.no_grad():
        for p in trained.model.parameters():
            p.copy_(p.bfloat16().float())
        e = load_examples(data_dir, "val", 2048)[0]
        taps = target(e.ids, target.new_cache(e.length), taps=loaded.tap_layers).taps
        anchors = torch.arange(e.prompt_len, e.length - 1)
        block = torch.full((len(anchors), 4), 16)
        block[:, 0] = e.ids[anchors]
        outs = [m.head_logits(TD.block_hidden_many(m, m.context_kv(taps[:e.length], 0), anchors, block))
                for m in (loaded, trained.model)]
        assert torch.equal(outs[0], outs[1])


def test_dflash_resume_after_kill_equals_straight_run(target, data_dir, tmp_path):
    kw = dict(steps=12, ckpt_every=4, val_every=6)
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    train(TD.build_task, "dflash", dflash_settings(data_dir, straight, **kw), target=target, quiet=True)
    train(TD.build_task, "dflash", dflash_settings(data_dir, killed, stop_at=10, **kw), target=target, quiet=True)
    train(TD.build_task, "dflash", dflash_settings(data_dir, killed, resume=True, **kw), target=target, quiet=True)
    _assert_same_run(straight, killed, "dflash")


def test_cli_registers_trainers():
    import argparse

    from whiflash_core.training import cli

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train", "eagle3", "--data", "d", "--out", "o", "--ttt-steps", "6"])
    assert args.ttt_steps == 6 and TE.Eagle3Settings.from_args(args).ttt_steps == 6
    args = parser.parse_args(["train", "dflash", "--data", "d", "--out", "o", "--block-size", "16"])
    assert TD.DFlashSettings.from_args(args).block_size == 16 and args.lr == 6e-4
