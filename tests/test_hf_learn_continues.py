"""learn(continues=True): a long text learned in pieces is one document to the residual output layer's step tuning,
as one call would make it (faast/hf/model.py, docs/design.md §6.3), and a continuation that has nothing to continue is
refused with the model unchanged."""

from __future__ import annotations

import pytest
import torch

from faast.hf import apply_faast
from faast.hf.tokens import split_by_tokens
from hf_models import tiny_model
from test_hf_tuning_documents import CONFIG, WINDOW, noisy_phrase

# 1,300 tokens cut after 595 (= 6 windows of WINDOW tokens overlapping by one, plus the shared token): both pieces'
# windows are the one call's windows, in the same batches of two.
TEXT = noisy_phrase(1300, seed=3)
CUT = 6 * (WINDOW - 1) + 1


def learned_in(calls: list[tuple[list[list[int]], bool]]):  # noqa: ANN201
    model = apply_faast(tiny_model("llama"), CONFIG)
    for texts, continues in calls:
        model.learn(texts, max_length=WINDOW, batch_size=2, continues=continues)
    model.output_memory_layer.folded(torch.device("cpu"), torch.float32)
    return model


def state(model) -> dict[str, torch.Tensor]:  # noqa: ANN001
    return {k: v.clone() for k, v in model.output_memory_layer.state_dict().items()}


def test_a_text_learned_in_two_calls_with_continues_tunes_as_one_call_does():
    first, rest = split_by_tokens([TEXT], [CUT, len(TEXT)])
    one = learned_in([([TEXT], False)]).output_memory_layer.last_tuning
    continued = learned_in([(first, False), (rest, True)]).output_memory_layer.last_tuning
    pieces = learned_in([(first, False), (rest, False)]).output_memory_layer.last_tuning
    assert one["tuned"] and one["held_out_documents"] == 1 and one["step"] > 0.01
    for key in ("held_out_documents", "held_out_tokens", "document_gap_tokens", "fitted_tokens", "tail_step", "step"):
        assert continued[key] == one[key], key
    # Without it the pieces are two documents: each holds out its own end.
    assert pieces["held_out_documents"] == 2 and pieces["step"] != one["step"]


def test_continuing_keeps_the_text_one_document_across_several_calls():
    parts = split_by_tokens([TEXT, noisy_phrase(300, seed=4)], [400, 900, 1600])
    model = learned_in([(parts[0], False), (parts[1], True), (parts[2], True)])
    # The first text in three pieces, then the second text (its own document, in the last call).
    assert model.learner.documents_numbered == 2
    assert model.output_memory_layer.last_tuning["held_out_documents"] == 2


@pytest.mark.parametrize("before", ["nothing", "tensor", "other memory", "forgotten", "merged"])
def test_a_continuation_with_nothing_to_continue_is_refused_and_changes_nothing(before):
    model = apply_faast(tiny_model("llama"), CONFIG)
    if before == "tensor":
        model.learn(torch.tensor([TEXT[:WINDOW]]))
    elif before == "other memory":
        model.learn([TEXT[:500]], max_length=WINDOW, memory="other")
    elif before == "forgotten":
        model.learn([TEXT[:500], TEXT[500:900]], max_length=WINDOW)
        model.forget([TEXT[500:900]], max_length=WINDOW)
    elif before == "merged":  # continuing into the merged memory: its texts were learned into others
        model.learn([noisy_phrase(400, seed=5)], max_length=WINDOW, memory="other")
        model.learn([TEXT[:500]], max_length=WINDOW)
        model.merge_memories(["other", "default"], into="both")
        model.set_memory("both")
    saved, memories = state(model), model.memories
    with pytest.raises(ValueError, match="continues"):
        model.learn([TEXT[900:]], max_length=WINDOW, continues=True, memory=model.active_memory)
    assert model.memories == memories
    after = state(model)
    assert after.keys() == saved.keys() and all(torch.equal(after[k], saved[k]) for k in saved)


def test_a_continuation_must_start_with_a_text():
    model = apply_faast(tiny_model("llama"), CONFIG)
    model.learn([TEXT[:500]], max_length=WINDOW)
    saved = state(model)
    with pytest.raises(ValueError, match="continues: the first input must be a text"):
        model.learn(torch.tensor([TEXT[499:600]]), continues=True)
    for first in ([{"input_ids": TEXT[499:600]}], [TEXT[499:500], TEXT[499:600]]):  # a mapping; a 1-token text
        with pytest.raises(ValueError, match="continues: the first input must be a text or a token-id list of"):
            model.learn(first, max_length=WINDOW, continues=True)
    with pytest.raises(TypeError, match="continues: expected True or False"):
        model.learn([TEXT[499:600]], max_length=WINDOW, continues="yes")
    assert all(torch.equal(v, saved[k]) for k, v in state(model).items())
    # Still continuable after the refusals: the text learned last is unchanged.
    model.learn([TEXT[499:900]], max_length=WINDOW, continues=True)
    assert model.learner.documents_numbered == 1
