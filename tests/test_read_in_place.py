"""The CPU probability-space read writing its mixture into the head's own output (faast/hf/mixture.py read_blocks,
overwrite=True): the same numbers as into a fresh result, bit for bit, for every weight form, kept rows, a logit
scale and ragged blocks; in place exactly when it may be (float32 contiguous logits, no gradient), else the caller's
logits are left as they were."""

from __future__ import annotations

import math

import pytest
import torch

from faast.hf import mixture as hf_mixture
from read_cases import read_case
from tolerances import assert_close


def _case(weights: str, *, seed: int = 0) -> tuple:
    projected, logits, weight, options = read_case(weights, n=13, d=8, v=101, seed=seed, masked_entry=True)
    return projected, logits, weight, {"compute": torch.float32, **options}


@pytest.mark.parametrize("weights", ["one", "full", "per-row"])
@pytest.mark.parametrize(("chunk", "block"), [(4, 3), (13, 13), (5, 2), (64, 32)])
def test_in_place_read_equals_the_fresh_result_bit_for_bit(weights, chunk, block):
    projected, logits, weight, options = _case(weights)
    fresh = hf_mixture.read_blocks(projected, logits, weight, chunk=chunk, block=block, **options)
    mine = logits.clone()
    got = hf_mixture.read_blocks(projected, mine, weight, chunk=chunk, block=block, overwrite=True, **options)
    assert got.data_ptr() == mine.data_ptr()  # written into the head's output, not a new [n, V] tensor
    assert torch.equal(got, fresh)
    assert not torch.equal(mine, logits)  # the mixture did change it (else this test proves nothing)
    if options["keep"] is not None:
        assert torch.equal(got[options["keep"]], logits[options["keep"]])


@pytest.mark.parametrize("form", ["bfloat16", "strided", "grad"])
def test_a_read_that_may_not_overwrite_leaves_the_logits_alone(form):
    projected, logits, weight, options = _case("per-row", seed=1)
    if form == "bfloat16":
        logits = logits.bfloat16()
    elif form == "strided":
        logits = logits.T.contiguous().T
    given = logits.detach().clone()
    if form == "grad":
        logits.requires_grad_(True)
    got = hf_mixture.read_blocks(projected, logits, weight, chunk=4, block=3, overwrite=True, **options)
    assert got.data_ptr() != logits.data_ptr()
    assert torch.equal(logits.detach(), given)
    fresh = hf_mixture.read_blocks(projected, given, weight, chunk=4, block=3, **options)
    if form == "grad":  # the differentiable composition: the same mixture, rounded in another order
        assert_close(got.detach(), fresh, torch.float32)
    else:
        assert torch.equal(got, fresh)


def _oracle(projected, logits, weight, options):
    """The read from its definition in float64: log((1 − λ)·softmax(z·s) + λ·softmax(z·s + p·Wᵀ)) / s per row, rows
    with λ = 1 the corrected softmax alone, kept rows their logits."""
    s = options["scale"]
    z = logits.double() * s
    zz = z + projected.double() @ weight.double().T
    odds, rest = options["log_odds"], options["log_rest"]
    odds = odds.double() if isinstance(odds, torch.Tensor) else torch.tensor(odds, dtype=torch.float64)
    rest = rest.double() if isinstance(rest, torch.Tensor) else torch.tensor(rest, dtype=torch.float64)
    mixed = torch.logaddexp(torch.log_softmax(z, -1) + rest, torch.log_softmax(zz, -1) + rest + odds)
    full = options["full"]
    if full is True or isinstance(full, torch.Tensor):
        rows = torch.ones(len(z), dtype=torch.bool) if full is True else full
        mixed = torch.where(rows[:, None], torch.log_softmax(zz, -1), mixed)
    mixed = mixed / s
    keep = options["keep"]
    return mixed if keep is None else torch.where(keep[:, None], logits.double(), mixed)


@pytest.mark.parametrize("weights", ["one", "full", "per-row"])
@pytest.mark.parametrize(
    ("logits_dtype", "weight_dtype"),
    [(torch.float32, torch.float32), (torch.float64, torch.float64), (torch.float64, torch.float32)],
    ids=["f32", "f64", "f64-logits-f32-head"],
)
def test_the_cpu_read_matches_the_float64_definition(weights, logits_dtype, weight_dtype):
    # One GEMM adds the head's product onto the scaled logits (or, with a head in another dtype, an add after it);
    # both must give the mixture of the definition.
    projected, logits, weight, options = _case(weights, seed=2)
    compute = torch.float64 if logits_dtype == torch.float64 else torch.float32
    options["compute"] = compute
    got = hf_mixture.read_blocks(
        projected.to(weight_dtype), logits.to(logits_dtype), weight.to(weight_dtype), chunk=5, block=3, **options
    )
    assert got.dtype == logits_dtype
    assert_close(got, _oracle(projected.to(weight_dtype), logits.to(logits_dtype), weight.to(weight_dtype), options),
                 weight_dtype if compute == torch.float64 else torch.float32)  # fmt: skip


def test_mixture_from_sum_may_write_over_either_input():
    from faast.ops.mixture import mixture_from_sum

    g = torch.Generator().manual_seed(4)
    z, dz = 3 * torch.randn(6, 77, generator=g), torch.randn(6, 77, generator=g)
    odds, rest = torch.full((6, 1), math.log(0.25 / 0.75)), torch.full((6, 1), math.log(0.75))
    want = mixture_from_sum(z, z + dz, odds, rest)
    ref = torch.logaddexp(torch.log_softmax(z.double(), -1) + math.log(0.75),
                          torch.log_softmax((z + dz).double(), -1) + math.log(0.25))  # fmt: skip
    assert_close(want, ref, torch.float32)
    for onto in ("z", "summed"):
        a, b = z.clone(), z + dz
        got = mixture_from_sum(a, b, odds, rest, out=a if onto == "z" else b)
        assert torch.equal(got, want), onto
