"""experiments/lm_token_gain.py's pieces on a tiny model: per-position NLL against faast.hf.evaluate.perplexity, and
the token categories and gain split against hand computations."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

from faast.hf.evaluate import perplexity
from hf_models import VOCAB, tiny_model
from tolerances import ELEMENTWISE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
from lm_token_gain import categories, gain_table, token_nll  # noqa: E402


def test_token_nll_is_what_perplexity_averages_on_odd_window_lengths():
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(4)
    windows = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (13, 2, 7)]
    nll = token_nll(model, windows)
    assert nll.dtype == torch.float64 and nll.shape == (12 + 1 + 6,)
    assert math.isclose(math.exp(float(nll.mean())), perplexity(model, windows, batch_size=2).ppl,
                        rel_tol=ELEMENTWISE[torch.float32][1])  # fmt: skip
    # Position by position: the second window's one pair is its own prediction of token 1.
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([windows[1]])).logits[0, 0].double(), -1)
    atol, rtol = ELEMENTWISE[torch.float32]
    torch.testing.assert_close(nll[12], -logp[windows[1][1]], atol=atol, rtol=rtol)


def test_categories_follow_a_hand_count_of_the_learned_text_and_each_window():
    learned = [[5, 5, 6], [5, 7] + [8] * 120]  # counts: 5 → 3, 6 → 1, 7 → 1, 8 → 120, anything else 0
    windows = [[1, 5, 9, 5, 8], [8, 2, 8]]  # targets: 5 9 5 8 | 2 8
    masks = categories(windows, learned, whitespace={2})
    as_list = {k: v.tolist() for k, v in masks.items()}
    assert as_list["all"] == [True] * 6
    assert as_list["unseen in the learned text"] == [False, True, False, False, True, False]
    assert as_list["learned 1–9×"] == [True, False, True, False, False, False]
    assert as_list["learned 10–99×"] == [False] * 6
    assert as_list["learned ≥ 100×"] == [False, False, False, True, False, True]
    # Earlier in its own window: the second 5 (after 1 5 9), and the last 8 of window 2; not window 1's 8.
    assert as_list["earlier in its window"] == [False, False, True, False, False, True]
    assert as_list["not earlier in its window"] == [True, True, False, True, True, False]
    assert as_list["whitespace only"] == [False, False, False, False, True, False]


def test_gains_of_a_partition_add_up_to_the_total_and_match_a_hand_sum():
    base = torch.tensor([2.0, 1.0, 3.0, 0.5], dtype=torch.float64)
    method = torch.tensor([1.0, 1.5, 2.0, 0.5], dtype=torch.float64)
    masks = {"all": torch.ones(4, dtype=torch.bool), "a": torch.tensor([True, True, False, False]),
             "b": torch.tensor([False, False, True, True])}  # fmt: skip
    rows = {r["category"]: r for r in gain_table(base, {"m": method}, masks)}
    assert rows["all"]["m"] == (1.0 - 0.5 + 1.0 + 0.0) / 4
    assert rows["a"]["m"] == 0.5 / 4 and rows["b"]["m"] == 1.0 / 4
    assert rows["a"]["m"] + rows["b"]["m"] == rows["all"]["m"]
    assert rows["a"]["share"] == 0.5 and rows["b"]["base_nll"] == 1.75
