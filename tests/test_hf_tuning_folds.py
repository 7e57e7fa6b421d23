"""The residual output layer's held-out ends in folds (faast/hf/output/folds.py, docs/design.md §6.3): each
document's held-out rows scored by a W fitted without its own fold's left-out positions, folds dealt by the documents'
content, and the fold step taken only where it is OutputPolicy.fold_step_ratio times the one fit's, which a sample of
the rows checks at that threshold before any search. Each variation of the rule is an OutputPolicy given to the
layer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from faast.hf import FaastConfig, MemoryOffWarning, OutputPolicy, ResidualOutput, apply_faast
from faast.hf.output import folds as output_folds
from hf_models import tiny_model
from test_hf_tuning_documents import WINDOW, noisy_phrase
from tolerances import ORDER_STEP_REL, STEP_SEARCH_REL, TRUTH_REL_W, rel

CONFIG = FaastConfig(output=ResidualOutput(key_layers=[], tune_tokens=4096, head_dtype="float32"), learn_dtype="model")
SHIPPED = OutputPolicy()
# The end every document shares: a fixed phrase, repeated (licence versions end alike). The held-out end and the gap
# before it lie inside it, so the one fit, which leaves every document's end out, never sees it.
SHARED = noisy_phrase(160, seed=99, noise=0.0)


def documents(seeds: list[int]) -> list[list[int]]:
    """Texts of a body of their own (a noisy phrase) followed by SHARED."""
    return [noisy_phrase(280, seed=s) + SHARED for s in seeds]


def plain(seeds: list[int]) -> list[list[int]]:
    """Texts of a noisy phrase each, nothing shared."""
    return [noisy_phrase(440, seed=s) for s in seeds]


def learned(texts: list[list[int]], policy: OutputPolicy = SHIPPED, config: FaastConfig = CONFIG):
    """A model of `config` with `policy` that learned `texts` and solved."""
    model = apply_faast(tiny_model("llama"), config_with(config, policy))
    model.learn(texts, max_length=WINDOW, batch_size=2)
    model.output_memory_layer.folded(torch.device("cpu"), torch.float32)
    return model


def config_with(config: FaastConfig, policy: OutputPolicy) -> FaastConfig:
    return dataclasses.replace(config, output=dataclasses.replace(config.output, policy=policy))


def min_fit_of(layer) -> int:  # noqa: ANN001
    """The fewest positions the layer's tuning fit may keep (as ResidualOutputLayer computes it)."""
    return max(layer.policy.min_fit_tokens, layer.policy.fit_per_key_dim * layer.hidden_size)


def test_the_folds_statistics_split_the_left_out_positions_by_document():
    layer = learned(plain([1, 2, 3, 4, 5])).output_memory_layer
    count, min_fit = int(layer.memory.count), min_fit_of(layer)
    docs, fold, stats = layer.held_out.fold_statistics(count, min_fit, 2)
    assert sorted(docs.tolist()) == [0, 1, 2, 3, 4] and fold.tolist() == [0, 1, 0, 1, 0]
    _, _, _, s_out, t_out, n_out, _, _ = layer.step_choice().tail_statistics()
    assert rel(stats[0][0] + stats[1][0], s_out) < 1e-6 and rel(stats[0][1] + stats[1][1], t_out) < 1e-6
    assert stats[0][2] + stats[1][2] == int(n_out)
    _, _, _, out_k, out_v, _, _ = layer.held_out.split(count, min_fit)
    out_docs = layer.held_out.left_out_documents(count, min_fit)
    for f, (s, t, n) in enumerate(stats):
        rows = torch.isin(out_docs, docs[fold == f])
        k = out_k[rows].double()
        assert n == int(rows.sum()) > 0
        assert rel(s, k.T @ k) < 1e-6 and rel(t, k.T @ out_v[rows].double()) < 1e-6


@pytest.mark.parametrize("sampled, spare", [(False, False), (True, False), (True, True)])
def test_each_held_out_row_is_scored_by_the_fit_without_its_own_folds_ends(sampled, spare):
    """Every row's change, whether all rows are one set or the sample and the other row sets are written in place as
    strided views, into a fresh buffer or into the layer's spare one (NaN-filled: a row left unwritten fails)."""
    layer = learned(plain([1, 2, 3, 4])).output_memory_layer
    # taken: every row's logits are formed
    layer.policy = OutputPolicy(fold_step_ratio=1e-9, search_sample_min_rows=8 if sampled else 1024)
    min_fit = min_fit_of(layer)
    choice = layer.step_choice()
    keys, ys, docs, *_ = choice.tail_statistics()
    base = choice.tail_base(keys, ys)
    log_base = torch.log_softmax(base[0].double(), -1).gather(-1, ys[:, None]).squeeze(-1)
    curvature, width = layer.damped_curvature(), layer.hidden_size
    buffer = torch.full_like(base[0], float("nan")) if spare else None
    fold = output_folds.fold_tuning(choice, keys, ys, docs, base, log_base, width, curvature, 0.5, 0.05, min_fit,
                                    spare=buffer)  # fmt: skip
    eta, _, _, logits = fold.taken
    assert keys.shape[0] >= 8 * layer.policy.search_sample_stride or not sampled
    assert not spare or logits[1].data_ptr() == buffer.data_ptr()
    assert eta == fold.step > 0 and fold.check == "searched"
    assert torch.equal(logits[3], logits[1].gather(-1, ys[:, None]).squeeze(-1))
    count, memory, head = int(layer.memory.count), layer.memory, layer.head.weight.double()
    documents_, fold, _ = layer.held_out.fold_statistics(count, min_fit, 2)
    _, _, _, out_k, out_v, _, _ = layer.held_out.split(count, min_fit)
    out_docs = layer.held_out.left_out_documents(count, min_fit)
    for f in (0, 1):
        left = torch.isin(out_docs, documents_[fold == f])
        k, v = out_k[left].double(), out_v[left].double()
        w = layer.newton(memory.gram - k.T @ k, memory.cross - k.T @ v, memory.count - float(left.sum()), curvature)
        rows = torch.isin(docs, documents_[fold == f])
        assert rows.any()
        assert rel(logits[1][rows].double(), keys[rows].double() @ w @ head.T) < TRUTH_REL_W


def test_the_folds_come_from_the_documents_content_so_learning_order_does_not_change_the_step():
    always = OutputPolicy(fold_step_ratio=1e-9)  # always the fold step
    texts = documents([1, 2, 3, 4])
    first = learned(texts, always).output_memory_layer.last_tuning
    # dealt by the order of learning, this order would put texts 2 and 3 in one fold and 1 and 4 in the other
    second = learned([texts[0], texts[1], texts[3], texts[2]], always).output_memory_layer.last_tuning
    assert first["fold_step"] > 0 and first["tail_step"] == first["fold_step"]
    assert second["fold_step"] == pytest.approx(first["fold_step"], rel=ORDER_STEP_REL)
    assert second["step"] == pytest.approx(first["step"], rel=ORDER_STEP_REL)


def test_a_memory_the_one_fit_leaves_off_is_turned_on_where_the_folds_find_a_step():
    """Every text ends in SHARED, which the one fit never sees: it leaves the memory off. The folds fit it from the
    other fold's texts and find a step, infinitely many times the one fit's 0, so the shipped fold_step_ratio (any
    finite one) takes it; the shared end of a new text then reads better than under the base model."""
    texts = documents([1, 2, 3, 4])
    with pytest.warns(MemoryOffWarning, match="off"):
        alone = learned(texts, OutputPolicy(fold_step_ratio=float("inf"))).output_memory_layer.last_tuning
    assert alone["fold_step"] is None and alone["fold_check"] == "off"
    assert alone["one_fit_step"] == alone["tail_step"] == alone["step"] == 0.0
    assert 1.0 < SHIPPED.fold_step_ratio < float("inf")  # the shipped rule: on, and only for a larger step
    model = learned(texts)
    taken = model.output_memory_layer.last_tuning
    assert not taken["off"] and taken["one_fit_step"] == 0.0 and taken["tail_step"] == taken["fold_step"] > 0
    assert taken["fold_check"] == "searched"
    assert taken["step"] == pytest.approx(taken["fold_step"] * taken["document_shrink"], rel=1e-12)
    x = torch.tensor([(noisy_phrase(280, seed=7) + SHARED)[-WINDOW:]])
    with torch.no_grad():
        adapted = float(model(x, labels=x).loss)
        with model.disable_faast():
            base = float(model(x, labels=x).loss)
    assert adapted < base


def test_with_folds_a_memory_the_one_fit_leaves_on_keeps_the_larger_step_only_past_the_ratio():
    """Below the folds' own ratio to the one fit's step the fold step is taken; just above it the rows' NLL rises at
    the threshold, so no search runs and the one fit's step stays (every held-out row is the sample here)."""
    texts = plain([1, 2, 3, 4])

    def ratio_of(ratio: float) -> OutputPolicy:
        return OutputPolicy(fold_step_ratio=ratio)

    always = learned(texts, ratio_of(1e-9)).output_memory_layer.last_tuning
    assert always["one_fit_step"] > 0 and always["tail_step"] == always["fold_step"] > 0
    assert always["held_out_tokens"] < SHIPPED.search_sample_min_rows
    ratio = always["fold_step"] / always["one_fit_step"]
    below = learned(texts, ratio_of(ratio * 0.99)).output_memory_layer.last_tuning
    assert below["fold_check"] == "searched"
    assert below["tail_step"] == below["fold_step"] == pytest.approx(always["fold_step"], rel=STEP_SEARCH_REL)
    above = learned(texts, ratio_of(ratio * 1.01)).output_memory_layer.last_tuning
    assert above["fold_check"] == "below ratio" and above["fold_step"] is None
    assert above["tail_step"] == above["one_fit_step"] == always["one_fit_step"]
    past = ratio_of(1.01 * SHIPPED.max_step / always["one_fit_step"])
    assert learned(texts, past).output_memory_layer.last_tuning["fold_check"] == "above range"


def test_the_threshold_is_checked_on_a_sample_of_rows_and_the_search_then_ends_at_the_full_rows_step():
    """With the rows sampled (every search_sample_stride-th), a threshold well below the folds' step still searches
    and ends at the step every row gives, its search on every row starting from the sample's best step rather than
    the threshold, and one well above it stops at the sample's check."""
    texts = plain([1, 2, 3, 4])
    always = learned(texts, OutputPolicy(fold_step_ratio=1e-9)).output_memory_layer.last_tuning
    ratio = always["fold_step"] / always["one_fit_step"]
    sampled = OutputPolicy(search_sample_min_rows=8)
    assert always["held_out_tokens"] >= 8 * sampled.search_sample_stride
    low = learned(texts, dataclasses.replace(sampled, fold_step_ratio=ratio * 0.5)).output_memory_layer.last_tuning
    assert low["fold_check"] == "searched" and low["tail_step"] == low["fold_step"]
    assert low["fold_step"] == pytest.approx(always["fold_step"], rel=STEP_SEARCH_REL)
    threshold = ratio * 0.5 * low["one_fit_step"]
    first = low["held_out_nll"][0][0]  # the full rows' search trace: [(η, NLL)]
    assert first != pytest.approx(threshold, rel=1e-6) and first == pytest.approx(low["fold_step"], rel=0.5)
    high = learned(texts, dataclasses.replace(sampled, fold_step_ratio=ratio * 2.0)).output_memory_layer.last_tuning
    assert high["fold_check"] == "below ratio" and high["tail_step"] == high["one_fit_step"]


def test_a_single_text_is_left_to_the_one_fit_whose_fit_its_one_fold_would_repeat():
    one = learned([noisy_phrase(1800, seed=1)], OutputPolicy(fold_step_ratio=1e-9)).output_memory_layer.last_tuning
    assert one["fold_check"] == "one document" and one["fold_step"] is None
    assert one["held_out_documents"] == 1 and one["tail_step"] == one["one_fit_step"] > 0


@pytest.mark.parametrize("check", ["searched", "below ratio"])
def test_the_layer_writes_the_folds_change_into_the_key_width_it_did_not_choose(monkeypatch, check):
    """With two key widths and sampled rows the layer hands the folds the unchosen width's [m, V] buffer; what it
    tunes (step, trace, held-out gain, whether the fold step is taken or the one fit's kept) equals what it tunes
    with the folds' change in a fresh buffer."""
    policy = OutputPolicy(search_sample_min_rows=8, width_sample_min_rows=8, fold_step_ratio=1e-9)
    config = FaastConfig(output=ResidualOutput(tune_tokens=4096, head_dtype="float32", policy=policy),
                         learn_dtype="model")  # fmt: skip
    if check == "below ratio":  # just above the folds' own ratio: the check stops and the one fit's rows are kept
        model = apply_faast(tiny_model("llama"), config)
        model.learn(plain([1, 2, 3, 4]), max_length=WINDOW, batch_size=2)
        model.output_memory_layer.folded(torch.device("cpu"), torch.float32)
        always = model.output_memory_layer.last_tuning
        ratio = 1.01 * always["fold_step"] / always["one_fit_step"]
        config = config_with(config, dataclasses.replace(policy, fold_step_ratio=ratio))
    shipped, spares = output_folds.fold_tuning, []

    def recording(*args, drop: bool):  # noqa: ANN002, ANN202 - the layer's positional call; spare comes last
        spares.append(args[11])
        return shipped(*args[:11], spare=None if drop else args[11])

    tunings = []
    for drop in (False, True):
        monkeypatch.setattr(output_folds, "fold_tuning", lambda *a, _d=drop: recording(*a, drop=_d))
        model = apply_faast(tiny_model("llama"), config)
        model.learn(plain([1, 2, 3, 4]), max_length=WINDOW, batch_size=2)
        layer = model.output_memory_layer
        assert layer.memory.dim_key > layer.hidden_size  # two widths to choose from
        layer.folded(torch.device("cpu"), torch.float32)
        tunings.append(layer.last_tuning)
    assert spares[0] is not None and spares[0].shape[0] == tunings[0]["held_out_tokens"]
    assert tunings[0]["fold_check"] == tunings[1]["fold_check"] == check
    for key in ("step", "held_out_nll", "held_out_gain", "parts", "key_width"):
        assert tunings[0][key] == tunings[1][key], key
    assert tunings[0]["step"] > 0
