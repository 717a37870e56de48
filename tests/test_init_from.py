"""Training that accumulates: several --data directories, --init-from a shipped drafter, and the
cumulative steps / tokens / hours its exports and model cards carry (tiny random target, as in
test_training.py)."""
from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch

from test_training import dflash_settings, eagle_settings, train_losses, write_dataset
from tiny import tiny_target
from whiflash_core.drafters.checkpoint import load_state_dict
from whiflash_core.training import dflash as TD
from whiflash_core.training import cli as training_cli
from whiflash_core.training import eagle3 as TE
from whiflash_core.training.data import load_examples
from whiflash_core.training.loop import load_checkpoint, train
from whiflash_core.training.ship import ship


# training tests run on one torch thread (conftest.one_torch_thread)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target():
    model = tiny_target(torch.float32, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(5.0)  # confident predictions, as in test_training.py
    return model


def with_manifest(data_dir: str, licence: str) -> str:
    """A distillation manifest for `ship`'s data table (its counts are the card's, not checked)."""
    (Path(data_dir) / "manifest.json").write_text(json.dumps({
        "splits": {"train": {"by_source": {"chat": {"samples": 12, "response_tokens": 300},
                                           "tools": {"samples": 12, "response_tokens": 280}}}},
        "sources": {"chat": {"licence": licence}, "tools": {"licence": "Apache-2.0"}}}))
    return data_dir


@pytest.fixture(scope="module")
def first_dir(target, tmp_path_factory) -> str:
    return with_manifest(write_dataset(target, tmp_path_factory.mktemp("set_a"), 24, 4), "MIT")


@pytest.fixture(scope="module")
def second_dir(target, tmp_path_factory) -> str:
    """New prompts from the same target, in a second directory (ids prefixed, as "source/key" are)."""
    return with_manifest(write_dataset(target, tmp_path_factory.mktemp("set_b"), 16, 4, seed=1, prefix="b/"),
                         "CC-BY-4.0")


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_state_dict(str(path))


def training_block(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())["whiflash_training"]


# --------------------------------------------------------------------------- several --data directories

def test_several_data_dirs_load_their_union(first_dir, second_dir):
    a, b = load_examples(first_dir, "train", 2048), load_examples(second_dir, "train", 2048)
    both = load_examples(f"{first_dir},{second_dir}", "train", 2048)
    assert len(a) == 24 and len(b) == 16
    assert [e.id for e in both] == [e.id for e in a] + [e.id for e in b]
    assert all(torch.equal(x.ids, y.ids) for x, y in zip(both, a + b))
    # the same directory twice repeats every id: refused rather than silently training it twice
    with pytest.raises(ValueError, match="in both"):
        load_examples(f"{first_dir},{first_dir}", "val", 2048)


# --------------------------------------------------------------------------- --init-from

def test_eagle3_init_from_continues_the_shipped_weights(target, first_dir, second_dir, tmp_path):
    both = f"{first_dir},{second_dir}"
    # run 1: a drafter trained on the first directory, shipped
    run1 = tmp_path / "run1"
    train(TE.build_task, "eagle3", eagle_settings(first_dir, run1, steps=30, lr=1e-2, val_every=30), target=target, quiet=True)
    shipped = Path(ship(str(run1), "eagle3", str(tmp_path / "models"), None))
    c1 = load_checkpoint(str(run1 / "eagle3.ckpt.pt"))

    # zero steps from it: the export is the shipped drafter, vocabulary and architecture included,
    # although this run's flags ask for another head size and other taps
    zero = tmp_path / "zero"
    out = train(TE.build_task, "eagle3", eagle_settings(both, zero, steps=0, init_from=str(shipped), draft_vocab=20,
                                                        taps="1,2,3"), target=target, quiet=True)
    assert out["last_val"]["step"] == 0 and out["last_val"]["tau"] >= 1  # the baseline a new version must beat
    w0, ws = weights(zero / "eagle3"), weights(shipped)
    assert w0.keys() == ws.keys() and all(torch.equal(w0[k], ws[k]) for k in ws)
    raw = json.loads((zero / "eagle3" / "config.json").read_text())
    assert raw["draft_vocab_size"] == 48 and raw["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3]

    # run 2: a few steps from it on both directories; a random init on the same data for reference
    run2, fresh = tmp_path / "run2", tmp_path / "fresh"
    kw = dict(steps=4, lr=1e-3, val_every=4)
    train(TE.build_task, "eagle3", eagle_settings(both, run2, init_from=str(shipped), **kw), target=target, quiet=True)
    train(TE.build_task, "eagle3", eagle_settings(both, fresh, **kw), target=target, quiet=True)
    cont, rand, trained = train_losses(run2, "eagle3"), train_losses(fresh, "eagle3"), train_losses(run1, "eagle3")
    # the first step is taken with the shipped weights: it keeps most of what run 1 gained over a
    # random init (its loss falls from ~10 toward the target's entropy), new sequences included
    gained, kept = rand[0] - np.mean(trained[-5:]), rand[0] - cont[0]
    assert gained > 1.0 and kept > 0.7 * gained, (cont[0], rand[0], trained[-5:])

    # cumulative bookkeeping: run 1's steps, tokens and hours plus run 2's own, and the lineage
    c2 = load_checkpoint(str(run2 / "eagle3.ckpt.pt"))
    by_id = {e.id: e.length for e in load_examples(both, "train", 2048)}
    own_tokens = sum(by_id[i] for batch in c2["plan"][:4] for i in batch)  # 4 steps, all in epoch 0
    assert c2["epoch"] == 0 and c2["tokens"] == own_tokens
    t2 = training_block(run2 / "eagle3")
    assert t2["step"] == 4 and t2["tokens"] == own_tokens
    assert t2["cumulative_steps"] == 34 and t2["cumulative_tokens"] == c1["tokens"] + own_tokens
    assert t2["cumulative_hours"] == pytest.approx(c1["wall_s"] / 3600 + t2["wall_hours"], abs=2e-3)
    assert t2["init_from"] == str(shipped.resolve()) and len(t2["lineage"]) == 1
    assert t2["lineage"][0]["steps"] == 30 and t2["lineage"][0]["data"] == [str(Path(first_dir).resolve())]
    assert t2["data"] == [str(Path(d).resolve()) for d in (first_dir, second_dir)]

    # shipping run 2: the card lists both directories' sources with their licences, and the totals
    shipped2 = Path(ship(str(run2), "eagle3", str(tmp_path / "models2"), None))
    card = (shipped2 / "README.md").read_text()
    assert f"| chat | MIT | {Path(first_dir).name} |" in card
    assert f"| chat | CC-BY-4.0 | {Path(second_dir).name} |" in card
    assert f"Cumulative over 2 runs: 34 steps, {c1['tokens'] + own_tokens:,} tokens" in card, card
    assert "the 48 rows of the drafter it continues" in card

    # run 3 from run 2's shipped weights: a third generation adds up too
    run3 = tmp_path / "run3"
    train(TE.build_task, "eagle3", eagle_settings(first_dir, run3, steps=2, init_from=str(shipped2)),
          target=target, quiet=True)
    t3 = training_block(run3 / "eagle3")
    assert t3["cumulative_steps"] == 36 and [r["steps"] for r in t3["lineage"]] == [30, 4]
    assert t3["cumulative_tokens"] == c1["tokens"] + own_tokens + t3["tokens"]


def test_dflash_init_from_a_pruned_head(target, first_dir, second_dir, tmp_path):
    run1 = tmp_path / "run1"
    train(TD.build_task, "dflash", dflash_settings(first_dir, run1, steps=20, layers=2, block_size=5),
          target=target, quiet=True)
    shipped = Path(ship(str(run1), "dflash", str(tmp_path / "models"), None, draft_vocab=16))

    # the pruned 16-row head, 2 layers and (without --block-size) block 5 come from the shipped
    # drafter, not the flags
    zero = tmp_path / "zero"
    both = f"{first_dir},{second_dir}"
    train(TD.build_task, "dflash", dflash_settings(both, zero, steps=0, init_from=str(shipped), block_size=None),
          target=target, quiet=True)
    w0, ws = weights(zero / "dflash"), weights(shipped)
    assert w0.keys() == ws.keys() and all(torch.equal(w0[k], ws[k]) for k in ws)
    assert ws["lm_head.weight"].shape[0] == 16
    raw = json.loads((zero / "dflash" / "config.json").read_text())
    assert raw["block_size"] == 5 and raw["num_hidden_layers"] == 2 and raw["draft_vocab_size"] == 16

    # a block size given goes on from the same weights at that block (its weights do not depend on it)
    run2 = tmp_path / "run2"
    train(TD.build_task, "dflash", dflash_settings(both, run2, steps=3, init_from=str(shipped), block_size=3),
          target=target, quiet=True)
    c1, c2 = load_checkpoint(str(run1 / "dflash.ckpt.pt")), load_checkpoint(str(run2 / "dflash.ckpt.pt"))
    t2 = training_block(run2 / "dflash")
    assert t2["cumulative_steps"] == 23 and t2["cumulative_tokens"] == c1["tokens"] + c2["tokens"]
    card = (Path(ship(str(run2), "dflash", str(tmp_path / "models2"), None)) / "README.md").read_text()
    assert "2 decoder layers, block size 3" in card and "the 16 rows of the drafter it continues" in card
    # the card's command is one the CLI takes (settings without a flag, e.g. max_block_queries, left out)
    command = re.search(r"- Command: `whiflash (train dflash [^`]*)`", card).group(1)
    parser = argparse.ArgumentParser(prog="whiflash")
    training_cli.add_parser(parser.add_subparsers())
    parsed = parser.parse_args(shlex.split(command))
    assert parsed.steps == 3 and parsed.init_from == str(shipped) and "max-block-queries" not in command
    # and back to the run's settings, 0/1-valued ints and switched-off bools included (layers=1, autocast=False)
    run_settings = load_checkpoint(str(run2 / "dflash.ckpt.pt"))["settings"]
    assert parsed.layers == 1 and parsed.autocast is False
    assert all(getattr(parsed, k) == v for k, v in run_settings.items() if k in vars(parsed) and k != "resume")

    # an EAGLE-3 run cannot start from a DFlash drafter
    with pytest.raises(SystemExit, match="dflash drafter"):
        train(TE.build_task, "eagle3", eagle_settings(first_dir, tmp_path / "x", init_from=str(shipped)),
              target=target, quiet=True)


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_grow_vocab_keeps_the_trained_rows_and_adds_the_most_frequent_missing_tokens(
        kind, target, first_dir, second_dir, tmp_path):
    """A head pruned at ship time (16 rows) widened to 40 by --grow-vocab: every trained row keeps
    its weights, the new rows are the most frequent train-split response tokens it lacked and start
    as the target's LM-head rows, and the vocabulary maps follow."""
    build, settings = (TE.build_task, eagle_settings) if kind == "eagle3" else (TD.build_task, dflash_settings)
    run1 = tmp_path / "run1"
    train(build, kind, settings(first_dir, run1, steps=6), target=target, quiet=True)
    shipped = Path(ship(str(run1), kind, str(tmp_path / "models"), None, draft_vocab=16))
    old = weights(shipped)
    old_ids = torch.arange(16) + old["d2t"].long()

    both = f"{first_dir},{second_dir}"
    grown = tmp_path / "grown"
    out = train(build, kind, settings(both, grown, steps=0, init_from=str(shipped), grow_vocab=40),
                target=target, quiet=True)
    new = weights(grown / kind)
    ids = torch.arange(40) + new["d2t"].long()
    assert new["lm_head.weight"].shape[0] == 40 and torch.equal(ids, torch.sort(ids).values)
    if kind == "eagle3":
        assert torch.equal(torch.nonzero(new["t2d"]).flatten(), ids)
    # the 16 trained rows, each under its own token
    row = {int(t): r for r, t in enumerate(ids)}
    for r, t in enumerate(old_ids.tolist()):
        assert torch.equal(new["lm_head.weight"][row[t]], old["lm_head.weight"][r])
    # the 24 added: the most frequent response tokens of the train split outside the old head
    from whiflash_core.training.data import response_counts
    counts = response_counts(load_examples(both, "train", 2048), target.cfg.vocab_size)
    added = sorted(set(ids.tolist()) - set(old_ids.tolist()))
    outside = counts.clone()
    outside[old_ids] = -1
    assert min(counts[added]) >= outside.topk(24).values[-1] > 0
    head = target.lm_head.weight.detach().to(torch.bfloat16)
    assert all(torch.equal(new["lm_head.weight"][row[t]], head[t]) for t in added)
    # the rest of the drafter is the shipped one
    assert all(torch.equal(new[k], old[k]) for k in old if k not in ("lm_head.weight", "d2t", "t2d"))
    assert out["last_val"]["tau"] >= 1
    one = tmp_path / "one"  # a step, so there is a checkpoint to ship
    train(build, kind, settings(both, one, steps=1, init_from=str(shipped), grow_vocab=40), target=target, quiet=True)
    card = (Path(ship(str(one), kind, str(tmp_path / "models2"), None)) / "README.md").read_text()
    assert "grown to 40 with the most frequent" in card

    with pytest.raises(SystemExit, match="already has 16 rows"):
        train(build, kind, settings(both, tmp_path / "x", steps=0, init_from=str(shipped), grow_vocab=16),
              target=target, quiet=True)
    with pytest.raises(SystemExit, match="--init-from"):
        train(build, kind, settings(both, tmp_path / "y", steps=0, grow_vocab=40), target=target, quiet=True)


def test_init_from_a_drafter_shipped_before_cumulative_fields(target, first_dir, tmp_path):
    """The first shipped drafters record steps in config.json but tokens and hours only in their
    card: continuing one counts those."""
    run1 = tmp_path / "run1"
    train(TE.build_task, "eagle3", eagle_settings(first_dir, run1, steps=6), target=target, quiet=True)
    shipped = Path(ship(str(run1), "eagle3", str(tmp_path / "models"), None))
    cfg_path = shipped / "config.json"
    raw = json.loads(cfg_path.read_text())
    old = {k: raw["whiflash_training"][k] for k in ("step", "data", "train_sequences", "draft_vocab_coverage",
                                                    "last_val")}
    old["data"] = first_dir  # a plain string then
    cfg_path.write_text(json.dumps({**raw, "whiflash_training": old}))
    card = (shipped / "README.md").read_text()
    (shipped / "README.md").write_text(re.sub(r"wall time: [\d.]+ h", "wall time: 1.75 h", card)
                                       + "\n- Command: `whiflash train eagle3 --exclude-sources tools`\n")

    run2 = tmp_path / "run2"
    train(TE.build_task, "eagle3", eagle_settings(first_dir, run2, steps=2, init_from=str(shipped)),
          target=target, quiet=True)
    t = training_block(run2 / "eagle3")
    c1 = load_checkpoint(str(run1 / "eagle3.ckpt.pt"))
    assert t["cumulative_steps"] == 8 and t["cumulative_tokens"] == c1["tokens"] + t["tokens"]
    assert t["cumulative_hours"] == pytest.approx(1.75 + t["wall_hours"], abs=1e-3)
    assert t["lineage"] == [{"data": [first_dir], "exclude_sources": "tools", "steps": 6, "tokens": c1["tokens"],
                             "hours": 1.75, "init_from": None}]


def test_cli_flags():
    import argparse

    from whiflash_core.training import cli

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train", "dflash", "--data", "a,b", "--out", "o", "--init-from", "models/x/dflash"])
    s = TD.DFlashSettings.from_args(args)
    assert s.data == "a,b" and s.init_from == "models/x/dflash"
    assert TE.Eagle3Settings.from_args(parser.parse_args(["train", "eagle3", "--data", "a", "--out", "o"])).init_from is None


def test_loading_a_float32_copy_of_a_drafter_leaves_a_bf16_target_alone(tmp_path):
    """--init-from loads the drafter in float32 (what the loop trains); the target's embedding and
    LM head it shares must stay bf16, or the target's forward breaks on mixed dtypes."""
    from tiny import tiny_dflash, tiny_eagle, tiny_target
    from whiflash_core.drafters.dflash import DFlashDrafter
    from whiflash_core.drafters.eagle3 import Eagle3Drafter

    target = tiny_target(torch.bfloat16)
    for name, drafter, cls in (("eagle3", tiny_eagle(target), Eagle3Drafter),
                               ("dflash", tiny_dflash(target), DFlashDrafter)):
        drafter.save(str(tmp_path / name))
        copy32 = cls.load(str(tmp_path / name), target, dtype=torch.float32)
        assert next(p for n, p in copy32.named_parameters() if "embed" not in n).dtype == torch.float32
        assert target.embed_tokens.weight.dtype == target.lm_head.weight.dtype == torch.bfloat16, name
        ids = torch.arange(5)
        target(ids, target.new_cache(8))  # still runs in bf16


def test_repeated_sources_are_on_the_card_and_in_the_lineage(target, first_dir, tmp_path):
    """--repeat-sources changes what a run trained on: its card says so, and so does the lineage of
    a run continued from its weights. A source with no samples stops the run before any step."""
    source = load_examples(first_dir, "train", 2048)[0].source
    run1 = tmp_path / "run1"
    train(TE.build_task, "eagle3", eagle_settings(first_dir, run1, steps=2, repeat_sources=f"{source}=2"),
          target=target, quiet=True)
    shipped = Path(ship(str(run1), "eagle3", str(tmp_path / "models"), None))
    assert f"Repeated within an epoch (SOURCE=times): {source}=2." in (shipped / "README.md").read_text()

    run2 = tmp_path / "run2"
    train(TE.build_task, "eagle3", eagle_settings(first_dir, run2, steps=1, init_from=str(shipped)),
          target=target, quiet=True)
    assert training_block(run2 / "eagle3")["lineage"][0]["repeat_sources"] == f"{source}=2"
    card = (Path(ship(str(run2), "eagle3", str(tmp_path / "models2"), None)) / "README.md").read_text()
    assert f", repeating {source}=2" in card and "Repeated within an epoch" not in card

    with pytest.raises(SystemExit, match="no training samples from nowhere"):
        train(TE.build_task, "eagle3", eagle_settings(first_dir, tmp_path / "run3", steps=1,
                                                      repeat_sources="nowhere=2"), target=target, quiet=True)
    assert not (tmp_path / "run3" / "eagle3.ckpt.pt").exists()
