"""Scoring (faast/hf/evaluate.py): token_log_probs keeps, per scored token, what perplexity sums. Against a float64
oracle that runs each window alone (no padding), its targets are exactly the windows' tokens after their first, in
order, with or without a context, and its total is perplexity's to the bit."""

from __future__ import annotations

import copy

import pytest
import torch

from faast.hf.evaluate import perplexity, token_log_probs
from hf_models import tiny_model
from tolerances import SCORE_LOG_PROB_ABS


def _windows() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 60, (n,), generator=g).tolist() for n in (17, 2, 9, 17, 5)]  # ragged: padding


def _oracle(model: torch.nn.Module, windows: list[list[int]], context: list[int]) -> torch.Tensor:
    """Each window alone behind the context, the model in float64: log p(w[t] | context, w[:t]) for t >= 1."""
    double = copy.deepcopy(model).double()
    out = []
    for w in windows:
        ids = torch.tensor([context + w])
        logp = torch.log_softmax(double(input_ids=ids, use_cache=False).logits[0, :-1], -1)
        picked = logp.gather(-1, ids[0, 1:, None])[:, 0]
        out.append(picked[len(context) :])  # the context's tokens and the window's first are not scored
    return torch.cat(out)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("context", [[], [4, 9, 11]])
def test_token_log_probs_match_a_float64_oracle_and_total_is_perplexity_exactly(kind, context):
    model, windows = tiny_model(kind), _windows()
    kept = token_log_probs(model, windows, batch_size=2, context=context, progress=False)
    assert kept.log_probs.dtype == torch.float32 and kept.targets.dtype == torch.int64
    assert torch.equal(kept.targets, torch.tensor([t for w in windows for t in w[1:]]))
    torch.testing.assert_close(kept.log_probs.double(), _oracle(model, windows, context), atol=SCORE_LOG_PROB_ABS,
                               rtol=0)  # fmt: skip
    ref = perplexity(model, windows, batch_size=2, context=context, progress=False)
    assert (kept.total.nll, kept.total.tokens) == (ref.nll, ref.tokens)
    assert kept.total.nll == pytest.approx(-float(kept.log_probs.double().sum()), rel=1e-6)


def test_scoring_nothing_is_refused():
    with pytest.raises(ValueError, match="windows: expected at least one window"):
        token_log_probs(tiny_model("llama"), [], progress=False)
