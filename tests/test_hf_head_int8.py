"""The head's logits in int8 (ResidualOutput.head_dtype='int8', faast/hf/head.py, through faast.ops.int8): the
logits against float64 hand computations of the same int8 numbers and of the true logits, and `head_gradients` with
int8 products through each kernel on every path (own logits, a head with a bias, given logits, masked positions,
chunks with a ragged last one), its kept int8 head, and where the dtype reaches (p·H, pooling, the step's tuning)."""

from __future__ import annotations

import pytest
import torch

from faast.hf import OutputPolicy
from faast.hf.output import head as head_module
from faast.ops.int8 import Int8Weight, int8_linear
from test_hf_head import DIM, VOCAB, case, reference
from test_int8 import KERNELS, _pin
from tolerances import INT8_HEAD_PRODUCTS_REL_BY_KERNEL, assert_close, rel


def hidden_and_weight(rows: int = 23, planted: int | None = 5):  # noqa: ANN201
    """hidden [rows, DIM] with column `planted` 20× the others (h̃'s few large channels), and a head weight."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(rows, DIM, generator=g)
    if planted is not None:
        hidden[:, planted] *= 20
    return hidden, torch.randn(VOCAB, DIM, generator=g) / 2


def test_the_int8_head_rounds_each_row_on_its_own_scale():
    _, weight = hidden_and_weight()
    weight[7] = 0  # a zero row stays zero, with a positive scale
    q, scale = Int8Weight(weight).rows()
    assert q.dtype == torch.int8 and q.shape == weight.shape and scale.shape == (VOCAB,)
    assert int(q.abs().max()) == 127 and bool((scale > 0).all()) and bool((q[7] == 0).all())
    assert bool((q.abs().amax(1)[torch.arange(VOCAB) != 7] == 127).all())  # every nonzero row uses its full range
    error = (q.double() * scale.double()[:, None] - weight.double()).abs()
    assert bool((error <= scale.double()[:, None] / 2 * (1 + 1e-6)).all())


@pytest.mark.parametrize("outliers", [0, 1, 4, DIM, 40])
@pytest.mark.parametrize("rows", [1, 23])
def test_int_mm_logits_are_the_products_of_their_int8_numbers(monkeypatch, outliers, rows):
    """By hand in float64: the `outliers` columns of largest magnitude exactly, every other entry as the int8 numbers
    times their row's and column's scales (the only roundings: to int8, and the scales' two float32 products)."""
    _pin(monkeypatch, "torch.int_mm")
    hidden, weight = hidden_and_weight(rows)
    int8_head = Int8Weight(weight)
    q, scale = int8_head.rows()
    got = int8_linear(hidden, int8_head, outliers=outliers)
    k = min(outliers, DIM)
    columns = hidden.abs().amax(0).topk(k).indices
    if k:
        assert 5 in columns.tolist()  # the planted column is among the largest
    rest = hidden.clone()
    rest[:, columns] = 0
    row_scale = rest.abs().amax(1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127  # all kept: 0
    q_rows = torch.round(rest / row_scale)
    assert int(q_rows.abs().max()) <= 127
    expected = (q_rows.double() @ q.double().T) * row_scale.double() * scale.double()
    expected += hidden[:, columns].double() @ weight[:, columns].double().T
    assert got.dtype == torch.float32 and got.shape == (rows, VOCAB)
    assert_close(got, expected, torch.float32)


@pytest.mark.parametrize("kernel", KERNELS)
def test_int8_logits_keep_the_large_columns_exact(monkeypatch, kernel):
    """A column 20× the others would coarsen every entry of its rows' int8 scale: kept in float32 (4 columns) the
    logits err several times less against the true float64 logits, within the declared tolerance."""
    _pin(monkeypatch, kernel)
    hidden, weight = hidden_and_weight()
    true = hidden.double() @ weight.double().T
    plain = rel(int8_linear(hidden, Int8Weight(weight), outliers=0), true)
    kept = rel(int8_linear(hidden, Int8Weight(weight), outliers=4), true)
    assert kept < INT8_HEAD_PRODUCTS_REL_BY_KERNEL[kernel] and 3 * kept < plain


@pytest.mark.parametrize("kernel", KERNELS)
def test_int8_logits_write_into_the_given_buffers(monkeypatch, kernel):
    _pin(monkeypatch, kernel)
    hidden, weight = hidden_and_weight()
    int8_head = Int8Weight(weight)
    out = torch.full((23, VOCAB), float("nan"))
    acc = torch.full((23, VOCAB), -7, dtype=torch.int32)
    got = int8_linear(hidden, int8_head, out=out, acc=acc, outliers=4)
    assert got.data_ptr() == out.data_ptr() and bool(torch.isfinite(out).all())
    assert torch.equal(got, int8_linear(hidden, int8_head, outliers=4))
    if kernel == "torch.int_mm":
        assert bool((acc != -7).any())  # the int8 sums went through the int32 buffer


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("masked", [False, True], ids=["all-learned", "masked"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("chunk", [1024, 8], ids=["one-chunk", "chunks-of-8"])
def test_head_gradients_with_int8_logits_match_float64(monkeypatch, kernel, bias, masked, chunk):
    """46 positions in one block, or 5 blocks of 8 and a ragged 6; a masked position's NaN key must neither reach the
    sums nor choose a block's float32 columns. 4 of the 24 columns stay float32, so the int8 path is the one taken."""
    _pin(monkeypatch, kernel)
    monkeypatch.setattr(head_module, "READ_CHUNK", chunk)
    monkeypatch.setattr(head_module, "INT8_OUTLIERS", 4)
    calls = []
    real = head_module.int8_linear

    def spy(hidden, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(hidden.shape[0])
        return real(hidden, *args, **kwargs)

    monkeypatch.setattr(head_module, "int8_linear", spy)
    head, keys, targets, mask = case(bias=bias, masked=masked)
    expected = reference(head, keys.masked_fill(~mask.unsqueeze(-1), 0), targets, mask)
    grads, mean_gram, prob_sum = head_module.head_gradients(head, keys, targets, mask, torch.int8)
    assert grads.dtype == torch.float32 and mean_gram.dtype == prob_sum.dtype == torch.float64
    assert bool(torch.isfinite(grads).all()) and bool((grads[~mask] == 0).all())
    for actual, want in zip((grads, mean_gram, prob_sum), expected, strict=True):
        assert 0 < rel(actual, want) < INT8_HEAD_PRODUCTS_REL_BY_KERNEL[kernel]
    assert calls == ([8] * 5 + [6] if chunk == 8 else [46])


def test_head_gradients_from_given_logits_ignore_the_int8_setting():
    """Given logits (a stream scored them) need no head logits: p·H is float32 either way, so the results are the
    float32 products' to the bit."""
    head, keys, targets, mask = case(bias=True, masked=True)
    clean = keys.masked_fill(~mask.unsqueeze(-1), 0)
    logits = (clean.double() @ head.weight.double().T + head.bias.double()).float()
    as_int8 = head_module.head_gradients(head, clean, targets, mask, torch.int8, logits)
    as_float = head_module.head_gradients(head, clean, targets, mask, torch.float32, logits)
    for a, b in zip(as_int8, as_float, strict=True):
        assert torch.equal(a, b)


def test_kept_buffers_form_the_int8_head_once_and_again_after_it_changes(monkeypatch):
    _pin(monkeypatch, "torch.int_mm")  # its int8 head is q and the row scales alone (fbgemm adds its packed copy)
    monkeypatch.setattr(head_module, "READ_CHUNK", 8)
    monkeypatch.setattr(head_module, "INT8_OUTLIERS", 4)
    formed = []

    class Counted(head_module.Int8Weight):
        def __init__(self, weight):  # noqa: ANN001
            formed.append(1)
            super().__init__(weight)

    monkeypatch.setattr(head_module, "Int8Weight", Counted)
    head, keys, targets, mask = case(bias=False, masked=True)
    fresh = head_module.head_gradients(head, keys, targets, mask, torch.int8)
    assert len(formed) == 1
    buffers = head_module.HeadBuffers()
    with buffers.kept():
        for _ in range(2):
            got = head_module.head_gradients(head, keys, targets, mask, torch.int8, buffers=buffers)
            for a, b in zip(got, fresh, strict=True):
                assert torch.equal(a, b)
        assert len(formed) == 2  # once for the two calls inside
        # z, p and the int32 sums, 8 rows each; H in int8 with its row scales (the float32 H is the head's own).
        assert buffers.held_bytes() == 8 * VOCAB * (4 + 4 + 4) + VOCAB * DIM + VOCAB * 4
        with torch.no_grad():
            head.weight.mul_(2)  # in place: a new version of the same tensor
        head_module.head_gradients(head, keys, targets, mask, torch.int8, buffers=buffers)
        assert len(formed) == 3
        assert buffers.held_bytes() == 8 * VOCAB * (4 + 4 + 4) + VOCAB * DIM + VOCAB * 4  # the old one dropped
    assert buffers.held_bytes() == 0


def test_int8_products_keep_p_h_and_the_tuning_in_float32():
    keys32, weight = torch.zeros(2, 4), torch.zeros(9, 4)
    off_cpu = torch.empty(2, 4, device="meta")  # stands in for a GPU: only the device type is read
    assert head_module.products_dtype("int8", keys32, weight) == torch.int8
    assert head_module.float_products(torch.int8) == torch.float32
    assert head_module.float_products(torch.bfloat16) == torch.bfloat16
    assert head_module.pool_threshold("auto", torch.int8, keys32) is None  # a CPU times pooling on the first block
    assert head_module.pool_threshold("auto", torch.int8, off_cpu) == OutputPolicy().pool_auto  # its p·H is float32


def test_a_masked_positions_nan_does_not_choose_the_float32_columns(monkeypatch):
    """The block's float32 columns are chosen over its rows' magnitudes: a masked position's NaN key counts as 0
    there, so the sums equal those of the same keys with that position zeroed, to the bit."""
    monkeypatch.setattr(head_module, "INT8_OUTLIERS", 4)
    head, keys, targets, mask = case(bias=False, masked=True)  # keys[0, 0] is NaN and masked
    keys[..., 9] *= 20  # a large column the choice must find
    zeroed = keys.masked_fill(~mask.unsqueeze(-1), 0)
    with_nan = head_module.head_gradients(head, keys, targets, mask, torch.int8)
    without = head_module.head_gradients(head, zeroed, targets, mask, torch.int8)
    for a, b in zip(with_nan, without, strict=True):
        assert torch.equal(a, b)


def test_int8_products_off_the_cpu_raise_naming_the_setting():
    off_cpu = torch.empty(2, 4, device="meta")  # stands in for a GPU: only the device type is read
    with pytest.raises(ValueError, match=r"ResidualOutput.head_dtype: 'int8' runs on a CPU only.*meta"):
        head_module.products_dtype("int8", off_cpu, off_cpu)
    assert head_module.products_dtype("bfloat16", off_cpu, off_cpu) == torch.bfloat16


def test_head_gradients_take_their_block_and_int8_columns_as_arguments(monkeypatch):
    """chunk and outliers given give what the module's READ_CHUNK and INT8_OUTLIERS set to them give, to the bit (the
    lab passes them rather than rebinding the globals); more float32 columns change the logits; bad values raise
    naming the argument."""
    head, keys, targets, mask = case(bias=False, masked=True)
    calls = []
    real = head_module.int8_linear

    def spy(hidden, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append((hidden.shape[0], kwargs["outliers"]))
        return real(hidden, *args, **kwargs)

    monkeypatch.setattr(head_module, "int8_linear", spy)
    given = head_module.head_gradients(head, keys, targets, mask, torch.int8, chunk=8, outliers=4)
    assert calls == [(8, 4)] * 5 + [(6, 4)]
    with monkeypatch.context() as patch:
        patch.setattr(head_module, "READ_CHUNK", 8)
        patch.setattr(head_module, "INT8_OUTLIERS", 4)
        by_globals = head_module.head_gradients(head, keys, targets, mask, torch.int8)
    for a, b in zip(given, by_globals, strict=True):
        assert torch.equal(a, b)
    wider = head_module.head_gradients(head, keys, targets, mask, torch.int8, chunk=8, outliers=12)
    assert not torch.equal(wider[0], given[0])
    for name, bad in (("chunk", 0), ("chunk", 8.0), ("outliers", -1), ("outliers", True)):
        with pytest.raises(ValueError, match=f"{name}: expected an int >= "):
            head_module.head_gradients(head, keys, targets, mask, torch.int8, **{name: bad})
