"""The residual output layer's step is tuned on the end of every learned text (faast/hf/held_out.py tail_plan,
docs/design.md §6.3): the order texts are learned in does not decide it, a last text unlike the others does not switch
the memory off, and a memory that ends up off, or far below what one of its texts would take, says so."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from faast.hf import FaastConfig, MemoryOffWarning, OutputPolicy, ResidualOutput, apply_faast
from faast.hf.held_out import tail_plan
from faast.hf.output import diagnosis as diagnosis_module
from faast.hf.output import tuning as tuning_module
from hf_models import VOCAB, tiny_model
from tolerances import ORDER_STEP_REL

# The tail's rule alone (no document folds, so no gate): what these tests are about; the folds' gate on top of it is
# tests/test_hf_document_folds.py's.
TAIL = OutputPolicy(document_folds=0)
CONFIG = FaastConfig(output=ResidualOutput(key_layers=[], tune_tokens=4096, policy=TAIL))
WINDOW = 100  # the tiny models take 128 positions


def noisy_phrase(length: int, seed: int, noise: float = 0.2) -> list[int]:
    """A repeated random phrase of 23 tokens with a share `noise` of its tokens replaced at random: text the model
    learns from its own stream."""
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(3, VOCAB, (23,), generator=g)
    text = phrase.repeat(length // 23 + 1)[:length]
    swap = torch.rand(length, generator=g) < noise
    return torch.where(swap, torch.randint(3, VOCAB, (length,), generator=g), text).tolist()


def random_text(length: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def learned(*calls: list[list[int]], policy: OutputPolicy | None = None):
    """A fresh model (CONFIG, with `policy` when given) that learned each call's texts in one learn() call, in order,
    and solved."""
    config = (
        CONFIG
        if policy is None
        else dataclasses.replace(CONFIG, output=dataclasses.replace(CONFIG.output, policy=policy))
    )
    model = apply_faast(tiny_model("llama"), config)
    for texts in calls:
        model.learn(texts, max_length=WINDOW, batch_size=2)
    model.output_memory_layer.folded(torch.device("cpu"), torch.float32)
    return model


def base_and_memory_nll(model, text: list[int]) -> tuple[float, float]:
    """Mean next-token NLL of `text` under the base model and the adapted one."""
    x = torch.tensor([text])
    with torch.no_grad():
        adapted = float(model(x, labels=x).loss)
        with model.disable_faast():
            base = float(model(x, labels=x).loss)
    return base, adapted


def test_the_plan_holds_out_every_document_in_proportion_and_does_not_depend_on_their_order():
    # 11,786 + 2,715 positions (the json + licence case's sizes): 2,048 held out, split 1,665 / 383, each with twice
    # as many left out before it; reversed, the same per document.
    plan = tail_plan([11786, 2715], 14501, 2048, 2304)
    assert plan == [(1665, 3330), (383, 766)]
    assert tail_plan([2715, 11786], 14501, 2048, 2304) == plan[::-1]
    # Too few positions to fit on once the gaps are out: no gaps; too few to hold out or fit at all: nothing.
    assert tail_plan([700], 700, 160, 300) == [(140, 0)]
    assert tail_plan([700], 700, 160, 600) == [(0, 0)]
    assert tail_plan([500], 500, 4096, 256) == [(0, 0)]  # 100 would be held out: fewer than MIN_HELD_OUT
    # A document shorter than 1/(2f) positions holds out none (round(f·n) = 0).
    assert tail_plan([5000, 2], 5002, 1000, 256)[1] == (0, 0)


def test_two_texts_learned_in_either_order_or_together_tune_the_same_step():
    a, b = noisy_phrase(700, seed=1), noisy_phrase(400, seed=2)
    runs = {"a then b": learned([a], [b]), "b then a": learned([b], [a]), "together": learned([a, b])}
    tunings = {name: model.output_memory_layer.last_tuning for name, model in runs.items()}
    first = tunings["a then b"]
    assert first["tuned"] and first["held_out_documents"] == 2 and first["step"] > 0.05
    for name, tuning in tunings.items():
        assert tuning["held_out_tokens"] == first["held_out_tokens"], name
        assert tuning["document_gap_tokens"] == first["document_gap_tokens"], name
        assert tuning["step"] == pytest.approx(first["step"], rel=1e-4), name
    # Each text's continuation reads the same in either order.
    for text in (noisy_phrase(300, seed=1)[7:], noisy_phrase(300, seed=2)[7:]):
        nll = [base_and_memory_nll(model, text)[1] for model in runs.values()]
        assert max(nll) - min(nll) < 1e-4 * max(nll)


def test_the_sampled_step_search_tunes_the_same_step_in_either_order():
    # With many held-out rows the step is tuned on a spread of tune_sample of them and its search starts from every
    # search_sample_stride-th of those. Both samples are drawn with the documents in an order of their own content,
    # so the two orders pick the same rows, and the steps agree to rounding, not merely to the search's tolerance.
    policy = dataclasses.replace(TAIL, tune_sample=150, search_sample_min_rows=64)
    a, b = noisy_phrase(700, seed=1), noisy_phrase(400, seed=2)
    first, second = (learned(*calls, policy=policy).output_memory_layer.last_tuning
                     for calls in (([a], [b]), ([b], [a])))  # fmt: skip
    assert first["tuned"] and first["held_out_tokens"] > 150 and first["step"] > 0.05
    assert second["step"] == pytest.approx(first["step"], rel=ORDER_STEP_REL)


def test_a_last_text_unlike_the_others_does_not_switch_the_memory_off():
    # Text the memory learns (a phrase), then random tokens learned last. Held out from the stream's end alone, the
    # step would be tuned on random text and be 0; held out from both texts, it is on and helps the first.
    phrase, noise = noisy_phrase(900, seed=1), random_text(240, seed=5)
    model = learned([phrase], [noise])
    tuning = model.output_memory_layer.last_tuning
    assert tuning["tuned"] and tuning["held_out_documents"] == 2 and not tuning["off"]
    assert tuning["step"] > 0.05
    base, adapted = base_and_memory_nll(model, noisy_phrase(300, seed=1)[11:])
    assert adapted < base - 0.05
    alone = learned([phrase]).output_memory_layer.last_tuning["step"]
    assert tuning["step"] > alone / OutputPolicy().part_step_ratio  # no warning: the step serves the phrase too


def disagreeing_logits(right: int, wrong: int, seed: int = 0):
    """Held-out logits (z0, z1, z0 and z1 at the targets; faast.hf.output.tuning.Logits) of `right` rows of document 0
    whose correction z1 raises the target and `wrong` rows of document 1 whose correction lowers it, and the
    documents."""
    g = torch.Generator().manual_seed(seed)
    n, vocab = right + wrong, 40
    z0 = torch.randn(n, vocab, generator=g)
    z1 = torch.randn(n, vocab, generator=g) * 0.3
    ys = torch.randint(0, vocab, (n,), generator=g)
    sign = torch.cat([torch.ones(right), -torch.ones(wrong)])
    z1[torch.arange(n), ys] += 3.0 * sign
    documents = torch.cat([torch.zeros(right, dtype=torch.long), torch.ones(wrong, dtype=torch.long)])
    rows = torch.arange(n)
    return (z0, z1, z0[rows, ys], z1[rows, ys]), documents


def nll_at(logits, rows, eta, lam):
    """Mean NLL of `rows` under (1 − λ)·softmax(z0) + λ·softmax(z0 + η·z1), float64 by hand."""
    z0, z1, t0, t1 = (v[rows].double() for v in logits)
    log_a = t0 - torch.logsumexp(z0, -1)
    log_b = t0 + eta * t1 - torch.logsumexp(z0 + eta * z1, -1)
    if lam >= 1.0:
        return float(-log_b.mean())
    return float(-torch.logaddexp(log_a + torch.log1p(torch.tensor(-lam, dtype=torch.float64)),
                                  log_b + torch.log(torch.tensor(lam, dtype=torch.float64))).mean())  # fmt: skip


@pytest.mark.parametrize(("right", "wrong", "off"), [(600, 500, False), (200, 1000, True)])
def test_a_memory_whose_texts_disagree_says_its_step_is_far_below_what_one_would_take(right, wrong, off):
    # Document 0's correction is right, document 1's wrong: the step that serves both (logit space, λ = 1: convex) is
    # far below the one document 0 alone would take (or 0: the memory is off). The diagnosis names document 0 and
    # estimates its own step.
    logits, documents = disagreeing_logits(right, wrong)
    eta, _ = tuning_module.tune_step(logits, 1.0)
    diagnosis = diagnosis_module.diagnose(logits, documents, eta, 1.0, eta)
    parts = {p["document"]: p for p in diagnosis["parts"]}
    assert sorted(parts) == [0, 1] and parts[0]["positions"] == right and parts[1]["positions"] == wrong
    own = min(torch.linspace(0, 4, 401).tolist(), key=lambda e: nll_at(logits, documents == 0, e, 1.0))
    ratio = OutputPolicy().part_step_ratio
    assert own > ratio * eta
    assert parts[0]["step"] > ratio * eta and parts[1]["step"] <= eta
    # Document 0's step is confirmed on its own rows (it gains there, significantly); document 1's is not checked.
    assert parts[0]["confirmed"] is True and parts[1]["confirmed"] is None
    assert nll_at(logits, documents == 0, parts[0]["step"], 1.0) < nll_at(logits, documents == 0, eta, 1.0)
    assert diagnosis["off"] is off and (eta == 0.0) is off
    every = torch.ones_like(documents, dtype=torch.bool)
    gain = nll_at(logits, every, 0.0, 1.0) - nll_at(logits, every, eta, 1.0)
    if not off:
        assert diagnosis["held_out_gain"] == pytest.approx(gain, rel=1e-4)
        assert "much smaller" in diagnosis["warning"] and "document 0" in diagnosis["warning"]
    else:
        assert "is off" in diagnosis["warning"] and "document 0" in diagnosis["warning"]


def test_a_memory_that_ends_up_off_says_so_once_in_what_learn_and_solve_return():
    # Random texts: no step helps their held-out ends. learn(solve=True) warns once and returns the reason; solve()
    # reports the same for every memory, without warning again (the solution is cached; warnings are errors here).
    model = apply_faast(tiny_model("llama"), CONFIG)
    texts = [random_text(400, seed=s) for s in range(4)]
    with pytest.warns(MemoryOffWarning, match="4 document") as caught:
        stats = model.learn(texts, max_length=WINDOW, batch_size=2, solve=True)
    assert len(caught) == 1 and stats.tuning["off"] and stats.tuning["step"] == 0.0
    assert stats.tuning["warning"] == str(caught[0].message)
    assert stats.tuning["held_out_gain"] <= 2 * stats.tuning["held_out_gain_se"]
    model.learn([noisy_phrase(700, seed=1)], max_length=WINDOW, batch_size=2, memory="phrase")
    report = model.solve()
    assert sorted(report) == ["default", "phrase"]
    assert report["default"] == stats.tuning and report["phrase"]["warning"] is None and not report["phrase"]["off"]
    assert report["phrase"] == model.solve(memories=["phrase"])["phrase"]
    with pytest.raises(ValueError, match="memories: no memory named 'nope'"):
        model.solve(memories=["nope"])
    with pytest.raises(TypeError, match="solve: expected True or False"):
        model.learn(texts, solve="yes")
    assert model.memory_state("default").output.memory.count == stats.pairs  # the refused call learned nothing
    x = torch.tensor([random_text(50, seed=9)])
    with torch.no_grad():
        adapted = model(x).logits
        with model.disable_faast():
            assert torch.equal(adapted, model(x).logits)  # off: the model reads exactly as the base model


def test_the_document_shrink_is_one_up_to_two_positions_per_dimension_then_their_square_root():
    shrink, d = diagnosis_module.document_shrink, 32
    assert OutputPolicy().document_positions_per_dim == 2 and OutputPolicy().document_shrink_power == 0.5
    assert shrink(2 * d * 3, 3, d) == 1.0 and shrink(60, 1, d) == 1.0 and shrink(0, 0, d) == 1.0
    assert shrink(2 * d * 3 + 3, 3, d) == pytest.approx(((2 * d * 3) / (2 * d * 3 + 3)) ** 0.5, rel=1e-15)
    assert shrink(8 * d, 1, d) == pytest.approx(0.5, rel=1e-15)
    assert shrink(8 * d, 2, d) == pytest.approx(0.5**0.5, rel=1e-15)
    assert shrink(8 * d, 0, d) == shrink(8 * d, 1, d)  # no held-out document counts as one


def test_one_long_text_reads_at_the_tails_step_times_the_document_shrink_and_many_short_ones_at_the_tails(caplog):
    text = noisy_phrase(3000, seed=3)
    with caplog.at_level(logging.INFO, logger="faast.hf"):
        layer = learned([text]).output_memory_layer
    said = [r.getMessage() for r in caplog.records if "shrunk" in r.getMessage()]
    assert len(said) == 1 and f"shrunk ×{layer.last_tuning['document_shrink']:.2f}" in said[0]
    tuned = layer.last_tuning
    per_document = tuned["fitted_tokens"] / tuned["held_out_documents"]
    expected = (OutputPolicy().document_positions_per_dim * 32 / per_document) ** 0.5
    assert tuned["held_out_documents"] == 1 and tuned["tail_step"] > 0.05 and expected < 0.5
    assert tuned["document_shrink"] == pytest.approx(expected, rel=1e-12)
    assert tuned["step"] == pytest.approx(tuned["tail_step"] * expected, rel=1e-12)
    m = layer.folded(torch.device("cpu"), torch.float32)
    # Without the shrink the tail tunes the same step, and what is read is M / shrink: the shrink scales M alone.
    unshrunk = learned([text], policy=dataclasses.replace(TAIL, document_positions_per_dim=10**9)).output_memory_layer
    assert unshrunk.last_tuning["document_shrink"] == 1.0
    assert unshrunk.last_tuning["step"] == pytest.approx(tuned["tail_step"], rel=1e-9)
    torch.testing.assert_close(m, expected * unshrunk.folded(torch.device("cpu"), torch.float32), rtol=1e-5, atol=1e-7)
    # The same amount of text as 30 documents: each held-out one has under 2·d fitted positions of its own.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="faast.hf"):
        parts = learned([noisy_phrase(100, seed=3 + i) for i in range(30)]).output_memory_layer.last_tuning
    assert not [r for r in caplog.records if "shrunk" in r.getMessage()]
    assert parts["fitted_tokens"] / parts["held_out_documents"] <= 2 * 32 and parts["held_out_documents"] == 30
    assert parts["document_shrink"] == 1.0 and parts["step"] == parts["tail_step"] > 0
