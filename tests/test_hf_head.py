"""faast.hf.head.head_gradients against a float64 hand computation: r = H[y] − softmax(h̃Hᵀ + b)·H, Σ μμᵀ and Σ p over
the learned positions, for every path through it (own logits into reused buffers, a head with a bias, logits given by
a stream, masked positions, several chunks with a ragged last one, bfloat16 products)."""

from __future__ import annotations

import pytest
import torch

from faast.hf import head as head_module
from tolerances import BF16_HEAD_PRODUCTS_REL, assert_close, rel

VOCAB, DIM = 97, 24


def reference(head: torch.nn.Linear, keys: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor):  # noqa: ANN201
    weight = head.weight.double()
    logits = keys.double() @ weight.T
    if head.bias is not None:
        logits = logits + head.bias.double()
    p = torch.softmax(logits, -1) * mask.unsqueeze(-1)
    mu = p @ weight
    grads = (weight[targets] - mu) * mask.unsqueeze(-1)
    flat_mu = mu.reshape(-1, DIM)
    return grads, flat_mu.T @ flat_mu, p.reshape(-1, VOCAB).sum(0)


def case(bias: bool, masked: bool, rows: int = 23):  # noqa: ANN201
    g = torch.Generator().manual_seed(7 + bias + 2 * masked)
    head = torch.nn.Linear(DIM, VOCAB, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, DIM, generator=g) / 2)
        if bias:
            head.bias.copy_(torch.randn(VOCAB, generator=g))
    keys = torch.randn(2, rows, DIM, generator=g)
    targets = torch.randint(0, VOCAB, (2, rows), generator=g)
    mask = torch.ones(2, rows, dtype=torch.bool)
    if masked:
        mask[0, :5] = False
        mask[1, -3:] = False
        keys[0, 0] = float("nan")  # a masked position's key must not reach the learned sums
    return head, keys, targets, mask


@pytest.mark.parametrize("masked", [False, True], ids=["all-learned", "masked"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("chunk", [1024, 8], ids=["one-chunk", "chunks-of-8"])
def test_head_gradients_match_float64(monkeypatch, bias, masked, chunk):
    monkeypatch.setattr(head_module, "READ_CHUNK", chunk)  # 46 positions: 5 full chunks of 8 and a ragged 6
    head, keys, targets, mask = case(bias, masked)
    clean = keys.masked_fill(~mask.unsqueeze(-1), 0)
    expected = reference(head, clean, targets, mask)
    grads, mean_gram, prob_sum = head_module.head_gradients(head, keys, targets, mask, torch.float32)
    assert grads.dtype == torch.float32 and mean_gram.dtype == prob_sum.dtype == torch.float64
    assert bool(torch.isfinite(grads).all())
    assert_close(grads, expected[0], torch.float32)
    assert_close(mean_gram, expected[1], torch.float32)
    assert_close(prob_sum, expected[2], torch.float32)
    assert bool((grads[~mask] == 0).all())


@pytest.mark.parametrize("chunk", [1024, 8], ids=["one-chunk", "chunks-of-8"])
def test_head_gradients_from_given_logits_match_float64(monkeypatch, chunk):
    monkeypatch.setattr(head_module, "READ_CHUNK", chunk)
    head, keys, targets, mask = case(bias=True, masked=True)
    clean = keys.masked_fill(~mask.unsqueeze(-1), 0)
    logits = (clean.double() @ head.weight.double().T + head.bias.double()).float()
    expected = reference(head, clean, targets, mask)
    # The keys are ignored for the logits when they are given: poison them.
    got = head_module.head_gradients(head, torch.full_like(keys, 1e6), targets, mask, torch.float32, logits)
    for actual, want in zip(got, expected, strict=True):
        assert_close(actual, want, torch.float32)


@pytest.mark.parametrize("chunk", [1024, 8], ids=["one-chunk", "chunks-of-8"])
def test_head_gradients_in_bfloat16_products_stay_close(monkeypatch, chunk):
    monkeypatch.setattr(head_module, "READ_CHUNK", chunk)
    head, keys, targets, mask = case(bias=False, masked=True)
    expected = reference(head, keys.masked_fill(~mask.unsqueeze(-1), 0), targets, mask)
    got = head_module.head_gradients(head, keys.masked_fill(~mask.unsqueeze(-1), 0), targets, mask, torch.bfloat16)
    for actual, want in zip(got, expected, strict=True):
        assert rel(actual, want) < BF16_HEAD_PRODUCTS_REL


def test_head_gradients_of_no_positions():
    head, keys, targets, mask = case(bias=False, masked=False)
    grads, mean_gram, prob_sum = head_module.head_gradients(
        head, keys[:, :0], targets[:, :0], mask[:, :0], torch.float32
    )
    assert grads.shape == (2, 0, DIM)
    assert bool((mean_gram == 0).all()) and bool((prob_sum == 0).all())
