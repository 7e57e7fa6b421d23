"""faast_kernels: the Triton Gram and residual kernels against float64 oracles, on small and odd shapes.

Without a GPU they run in Triton's CPU interpreter (conftest sets TRITON_INTERPRET=1), so CI checks the kernels'
indexing, masking, tiling and precision modes; tests marked gpu also compile them for a device when one exists.
Outputs allocated inside faast_kernels start as NaN under test, so a tile a kernel never writes fails.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from faast_kernels import gram as gram_kernels  # noqa: E402
from faast_kernels import interpreting  # noqa: E402
from faast_kernels import ops as kernel_ops  # noqa: E402,F401 - registers torch.ops.faast_kernels
from faast_kernels import residual as residual_kernels  # noqa: E402

from tolerances import ELEMENTWISE, TRITON_FP32_MODE_REL, rel  # noqa: E402

# The interpreter runs CPU tensors; compiled kernels need CUDA ones (conftest interprets only without a GPU).
DEVICE = "cpu" if interpreting() else "cuda"
DEVICES = [DEVICE]


def _rows(L, N, dk, dv, dtype, device, *, contiguous=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    if contiguous:
        keys = torch.randn(L, N, dk, generator=g)
    else:  # a transposed view: stride 1 along rows, not features
        keys = torch.randn(L, dk, N, generator=g).transpose(1, 2)
    values = torch.randn(L, N, dv, generator=g)[:, :, :dv]
    scores = torch.rand(L, N, generator=g)
    mask = torch.rand(L, N, generator=g) > 0.25
    return keys.to(device, dtype), values.to(device, dtype), scores.to(device), mask.to(device)


SHAPES = [  # (L, N, dk, dv): odd sizes, N not a multiple of the row block, one-row and empty inputs
    (3, 77, 60, 33),
    (1, 1, 5, 3),
    (2, 130, 33, 65),
    (1, 0, 7, 4),
    (2, 40, 1, 1),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "L{}-N{}-dk{}-dv{}".format(*s))
@pytest.mark.parametrize("options", ["plain", "scores", "mask", "scores+mask", "wls"])
def test_gram_fp64_matches_float64(device, shape, options):
    keys, values, scores, mask = _rows(*shape, torch.float32, device, contiguous=shape[0] != 2)
    s = scores if "scores" in options or options == "wls" else None
    m = mask if "mask" in options else None
    gram, cross = gram_kernels.gram_accumulate(keys, values, s, m, weighted_least_squares=options == "wls")
    ref_gram, ref_cross = gram_kernels.naive_gram(keys, values, s, m, weighted_least_squares=options == "wls")
    assert gram.dtype == cross.dtype == torch.float64
    torch.testing.assert_close(gram, ref_gram, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cross, ref_cross, rtol=1e-12, atol=1e-12)
    assert torch.equal(gram, gram.mT)


@pytest.mark.parametrize("precision", ["tf32x3", "fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gram_float32_modes(precision, dtype):
    keys, values, scores, mask = _rows(3, 77, 60, 33, dtype, DEVICE, contiguous=False)
    gram, cross = gram_kernels.gram_accumulate(keys, values, scores, mask, precision=precision)
    ref_gram, ref_cross = gram_kernels.naive_gram(keys, values, scores, mask)
    assert rel(gram, ref_gram) <= TRITON_FP32_MODE_REL and rel(cross, ref_cross) <= TRITON_FP32_MODE_REL
    assert torch.equal(gram, gram.mT)


def test_gram_ignores_nan_in_masked_rows():
    keys, values, scores, mask = _rows(2, 50, 12, 5, torch.float32, DEVICE)
    mask[1, 7] = False
    keys[1, 7, 3] = float("nan")
    values[1, 7, 0] = float("inf")
    gram, cross = gram_kernels.gram_accumulate(keys, values, scores, mask)
    ref_gram, ref_cross = gram_kernels.naive_gram(keys, values, scores, mask)
    torch.testing.assert_close(gram, ref_gram, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cross, ref_cross, rtol=1e-12, atol=1e-12)


def test_gram_accumulates_in_place_and_is_deterministic():
    keys, values, scores, _ = _rows(2, 45, 20, 9, torch.float32, DEVICE)
    first = gram_kernels.gram_accumulate(keys[:, :20], values[:, :20], scores[:, :20])
    gram, cross = first[0].clone(), first[1].clone()
    out = gram_kernels.gram_accumulate(keys[:, 20:], values[:, 20:], scores[:, 20:], gram=gram, cross=cross)
    assert out[0] is gram and out[1] is cross
    ref_gram, ref_cross = gram_kernels.naive_gram(keys, values, scores)
    torch.testing.assert_close(gram, ref_gram, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cross, ref_cross, rtol=1e-12, atol=1e-12)
    again = gram_kernels.gram_accumulate(keys, values, scores, precision="tf32x3")
    twice = gram_kernels.gram_accumulate(keys, values, scores, precision="tf32x3")
    assert torch.equal(again[0], twice[0]) and torch.equal(again[1], twice[1])  # bitwise, run to run


def test_gram_launcher_errors():
    keys, values, scores, _ = _rows(2, 10, 4, 3, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="precision: expected one of"):
        gram_kernels.gram_accumulate(keys, values, precision="fp16")
    with pytest.raises(ValueError, match=r"values: expected shape \[2, 10, dv\]"):
        gram_kernels.gram_accumulate(keys, values[:, :9])
    with pytest.raises(ValueError, match=r"scores: expected shape \[2, 10\]"):
        gram_kernels.gram_accumulate(keys, values, scores[:, :3])
    with pytest.raises(ValueError, match="gram, cross: pass both"):
        gram_kernels.gram_accumulate(keys, values, gram=torch.zeros(2, 4, 4, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match="gram: expected a contiguous float64 tensor"):
        gram_kernels.gram_accumulate(
            keys, values, gram=torch.zeros(2, 4, 4, device=DEVICE), cross=torch.zeros(2, 4, 3, device=DEVICE)
        )


@pytest.mark.parametrize("wls", [False, True], ids=["values-weighted", "wls"])
def test_gram_gradients_match_the_reference(wls):
    keys, values, scores, mask = _rows(2, 37, 20, 7, torch.float32, DEVICE)
    values = values.double().requires_grad_()
    scores = scores.double().requires_grad_()
    gram, cross = torch.ops.faast_kernels.gram_statistics(keys, values, scores, mask, wls, "fp64")
    ref_gram, ref_cross = gram_kernels.naive_gram(keys, values, scores, mask, weighted_least_squares=wls)
    g_gram, g_cross = torch.randn_like(gram), torch.randn_like(cross)
    got = torch.autograd.grad((gram * g_gram).sum() + (cross * g_cross).sum(), (values, scores))
    expected = torch.autograd.grad((ref_gram * g_gram).sum() + (ref_cross * g_cross).sum(), (values, scores))
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_gram_has_no_key_gradient():
    keys, values, scores, _ = _rows(1, 8, 4, 3, torch.float32, DEVICE)
    keys.requires_grad_()
    gram, _ = torch.ops.faast_kernels.gram_statistics(keys, values, scores, None, False, "fp64")
    with pytest.raises(RuntimeError, match="no gradient for keys"):
        gram.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("rows", [1, 77, 130])
def test_residual_matches_float64(device, dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(60, rows, generator=g).T.to(device, dtype)  # non-contiguous rows
    m = (0.1 * torch.randn(60, 60, generator=g)).to(device, dtype)
    out = residual_kernels.residual_project(x, m)
    assert out.dtype == dtype and out.shape == x.shape
    expected = residual_kernels.naive_residual_project(x, m)
    atol, rtol = ELEMENTWISE[dtype]
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)


def test_residual_mixed_dtypes_follow_the_torch_reference():
    from faast.ops import reference

    x = torch.randn(33, 60).bfloat16().to(DEVICE)
    m = (0.1 * torch.randn(60, 60)).to(DEVICE)  # float32 M with bf16 activations: float32 arithmetic, as addmm
    out = residual_kernels.residual_project(x, m)
    torch.testing.assert_close(out.double(), reference.residual_project(x, m).double(), atol=0, rtol=0.01)


def test_custom_ops_pass_opcheck():
    keys, values, scores, mask = _rows(2, 21, 9, 5, torch.float32, DEVICE)
    for args in [(keys, values, scores, mask, False, "fp64"), (keys, values, None, None, True, "tf32x3")]:
        torch.library.opcheck(torch.ops.faast_kernels.gram_statistics.default, args)
    x, m = torch.randn(13, 9, device=DEVICE), torch.randn(9, 9, device=DEVICE)
    torch.library.opcheck(torch.ops.faast_kernels.residual_project.default, (x, m))


def test_torch_compile_has_no_graph_breaks():
    class Layer(torch.nn.Module):
        def forward(self, keys, values, scores, x, m):
            gram, cross = torch.ops.faast_kernels.gram_statistics(keys, values, scores, None, False, "fp64")
            return torch.ops.faast_kernels.residual_project(x, m) * 2, gram.sum() + cross.sum()

    keys, values, scores, _ = _rows(1, 16, 8, 4, torch.float32, DEVICE)
    x, m = torch.randn(5, 8, device=DEVICE), torch.randn(8, 8, device=DEVICE)
    compiled = torch.compile(Layer(), fullgraph=True, backend="aot_eager")  # fullgraph: a graph break raises
    out, total = compiled(keys, values, scores, x, m)
    ref_out, ref_total = Layer()(keys, values, scores, x, m)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(total, ref_total)


@pytest.mark.gpu
def test_gram_on_gpu_matches_the_interpreter_oracle():
    keys, values, scores, mask = _rows(3, 777, 160, 96, torch.bfloat16, "cuda")
    for precision, tol in (("fp64", 1e-12), ("tf32x3", TRITON_FP32_MODE_REL)):
        gram, cross = gram_kernels.gram_accumulate(keys, values, scores, mask, precision=precision)
        ref_gram, ref_cross = gram_kernels.naive_gram(keys, values, scores, mask)
        assert rel(gram, ref_gram) <= tol and rel(cross, ref_cross) <= tol
