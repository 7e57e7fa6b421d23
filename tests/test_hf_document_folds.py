"""The step tuned by document folds (OutputPolicy.document_folds; faast/hf/document_folds.py, docs/design.md §6.3):
each fold's key sums are the memory's own for its documents, documents are dealt into the folds in turn (the first F
each alone), forget and merge keep the sums exact, each held-out row is read by a fit that never saw its fold, and
where fewer documents than folds were learned the tail's rule applies; the folds as a gate (the default) keep the
memory off where no learned document helps another."""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch

from faast.hf import FaastConfig, OutputPolicy, ResidualOutput, apply_faast
from faast.hf.document_folds import DocumentFolds
from hf_models import tiny_model
from test_hf_tuning_documents import TAIL, WINDOW, noisy_phrase
from tolerances import DOCUMENT_FOLDS_REL, rel

FOLDS = 3
POLICY = dataclasses.replace(OutputPolicy(), document_folds=FOLDS, document_folds_gate=False)
CONFIG = FaastConfig(output=ResidualOutput(key_layers=[], tune_tokens=4096, head_dtype="float32", policy=POLICY),
                     learn_dtype="model")  # fmt: skip
# Texts of a phrase each (seeds 1-6): their documents spread over the folds.
TEXTS = [noisy_phrase(440, seed=s) for s in range(1, 7)]
FLOOR_NATS = math.log1p(0.003)  # the suite's floor: zero-shot + 0.3% perplexity


def model_of(config: FaastConfig = CONFIG):
    torch.manual_seed(0)
    return apply_faast(tiny_model("llama"), config)


def solve(model) -> dict:  # noqa: ANN001
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a memory left off warns: these tests read last_tuning
        model.output_memory_layer.solved(torch.device("cpu"), torch.float32)
    return model.output_memory_layer.last_tuning


def fold_sums(model) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:  # noqa: ANN001
    folds = model.output_memory_layer.held_out.folds
    return [folds.sums(f) for f in range(FOLDS)]


def test_the_folds_sums_add_up_to_the_memorys_statistics():
    model = model_of()
    model.learn(TEXTS, max_length=WINDOW, batch_size=2)
    memory, sums = model.output_memory_layer.memory, fold_sums(model)
    assert rel(sum(s for s, _, _ in sums), memory.gram) < DOCUMENT_FOLDS_REL
    assert rel(sum(t for _, t, _ in sums), memory.cross) < DOCUMENT_FOLDS_REL
    assert float(sum(n for _, _, n in sums)) == float(memory.count)
    assert sum(1 for _, _, n in sums if n > 0) >= 2  # six texts: more than one fold holds some


def test_documents_are_dealt_into_the_folds_in_turn_and_a_text_seen_before_falls_where_it_fell():
    model = model_of()
    model.learn(TEXTS[:FOLDS], max_length=WINDOW, batch_size=2)
    folds = model.output_memory_layer.held_out.folds
    assert folds.fold_of(torch.arange(FOLDS)).tolist() == list(range(FOLDS))  # two documents never share a fold
    model.learn(TEXTS[FOLDS:], max_length=WINDOW, batch_size=2)
    dealt = folds.fold_of(torch.arange(len(TEXTS))).tolist()
    assert dealt == [i % FOLDS for i in range(len(TEXTS))]
    # The same texts learned apart by a buffer that follows this one fall into the same folds, in any order.
    apart = DocumentFolds(FOLDS)
    apart.follow(folds)
    keys, values = torch.randn(2, 4), torch.randn(2, 3)
    for doc in (4, 1):  # a document's first window's learned targets: its tokens after the first, up to WINDOW
        apart.add(keys, values, torch.tensor([doc, doc]), {doc: TEXTS[doc][1:WINDOW]})
    assert apart.fold_of(torch.tensor([4, 1])).tolist() == [dealt[4], dealt[1]]
    # A text learned twice, as two documents, falls into one fold: no fold's fit sees its twin.
    twice = model_of()
    twice.learn([TEXTS[0], TEXTS[1], TEXTS[0]], max_length=WINDOW, batch_size=2)
    assert twice.output_memory_layer.held_out.folds.fold_of(torch.arange(3)).tolist() == [0, 1, 0]
    # Texts that share a header (locale files) but differ within their first window are dealt apart.
    shared = model_of()
    shared.learn([TEXTS[0][:80] + TEXTS[1][:300], TEXTS[0][:80] + TEXTS[2][:300]], max_length=WINDOW, batch_size=2)
    assert shared.output_memory_layer.held_out.folds.fold_of(torch.arange(2)).tolist() == [0, 1]


def test_each_held_out_row_is_read_by_a_fit_that_never_saw_its_fold():
    model = model_of()
    model.learn(TEXTS, max_length=WINDOW, batch_size=2)
    layer = model.output_memory_layer
    choice = layer.step_choice()
    keys, _, docs, s_tail, t_tail, n_tail, _, _ = choice.tail_statistics()
    row_folds = choice.row_folds(docs)
    assert row_folds is not None and row_folds.unique().numel() >= 2
    curvature = layer.damped_curvature()
    _, weights = choice.fitted_without(s_tail, t_tail, n_tail, row_folds, curvature, layer.hidden_size)
    by_fold = {layer.held_out.folds.fold_of(torch.tensor([i]))[0].item(): [] for i in range(len(TEXTS))}
    for i, text in enumerate(TEXTS):
        by_fold[layer.held_out.folds.fold_of(torch.tensor([i]))[0].item()].append(text)
    for fold, w in weights.items():
        others = [t for f, texts in by_fold.items() if f != fold for t in texts]
        apart = model_of()
        apart.learn(others, max_length=WINDOW, batch_size=2)
        m = apart.output_memory_layer.memory
        expected = layer.newton(m.gram, m.cross, m.count, curvature, layer.hidden_size)  # the same curvature
        assert rel(w, expected) < 1e3 * DOCUMENT_FOLDS_REL, fold  # a solve magnifies the sums' rounding
    # and the step's rows read through them: a row's change is its key times its own fold's W
    change = choice.tail_logits(keys, torch.zeros(keys.shape[0], dtype=torch.long), (row_folds, weights))[1]
    first = int(row_folds[0])
    alone = choice.tail_logits(keys[:1], torch.zeros(1, dtype=torch.long), weights[first])[1]
    torch.testing.assert_close(change[:1], alone)


def test_the_step_is_tuned_by_folds_without_a_gap_or_a_shrink_and_a_new_phrase_reads_within_the_floor():
    """Texts of a phrase each: the tail's fit has seen every held-out row's phrase and tunes a large step; a fold's
    fit has not, so the step is tuned for text the memory did not learn, and a text of a new phrase reads within the
    suite's floor."""
    tail_policy = TAIL
    tail_model = model_of(dataclasses.replace(CONFIG, output=dataclasses.replace(CONFIG.output, policy=tail_policy)))
    tail_model.learn(TEXTS, max_length=WINDOW, batch_size=2)
    tail = solve(tail_model)
    model = model_of()
    model.learn(TEXTS, max_length=WINDOW, batch_size=2)
    folds = solve(model)
    assert tail["document_folds"] == 0 and tail["document_gap_tokens"] > 0
    assert folds["document_folds"] >= 2 and folds["document_gap_tokens"] == 0 and folds["document_shrink"] == 1.0
    assert folds["step"] < tail["step"]
    new = torch.tensor([noisy_phrase(WINDOW, seed=40)])
    with torch.no_grad():
        adapted = float(model(new, labels=new).loss)
        with model.disable_faast():
            base = float(model(new, labels=new).loss)
    assert adapted <= base + FLOOR_NATS


def test_one_learned_document_is_tuned_by_the_tail():
    model = model_of()
    model.learn([noisy_phrase(2400, seed=1)], max_length=WINDOW, batch_size=2)
    tuning = solve(model)
    assert tuning["tuned"] and tuning["document_folds"] == 0 and tuning["document_gap_tokens"] > 0


@pytest.mark.parametrize("policy", [POLICY, dataclasses.replace(POLICY, document_folds_gate=True)])
def test_fewer_documents_than_folds_are_tuned_by_the_tail(policy):
    """With fewer learned documents than folds, a fold's fit would hold too little of the text: the tail's rule reads
    them, step and all, gated or not; one more document and the folds apply."""
    few = [noisy_phrase(1200, seed=s) for s in range(1, FOLDS)]
    tail_model = model_of(dataclasses.replace(CONFIG, output=dataclasses.replace(CONFIG.output, policy=TAIL)))
    tail_model.learn(few, max_length=WINDOW, batch_size=2)
    tail = solve(tail_model)
    tuning = solve(learned_with(policy, few))
    assert tuning["document_folds"] == 0 and tuning["folds_gate"] is None
    assert (tuning["step"], tuning["weight"], tuning["key_width"]) == (tail["step"], tail["weight"], tail["key_width"])
    full = solve(learned_with(policy, [*few, noisy_phrase(1200, seed=FOLDS)]))
    assert full["document_folds"] >= 2 if not policy.document_folds_gate else full["folds_gate"] in ("on", "off")


def test_forgetting_texts_takes_them_out_of_their_folds():
    model = model_of()
    model.learn(TEXTS, max_length=WINDOW, batch_size=2)
    dealt = model.output_memory_layer.held_out.folds.fold_of(torch.arange(len(TEXTS))).tolist()
    model.forget([TEXTS[2], TEXTS[1]], max_length=WINDOW, batch_size=2)  # in another order than learned
    expected = [[torch.zeros(()), torch.zeros(()), 0.0] for _ in range(FOLDS)]
    for i in (0, 3, 4, 5):  # what each kept text adds, learned alone, into the fold it was dealt
        alone = model_of()
        alone.learn([TEXTS[i]], max_length=WINDOW, batch_size=2)
        m = alone.output_memory_layer.memory
        expected[dealt[i]] = [expected[dealt[i]][0] + m.gram, expected[dealt[i]][1] + m.cross,
                              expected[dealt[i]][2] + float(m.count)]  # fmt: skip
    for (s, t, n), (s2, t2, n2) in zip(fold_sums(model), expected, strict=True):
        assert float(n) == n2
        assert rel(s, s2) < DOCUMENT_FOLDS_REL and rel(t, t2) < DOCUMENT_FOLDS_REL


def test_merged_memories_hold_the_union_of_their_folds():
    model, union = model_of(), model_of()
    model.learn(TEXTS[:3], max_length=WINDOW, batch_size=2, memory="a")
    model.learn(TEXTS[3:], max_length=WINDOW, batch_size=2, memory="b")
    model.merge_memories(["a", "b"], into="ab")
    union.learn(TEXTS, max_length=WINDOW, batch_size=2)
    folds = model.memory_state("ab").output.held_out.folds
    merged = [folds.sums(f) for f in range(FOLDS)]
    for (s, t, n), (s2, t2, n2) in zip(merged, fold_sums(union), strict=True):
        assert float(n) == float(n2)
        if n > 0:
            assert rel(s, s2) < DOCUMENT_FOLDS_REL and rel(t, t2) < DOCUMENT_FOLDS_REL


def test_another_fold_count_forgets_the_folds_and_a_failed_learn_leaves_them_as_they_were():
    folds = DocumentFolds(2)
    keys, values = torch.randn(6, 4), torch.randn(6, 3)
    folds.add(keys, values, torch.tensor([0, 0, 0, 1, 1, 1]), {0: [1, 2], 1: [3]})
    before = folds.snapshot()
    folds.add(keys, values, torch.tensor([2, 2, 2, 2, 2, 2]), {2: [4]})
    folds.restore(before)
    assert set(folds.snapshot()[0]) == {0, 1}
    total = sum(folds.sums(f)[0] for f in range(2))
    assert rel(total, keys.double().T @ keys.double()) < DOCUMENT_FOLDS_REL
    model = model_of()
    model.learn(TEXTS, max_length=WINDOW, batch_size=2)
    layer = model.output_memory_layer
    layer.policy = dataclasses.replace(POLICY, document_folds=FOLDS + 1)
    assert not layer.held_out.folds and solve(model)["document_folds"] == 0


def test_a_learn_that_fails_after_good_batches_leaves_the_folds_sums_as_they_were():
    model = model_of()
    model.learn(TEXTS[:3], max_length=WINDOW, batch_size=2)
    before = [tuple(x.clone() for x in sums) for sums in fold_sums(model)]
    with pytest.raises((ValueError, TypeError)):  # the batches before the bad item have added to the folds
        model.learn(TEXTS[3:] + [["bad"]], max_length=WINDOW, batch_size=1)
    for now, was in zip(fold_sums(model), before, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(now, was, strict=True))
    model.learn(TEXTS[3:], max_length=WINDOW, batch_size=2)  # and learning goes on from them
    memory, sums = model.output_memory_layer.memory, fold_sums(model)
    assert rel(sum(s for s, _, _ in sums), memory.gram) < DOCUMENT_FOLDS_REL


def test_batches_add_to_the_folds_in_place_and_a_snapshot_keeps_its_own_copy():
    """Copying the F·(d_key² + d_key·d) float64 sums once per batch cost about 1% of a 32K-token learning pass: they
    are copied once per learn() call (the snapshot) and the batches write into them."""
    folds = DocumentFolds(2)
    keys, values = torch.randn(6, 4), torch.randn(6, 3)
    folds.add(keys, values, torch.tensor([0, 0, 0, 1, 1, 1]), {0: [1, 2], 1: [3]})
    storage = [x.data_ptr() for x in (folds.sums(0)[0], folds.sums(0)[1])]
    before = folds.snapshot()
    kept = tuple(x.clone() for x in before[3])
    folds.add(keys, values, torch.tensor([0, 0, 1, 1, 1, 1]), {})
    assert [x.data_ptr() for x in (folds.sums(0)[0], folds.sums(0)[1])] == storage  # written in place
    assert all(torch.equal(a, b) for a, b in zip(before[3], kept, strict=True))  # the snapshot did not move
    for _ in range(2):  # restored twice, with an add between: each restore puts back the snapshot's sums
        folds.restore(before)
        assert all(torch.equal(a, b) for a, b in zip(folds.snapshot()[3], kept, strict=True))
        folds.add(keys, values, torch.tensor([1, 1, 1, 1, 1, 1]), {})


GATE = OutputPolicy(document_folds=FOLDS, document_folds_gate=True)


def learned_with(policy: OutputPolicy, texts: list[list[int]]):
    model = model_of(dataclasses.replace(CONFIG, output=dataclasses.replace(CONFIG.output, policy=policy)))
    model.learn(texts, max_length=WINDOW, batch_size=2)
    return model


def test_the_folds_gate_turns_the_memory_off_where_no_learned_document_helps_another():
    """Texts of a phrase each: the tail's fit has seen every held-out row's phrase and tunes a step; read by the folds,
    no step helps, so the gated memory is off and a new phrase reads as the base model does."""
    assert solve(learned_with(TAIL, TEXTS))["step"] > 0
    model = learned_with(GATE, TEXTS)
    gated = solve(model)
    assert gated["folds_gate"] == "off" and gated["step"] == 0.0 and gated["document_folds"] >= 2
    assert "document_folds_gate" in gated["warning"]
    new = torch.tensor([noisy_phrase(WINDOW, seed=40)])
    with torch.no_grad():
        adapted = float(model(new, labels=new).loss)
        with model.disable_faast():
            base = float(model(new, labels=new).loss)
    assert adapted == pytest.approx(base, rel=1e-6)


def test_where_the_folds_find_a_gain_the_gate_takes_the_tails_step():
    """Texts that share a phrase: a fold's fit helps the others' documents, so the gate leaves the memory on with
    exactly the step, weight and key width the tail's rule chooses alone."""
    shared = [noisy_phrase(440, seed=1, noise=0.2 + 0.01 * s) for s in range(6)]
    tail = solve(learned_with(TAIL, shared))
    folds = solve(learned_with(POLICY, shared))
    gated = solve(learned_with(GATE, shared))
    assert folds["step"] > 0 and gated["folds_gate"] == "on" and gated["folds_gate_step"] == folds["step"]
    assert (gated["step"], gated["weight"], gated["key_width"]) == (tail["step"], tail["weight"], tail["key_width"])
    assert gated["document_folds"] == 0 and gated["document_gap_tokens"] == tail["document_gap_tokens"]


def test_the_gated_solve_forms_the_held_out_rows_base_logits_once(monkeypatch):
    """The gate's tuning and the tail's read the same held-out rows: the head forms their base logits once, and the
    solve chooses what each tuning alone chooses (test_where_the_folds_find_a_gain_the_gate_takes_the_tails_step)."""
    from faast.hf.output import step

    shared = [noisy_phrase(440, seed=1, noise=0.2 + 0.01 * s) for s in range(6)]
    model = learned_with(GATE, shared)
    formed = []

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        formed.append(args[1].shape[0])
        return head_logits(*args, **kwargs)

    head_logits = step.head_logits
    monkeypatch.setattr(step, "head_logits", counted)
    gated = solve(model)
    assert gated["folds_gate"] == "on" and gated["held_out_tokens"] > 0
    assert formed == [gated["held_out_tokens"]]


@pytest.mark.parametrize(("folds", "gate"), [(0, 1), (FOLDS, 1), (FOLDS, "yes")])
def test_a_gate_that_is_not_a_bool_is_refused(folds, gate):
    with pytest.raises(ValueError, match="document_folds_gate"):
        OutputPolicy(document_folds=folds, document_folds_gate=gate)


@pytest.mark.parametrize("bad", [1, -1, True, 2.0])
def test_a_fold_count_that_is_neither_off_nor_two_or_more_is_refused(bad):
    with pytest.raises(ValueError, match="document_folds"):
        OutputPolicy(document_folds=bad)
