"""faast.ops.int8: each int8 kernel against the float64 product (and torch._int_mm's against its float64 oracle of the
same int8 numbers), at odd shapes, with planted outlier columns, all-large rows of one sign (fbgemm's saturation),
NaN rows that stay in their row, empty input, kept input preparation, and the errors."""

from __future__ import annotations

import pytest
import torch

from faast.ops import _dispatch
from faast.ops.int8 import Int8Input, Int8Weight, int8_kernel, int8_linear, int8_linear_reference
from tolerances import INT8_LINEAR_REL, rel

KERNELS = ["torch.int_mm", "torch.fbgemm"]


def _pin(monkeypatch, kernel: str) -> None:
    reason = (
        _dispatch._REGISTRY["torch"]
        .variants["int8_linear"][kernel.split(".")[1]]
        .cannot_run(_dispatch.Call("int8_linear", torch.device("cpu")))
    )
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.setenv(_dispatch.ENV_VAR, f"int8_linear={kernel}")


def _case(n: int = 37, k: int = 45, m: int = 29, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g)
    x[:, 5 % k] *= 20  # a residual stream's few large channels
    x[:, 17 % k] *= -12
    return x, torch.randn(m, k, generator=g) / k**0.5


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(("n", "k", "m", "outliers"), [(37, 45, 29, 4), (1, 45, 29, 4), (130, 64, 300, 0),
                                                       (8, 7, 5, 7)])  # fmt: skip
def test_each_kernel_matches_the_float64_product(monkeypatch, kernel, n, k, m, outliers):
    _pin(monkeypatch, kernel)
    x, w = _case(n, k, m)
    got = int8_linear(x, Int8Weight(w), outliers=outliers)
    assert got.dtype == torch.float32 and got.shape == (n, m)
    assert rel(got, x.double() @ w.double().T) <= INT8_LINEAR_REL[kernel]


def test_int_mm_is_exactly_the_product_of_its_int8_numbers(monkeypatch):
    _pin(monkeypatch, "torch.int_mm")
    x, w = _case()
    weight = Int8Weight(w)
    torch.testing.assert_close(int8_linear(x, weight, outliers=3).double(), int8_linear_reference(x, weight, 3),
                               rtol=1e-6, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_outlier_columns_are_exact(monkeypatch, kernel):
    """With every column kept in float32 the product is float32's; with the planted ones kept, far closer than
    without."""
    _pin(monkeypatch, kernel)
    x, w = _case()
    truth = x.double() @ w.double().T
    assert rel(int8_linear(x, Int8Weight(w), outliers=x.shape[1]), truth) < 1e-6
    assert rel(int8_linear(x, Int8Weight(w), outliers=2), truth) < rel(
        int8_linear(x, Int8Weight(w), outliers=0), truth
    )


@pytest.mark.parametrize("kernel", KERNELS)
def test_rows_of_large_entries_of_one_sign_do_not_saturate(monkeypatch, kernel):
    """fbgemm's AVX2 kernel adds pairs of uint8·int8 products in saturating int16: 8-bit inputs gave 99% error on
    such rows; the 7-bit inputs it is called with keep the sums exact."""
    _pin(monkeypatch, kernel)
    x = torch.ones(16, 64)
    x[:, 0] = -1.0
    w = torch.ones(8, 64)
    assert rel(int8_linear(x, Int8Weight(w), outliers=0), x.double() @ w.double().T) <= INT8_LINEAR_REL[kernel]


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_nan_row_stays_in_its_row(monkeypatch, kernel):
    _pin(monkeypatch, kernel)
    x, w = _case()
    x[3, 8] = float("nan")
    got = int8_linear(x, Int8Weight(w), outliers=2)
    assert got[3].isnan().all()
    keep = torch.arange(x.shape[0]) != 3
    assert got[keep].isfinite().all()
    assert rel(got[keep], x[keep].double() @ w.double().T) <= INT8_LINEAR_REL[kernel]


def test_empty_rows_give_an_empty_product():
    assert int8_linear(torch.zeros(0, 6), Int8Weight(torch.ones(4, 6))).shape == (0, 4)


def test_a_prepared_input_is_shared_by_linears_and_knows_when_its_tensor_changed():
    x, w = _case()
    prepared = Int8Input(x, 3)
    assert prepared.same(x, 3) and not prepared.same(x, 4) and not prepared.same(x.clone(), 3)
    a = int8_linear(prepared, Int8Weight(w))
    torch.testing.assert_close(a, int8_linear(x, Int8Weight(w), outliers=3))
    x.mul_(2)
    assert not prepared.same(x, 3)  # an in-place change bumps the version


def test_bad_input_names_x_and_weight():
    weight = Int8Weight(torch.ones(4, 6))
    for x in (torch.ones(3, 5), torch.ones(3, 6, dtype=torch.float64), torch.ones(6)):
        with pytest.raises(ValueError, match=r"x: expected float32 CPU rows \[n, 6\]"):
            int8_linear(x, weight)
    with pytest.raises(ValueError, match="weight: expected a float32 matrix"):
        Int8Weight(torch.ones(4, 6, dtype=torch.float64))


def test_the_kernel_is_a_measured_choice_pinned_by_the_environment(monkeypatch):
    monkeypatch.setenv(_dispatch.ENV_VAR, "int8_linear=torch.int_mm")
    assert int8_kernel(64, Int8Weight(torch.ones(4, 6))) == "torch.int_mm"
    monkeypatch.setenv(_dispatch.ENV_VAR, "int8_linear=torch.nothing")
    with pytest.raises(RuntimeError, match="has no variant 'nothing' of int8_linear"):
        int8_kernel(64, Int8Weight(torch.ones(4, 6)))
