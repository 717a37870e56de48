"""`whiflash train copy-prior`: prompt lookup's acceptance counted as a request would see it."""
from __future__ import annotations

import json

import torch

from whiflash_core.acceptance import AcceptanceModel, copy_situation, load_copy_prior
from whiflash_core.drafters.ngram import NgramDrafter
from whiflash_core.training.copy_prior import count, rates
from whiflash_core.training.data import Example


def test_counts_each_copy_up_to_its_first_wrong_token():
    # the answer repeats the prompt 1..8, then says 9 where the copy says 1
    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8] + [1, 2, 3, 4, 5, 6, 7, 8, 9])
    counts = count([Example("src/0", "src", ids, 8)], NgramDrafter(), 15)
    # pending token 2 at position 9: the bigram 1 2 matched, run 2; its copy 3..8 1 2 is right 6
    # times, then wrong; no other position has a run of 2
    assert counts[copy_situation(2)][:8] == [[1, 0]] * 6 + [[0, 1], [0, 0]]
    # at position 15 (pending 8) the run is 8: the copy's first token (1, where 9 came) is wrong
    assert counts[copy_situation(8)][0] == [0, 1]
    r = rates(counts)
    assert all(0.0 <= p <= 1.0 for rs in r.values() for p in rs) and all(len(rs) == 15 for rs in r.values())


def test_the_router_s_copy_model_starts_from_the_file(tmp_path):
    path = tmp_path / "copy_prior.json"
    path.write_text(json.dumps({"copy_run_bins": [3, 4, 8, 16], "rates": {"3": [0.9, 0.8]}}))
    prior = load_copy_prior(str(path))
    model = AcceptanceModel(prior)
    assert model.rates("ngram", 3, 4) == [0.9, 0.8, 0.8, 0.8]      # past its last position: its last rate
    assert model.rates("ngram", 0, 2) == [0.5, 0.5]                 # no prior there: the default
    path.write_text(json.dumps({"copy_run_bins": [3, 8], "rates": {"1": [0.9]}}))
    assert load_copy_prior(str(path)) is None                        # other situations: not ours
    assert load_copy_prior(str(tmp_path / "missing.json")) is None
