"""lab/experiments/lm_token_gain.py's pieces on a tiny model: per-position NLL against
faast.hf.evaluate.perplexity, and the token categories, gain split and LoRA's spread over seeds against hand
computations."""

from __future__ import annotations

import math

import torch

from faast.hf.evaluate import perplexity
from faast_lab.experiments.lm_token_gain import categories, gain_table, report, seed_summary, token_nll
from hf_models import VOCAB, tiny_model
from tolerances import ELEMENTWISE


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


def _seed(seed: int, ppl: dict[int, float], at_time: int) -> dict:
    return {"seed": seed, "curve": [{"steps": n, "seconds": 4.0 * n, "ppl": p} for n, p in ppl.items()],
            "at_time": at_time}  # fmt: skip


def test_seed_summary_matches_a_hand_mean_and_sample_sd_over_the_steps_every_seed_scored():
    seeds = [_seed(0, {8: 6.7, 9: 6.6, 10: 6.5}, 9), _seed(1, {8: 6.9, 9: 6.8}, 8), _seed(2, {8: 7.1, 9: 6.6}, 9)]
    out = seed_summary(seeds, faast_ppl=6.7)
    # Step 10 was scored by seed 0 only, so it is left out.
    assert [c["steps"] for c in out["steps"]] == [8, 9]
    eight = out["steps"][0]
    assert eight["ppl"] == [6.7, 6.9, 7.1]
    assert math.isclose(eight["mean"], 6.9) and math.isclose(eight["sd"], 0.2)  # deviations −0.2, 0, 0.2; n − 1 = 2
    at = out["at_time"]
    assert at["steps"] == [9, 8, 9] and at["ppl"] == [6.6, 6.9, 6.6]
    assert math.isclose(at["mean"], 6.7) and math.isclose(at["sd"], math.sqrt((0.01 + 0.04 + 0.01) / 2))
    # FAAST at 6.7 is strictly ahead of seed 1 only (a tie is not ahead).
    assert at["faast_ahead"] == 1
    assert seed_summary(seeds[:1], faast_ppl=6.0)["at_time"] == {"steps": [9], "ppl": [6.6], "mean": 6.6, "sd": 0.0,
                                                                 "faast_ahead": 1}  # fmt: skip


def test_report_lists_every_seed_and_the_verdict_at_faasts_time():
    seeds = [_seed(0, {8: 6.7, 9: 6.6}, 9), _seed(1, {8: 6.9, 9: 6.8}, 9)]
    lora = {"rank": 4, "lr": 3e-3, "lr_from": "--lora-lr", "curve": seeds[0]["curve"], "at_time": 9, "seeds": seeds,
            "over_seeds": seed_summary(seeds, faast_ppl=6.75)}  # fmt: skip
    row = {"domain": "d", "scored": 10, "ppl_base": 7.0, "ppl_faast": 6.75, "faast_step": 0.05, "budget_s": 40.0,
           "lora": lora, "gains": []}  # fmt: skip
    text = "\n".join(report([row]))
    assert "| LoRA steps | seed 0 | seed 1 | mean ± sd | against FAAST |" in text
    assert "| 9 | 6.600 | 6.800 | 6.700 ± 0.141 | LoRA ahead |" in text
    assert "| 8 | 6.700 | 6.900 | 6.800 ± 0.141 | FAAST ahead |" in text
    verdict = "At FAAST's time (steps per seed: 9, 9): LoRA 6.700 ± 0.141 on the mean; FAAST (6.750) ahead in 1 of 2"
    assert verdict in text
