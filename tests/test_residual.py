"""residual_project (h = x + x M) and fold_readout (M = W P) against float64."""

from __future__ import annotations

import pytest
import torch

from faast import ops
from tolerances import assert_close


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(5,), (3, 7), (2, 3, 60), (1, 0, 9)], ids=lambda s: "x".join(map(str, s)))
def test_residual_matches_float64(dtype, shape):
    d = shape[-1]
    x = torch.randn(shape).to(dtype)
    m = (torch.randn(d, d) / max(d, 1) ** 0.5).to(dtype)
    out = ops.residual_project(x, m)
    assert out.dtype == dtype and out.shape == x.shape
    x64 = x.double()
    assert_close(out, x64 + x64 @ m.double(), dtype)


def test_residual_accepts_mixed_dtypes_and_strides():
    x = torch.randn(9, 4, 33).transpose(0, 1).to(torch.bfloat16)  # non-contiguous
    m = torch.randn(33, 33) / 6  # float32 master copy of M
    out = ops.residual_project(x, m)
    assert out.dtype == torch.bfloat16
    assert_close(out, x.double() + x.double() @ m.double(), torch.bfloat16)


def test_folded_readout_equals_the_unfolded_layer():
    # The layer computes h + P(h W) with P an nn.Linear; folding M = W P^T must give the same output.
    h = torch.randn(4, 11, 32, dtype=torch.float64)
    weights = torch.randn(32, 20, dtype=torch.float64)
    readout = torch.nn.Linear(20, 32, bias=False).double()
    unfolded = h + readout(h @ weights)
    folded = ops.residual_project(h, ops.fold_readout(weights, readout.weight.mT))
    assert_close(folded, unfolded, torch.float64)


def test_fold_readout_dtypes_and_batches():
    weights = torch.randn(3, 16, 8)
    readout = torch.randn(8, 16, dtype=torch.float64)
    m = ops.fold_readout(weights, readout)
    assert m.shape == (3, 16, 16) and m.dtype == torch.float64
    assert_close(m, weights.double() @ readout, torch.float64)
    assert ops.fold_readout(weights, readout, out_dtype=torch.bfloat16).dtype == torch.bfloat16


def test_residual_gradients():
    x = torch.randn(6, 10, dtype=torch.float64, requires_grad=True)
    m = torch.randn(10, 10, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(ops.residual_project, (x, m))
