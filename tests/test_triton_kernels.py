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

from tolerances import ELEMENTWISE, TRITON_EXACT16_SCORED_REL, TRITON_FP32_MODE_REL, assert_close, rel  # noqa: E402

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
    (2, 9, 6, 0),  # no values: the Gram is still KᵀK
]


def _assert_statistics(got, ref, tol):
    for name, a, b in zip(("gram", "cross", "sqnorm"), got, ref, strict=True):
        assert a.dtype == torch.float64, name
        assert rel(a, b) <= tol, (name, rel(a, b))
    assert torch.equal(got[0], got[0].mT)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "L{}-N{}-dk{}-dv{}".format(*s))
@pytest.mark.parametrize("options", ["plain", "scores", "mask", "scores+mask", "wls"])
def test_gram_fp64_matches_float64(device, shape, options):
    keys, values, scores, mask = _rows(*shape, torch.float32, device, contiguous=shape[0] != 2)
    s = scores if "scores" in options or options == "wls" else None
    m = mask if "mask" in options else None
    got = gram_kernels.gram_accumulate(keys, values, s, m, weighted_least_squares=options == "wls")
    ref = gram_kernels.naive_gram(keys, values, s, m, weighted_least_squares=options == "wls")
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert torch.equal(got[0], got[0].mT)


@pytest.mark.parametrize("precision", ["tf32x3", "fp32", "exact16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("options", ["scores+mask", "wls"])
def test_gram_float32_modes(precision, dtype, options):
    if precision == "exact16" and dtype == torch.float32:
        pytest.skip("exact16 takes 16-bit inputs (the launcher's error is tested below)")
    keys, values, scores, mask = _rows(3, 77, 60, 33, dtype, DEVICE, contiguous=False)
    wls = options == "wls"
    m = None if wls else mask
    # flush_rows=16 runs several float32 chunks per program, each added into the float64 tile.
    got = gram_kernels.gram_accumulate(keys, values, scores, m, precision=precision, flush_rows=16,
                                       weighted_least_squares=wls)  # fmt: skip
    ref = gram_kernels.naive_gram(keys, values, scores, m, weighted_least_squares=wls)
    # exact16 splits the score-weighted factors s·v into two 16-bit terms: ~16 significant bits of each.
    tol = TRITON_EXACT16_SCORED_REL if precision == "exact16" else TRITON_FP32_MODE_REL
    _assert_statistics(got, ref, tol)


def _largest_tile(precision: str) -> int:
    return max(config.kwargs["BM"] for config in gram_kernels._configs(precision))


@pytest.mark.parametrize("precision", ["tf32x3", "fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32-tf32-split", "bfloat16"])
@pytest.mark.parametrize("layout", ["new", "in-place", "two-splits"])
def test_gram_float32_modes_mirror_every_upper_tile(precision, dtype, layout):
    """dk = 2 tiles + 3 (odd): S has 3 x 3 tiles whatever tile the tuner picks; the kernel computes the 6 upper ones
    and stores each off-diagonal one transposed into the lower triangle. Float32 inputs take the TF32 split in
    tf32x3 (three TF32 dots per product), bfloat16 inputs one dot."""
    tile = _largest_tile(precision)
    dk = 2 * tile + 3
    keys, values, scores, mask = _rows(2, 41, dk, 5, dtype, DEVICE, contiguous=False, seed=dk)
    ref = gram_kernels.naive_gram(keys, values, scores, mask)
    accumulators, start = {}, (0.0, 0.0, 0.0)
    if layout == "in-place":
        # A symmetric S0 already in the accumulators: the mirrored tile must be S0 + the batch, not the batch alone.
        g = torch.Generator().manual_seed(1)
        s0 = torch.randn(2, dk, dk, generator=g, dtype=torch.float64)
        t0 = torch.randn(2, dk, 5, generator=g, dtype=torch.float64)
        start = (s0 + s0.mT, t0, torch.rand(2, generator=g, dtype=torch.float64))
        accumulators = dict(zip(("gram", "cross", "sqnorm"), (t.clone().to(DEVICE) for t in start), strict=True))
    # flush_rows=16: several float32 chunks per program; two splits: partial tiles that start as NaN under test.
    got = gram_kernels.gram_accumulate(keys, values, scores, mask, precision=precision, flush_rows=16,
                                       splits=2 if layout == "two-splits" else 1, **accumulators)  # fmt: skip
    expected = [r + s for r, s in zip(ref, start, strict=True)]
    _assert_statistics(got, expected, TRITON_FP32_MODE_REL)  # includes S == S^T bit for bit
    for i in range(3):
        for j in range(i):  # the lower tiles, written only by the mirror
            rows, cols = slice(i * tile, (i + 1) * tile), slice(j * tile, (j + 1) * tile)
            assert_close(got[0][:, rows, cols], expected[0][:, rows, cols], dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gram_exact16_without_scores_has_exact_products(dtype):
    keys, values, _, mask = _rows(2, 130, 33, 65, dtype, DEVICE)
    got = gram_kernels.gram_accumulate(keys, values, None, mask, precision="exact16", flush_rows=32)
    _assert_statistics(got, gram_kernels.naive_gram(keys, values, None, mask), TRITON_FP32_MODE_REL)


@pytest.mark.parametrize("splits", [2, 5])
def test_gram_split_over_rows_is_exact_and_bitwise_reproducible(splits):
    # N = 3 < 5 splits: some row ranges are empty and must still write zero partials (outputs start as NaN here).
    for n in (37, 3):
        keys, values, scores, mask = _rows(2, n, 40, 9, torch.float32, DEVICE)
        first = gram_kernels.gram_accumulate(keys, values, scores, mask, splits=splits)
        again = gram_kernels.gram_accumulate(keys, values, scores, mask, splits=splits)
        for a, b, r in zip(first, again, gram_kernels.naive_gram(keys, values, scores, mask), strict=True):
            assert torch.equal(a, b)  # bitwise, run to run
            torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)


def test_gram_plans_no_split_on_cpu_and_enough_programs_on_a_gpu(monkeypatch):
    assert gram_kernels.plan_splits(1 << 20, 64, 64, 1, torch.device("cpu")) == 1
    monkeypatch.setattr(gram_kernels, "_sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    # d = 256, dv = 64: 2·(3 + 2) = 10 programs of 128-wide tiles, far below two waves of 132 multiprocessors.
    assert gram_kernels.plan_splits(65536, 256, 64, 1, cuda) == min(gram_kernels.MAX_SPLITS, -(-264 // 5))
    assert gram_kernels.plan_splits(3000, 256, 64, 1, cuda) == 1  # too few rows to cut
    assert gram_kernels.plan_splits(65536, 1600, 1600, 48, cuda) == 1  # the tiles fill the GPU already


def test_gram_ignores_nan_in_masked_rows():
    keys, values, scores, mask = _rows(2, 50, 12, 5, torch.float32, DEVICE)
    mask[1, 7] = False
    keys[1, 7, 3] = float("nan")
    values[1, 7, 0] = float("inf")
    got = gram_kernels.gram_accumulate(keys, values, scores, mask)
    for a, b in zip(got, gram_kernels.naive_gram(keys, values, scores, mask), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("splits", [1, 3])
def test_gram_accumulates_in_place(splits):
    keys, values, scores, _ = _rows(2, 45, 20, 9, torch.float32, DEVICE)
    first = gram_kernels.gram_accumulate(keys[:, :20], values[:, :20], scores[:, :20])
    gram, cross, sqnorm = (t.clone() for t in first)
    out = gram_kernels.gram_accumulate(keys[:, 20:], values[:, 20:], scores[:, 20:], gram=gram, cross=cross,
                                       sqnorm=sqnorm, splits=splits)  # fmt: skip
    assert out[0] is gram and out[1] is cross and out[2] is sqnorm
    for a, b in zip(out, gram_kernels.naive_gram(keys, values, scores), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_gram_in_place_custom_op_mutates_its_accumulators():
    keys, values, scores, mask = _rows(2, 30, 12, 5, torch.float32, DEVICE)
    ref = gram_kernels.naive_gram(keys, values, scores, mask)
    acc = [torch.ones_like(r) for r in ref]
    torch.ops.faast_kernels.gram_accumulate_(keys, values, scores, mask, *acc, False, "fp64")
    for a, b in zip(acc, ref, strict=True):
        torch.testing.assert_close(a, b + 1, rtol=1e-12, atol=1e-12)
    args = (keys, values, scores, mask, *[torch.zeros_like(r) for r in ref], False, "fp64")
    torch.library.opcheck(torch.ops.faast_kernels.gram_accumulate_.default, args)


def test_gram_launcher_errors():
    keys, values, scores, _ = _rows(2, 10, 4, 3, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="precision: expected one of"):
        gram_kernels.gram_accumulate(keys, values, precision="fp16")
    with pytest.raises(ValueError, match=r"values: expected shape \[2, 10, dv\]"):
        gram_kernels.gram_accumulate(keys, values[:, :9])
    with pytest.raises(ValueError, match=r"scores: expected shape \[2, 10\]"):
        gram_kernels.gram_accumulate(keys, values, scores[:, :3])
    with pytest.raises(ValueError, match="gram, cross, sqnorm: pass all three"):
        gram_kernels.gram_accumulate(keys, values, gram=torch.zeros(2, 4, 4, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match="gram: expected a contiguous float64 tensor"):
        gram_kernels.gram_accumulate(
            keys, values, gram=torch.zeros(2, 4, 4, device=DEVICE), cross=torch.zeros(2, 4, 3, device=DEVICE),
            sqnorm=torch.zeros(2, device=DEVICE),
        )  # fmt: skip
    with pytest.raises(ValueError, match="keys: precision='exact16' needs bfloat16 or float16"):
        gram_kernels.gram_accumulate(keys, values, precision="exact16")
    with pytest.raises(ValueError, match="flush_rows: expected an int >= 1"):
        gram_kernels.gram_accumulate(keys, values, flush_rows=0)
    with pytest.raises(ValueError, match="splits: expected an int >= 1"):
        gram_kernels.gram_accumulate(keys, values, splits=0)


@pytest.mark.parametrize("wls", [False, True], ids=["values-weighted", "wls"])
def test_gram_gradients_match_the_reference(wls):
    keys, values, scores, mask = _rows(2, 37, 20, 7, torch.float32, DEVICE)
    values = values.double().requires_grad_()
    scores = scores.double().requires_grad_()
    got = torch.ops.faast_kernels.gram_statistics(keys, values, scores, mask, wls, "fp64")
    ref = gram_kernels.naive_gram(keys, values, scores, mask, weighted_least_squares=wls)
    weights = [torch.randn_like(t) for t in got]

    def loss(stats):  # noqa: ANN001, ANN202
        return sum((t * w).sum() for t, w in zip(stats, weights, strict=True))

    grads = torch.autograd.grad(loss(got), (values, scores))
    expected = torch.autograd.grad(loss(ref), (values, scores))
    for a, b in zip(grads, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_gram_has_no_key_gradient():
    keys, values, scores, _ = _rows(1, 8, 4, 3, torch.float32, DEVICE)
    keys.requires_grad_()
    gram, _, _ = torch.ops.faast_kernels.gram_statistics(keys, values, scores, None, False, "fp64")
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
    for args in [(keys, values, scores, mask, False, "fp64"), (keys, values, None, None, True, "tf32x3"),
                 (keys.bfloat16(), values.bfloat16(), scores, mask, False, "exact16")]:  # fmt: skip
        torch.library.opcheck(torch.ops.faast_kernels.gram_statistics.default, args)
    x, m = torch.randn(13, 9, device=DEVICE), torch.randn(9, 9, device=DEVICE)
    torch.library.opcheck(torch.ops.faast_kernels.residual_project.default, (x, m))


def test_torch_compile_has_no_graph_breaks():
    class Layer(torch.nn.Module):
        def forward(self, keys, values, scores, x, m):
            gram, cross, sq = torch.ops.faast_kernels.gram_statistics(keys, values, scores, None, False, "fp64")
            return torch.ops.faast_kernels.residual_project(x, m) * 2, gram.sum() + cross.sum() + sq.sum()

    keys, values, scores, _ = _rows(1, 16, 8, 4, torch.float32, DEVICE)
    x, m = torch.randn(5, 8, device=DEVICE), torch.randn(8, 8, device=DEVICE)
    compiled = torch.compile(Layer(), fullgraph=True, backend="aot_eager")  # fullgraph: a graph break raises
    out, total = compiled(keys, values, scores, x, m)
    ref_out, ref_total = Layer()(keys, values, scores, x, m)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(total, ref_total)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["exact16", "tf32x3", "fp32", "fp64"])
def test_gram_on_gpu_matches_the_float64_oracle_and_is_reproducible(precision):
    keys, values, scores, mask = _rows(3, 5000, 160, 96, torch.bfloat16, "cuda")
    tol = {"fp64": 1e-12, "exact16": TRITON_EXACT16_SCORED_REL}.get(precision, TRITON_FP32_MODE_REL)
    for splits in (1, 3):
        got = gram_kernels.gram_accumulate(keys, values, scores, mask, precision=precision, splits=splits)
        _assert_statistics(got, gram_kernels.naive_gram(keys, values, scores, mask), tol)
        again = gram_kernels.gram_accumulate(keys, values, scores, mask, precision=precision, splits=splits)
        assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True))


@pytest.mark.gpu
def test_gram_autotuned_configurations_agree_bitwise(monkeypatch):
    """Tiles, warps and stages must not change the numbers (the tuner's choice may differ between processes)."""
    import triton

    keys, values, scores, _ = _rows(1, 4096, 256, 64, torch.bfloat16, "cuda")
    results = []
    monkeypatch.setenv("FAAST_TRITON_AUTOTUNE", "1")
    configs = gram_kernels._configs("exact16")
    assert len(configs) > 1
    for config in configs:
        tuner = triton.autotune(configs=[config], key=["DK"])(gram_kernels._gram_kernel)
        monkeypatch.setattr(gram_kernels, "_tuned", lambda precision, t=tuner: t)
        results.append(gram_kernels.gram_accumulate(keys, values, scores, precision="exact16", splits=1))
    first = results[0]
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(first, other, strict=True))
