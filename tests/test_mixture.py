"""The probability-space mixture read: faast_kernels' fused kernel (Triton's interpreter here) and faast.ops' torch
composition against the float64 oracle from the definition, on odd shapes, 16-bit logits, per-row weights, full rows,
-inf logits and strided inputs; the op's dispatch and argument checks; and the GPU read path of faast/hf/mixture.py
(one op call per chunk) against the CPU block path it replaces there. Outputs allocated inside faast and faast_kernels
start as NaN under test (conftest), so an element the kernel never writes fails."""

from __future__ import annotations

import math

import pytest
import torch

from faast import ops
from faast.hf import mixture as hf_mixture
from faast.ops import _dispatch, _triton_backend
from faast.ops.mixture import mix_probabilities_torch
from read_cases import read_case
from tolerances import ELEMENTWISE

triton = pytest.importorskip("triton")
from faast_kernels import interpreting  # noqa: E402
from faast_kernels import mixture as kernels  # noqa: E402
from faast_kernels import ops as kernel_ops  # noqa: E402,F401 - registers torch.ops.faast_kernels

DEVICE = "cpu" if interpreting() else "cuda"


def _inputs(n, v, dtype=torch.float32, dz_dtype=torch.float32, *, strided=False, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    z = (3 * torch.randn(v, n, generator=g)).T if strided else 3 * torch.randn(n, v, generator=g)
    if n > 1 and v > 7:
        z[1, 7] = float("-inf")  # a masked vocabulary entry
    dz = torch.randn(n, v, generator=g)
    lam = torch.linspace(0.02, 0.95, n, dtype=torch.float64) if n else torch.zeros(0, dtype=torch.float64)
    full = torch.zeros(n, dtype=torch.bool)
    if n > 2:
        full[2] = True  # a row read with λ = 1
    odds = torch.where(full, 0.0, torch.log(lam / (1 - lam))).float()
    rest = torch.where(full, 0.0, torch.log1p(-lam)).float()
    return z.to(device, dtype), dz.to(device, dz_dtype), odds.to(device), rest.to(device), full.to(device)


def _assert_matches_oracle(out, z, dz, odds, rest, full, scale):
    expected = kernels.naive_mixture_logits(z, dz, odds, rest, full, scale)
    assert out.dtype == z.dtype and out.shape == z.shape
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(out), finite)  # -inf logits stay -inf, and nothing else is non-finite
    assert bool((out[~finite] == expected[~finite]).all())
    atol, rtol = ELEMENTWISE[z.dtype]
    torch.testing.assert_close(out.double()[finite], expected[finite], atol=atol, rtol=rtol)


SHAPES = [(5, 300), (1, 1), (3, 63), (4, 64), (7, 65), (2, 129)]  # V below, at and past the interpreter's block


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "n{}-V{}".format(*s))
@pytest.mark.parametrize("scale", [1.0, 1.7])
def test_the_kernel_matches_the_float64_oracle(shape, scale):
    z, dz, odds, rest, full = _inputs(*shape)
    _assert_matches_oracle(kernels.mixture_logits(z, dz, odds, rest, full, scale), z, dz, odds, rest, full, scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernel_reads_16_bit_logits_and_products_and_writes_their_dtype(dtype):
    z, dz, odds, rest, full = _inputs(6, 200, dtype, dtype)
    _assert_matches_oracle(kernels.mixture_logits(z, dz, odds, rest, full, 1.0), z, dz, odds, rest, full, 1.0)


def test_the_kernel_follows_strides():
    z, dz, odds, rest, full = _inputs(5, 130, strided=True)
    assert not z.is_contiguous()
    _assert_matches_oracle(kernels.mixture_logits(z, dz, odds, rest, full, 1.3), z, dz, odds, rest, full, 1.3)


def test_the_kernel_with_every_row_full_is_the_corrected_log_softmax():
    z, dz, odds, rest, _ = _inputs(4, 90)
    full = torch.ones(4, dtype=torch.bool, device=DEVICE)
    out = kernels.mixture_logits(z, dz, odds, rest, full, 1.0)
    torch.testing.assert_close(out.double(), torch.log_softmax(z.double() + dz.double(), -1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(0, 50), (3, 0)])
def test_the_kernel_accepts_empty_inputs(shape):
    z, dz, odds, rest, full = _inputs(*shape)
    assert kernels.mixture_logits(z, dz, odds, rest, full).shape == shape


def test_the_kernel_refuses_mismatched_arguments_naming_them():
    z, dz, odds, rest, full = _inputs(3, 40)
    with pytest.raises(ValueError, match=r"dz: expected a floating tensor \[3, 40\]"):
        kernels.mixture_logits(z, dz[:, :39], odds, rest, full)
    with pytest.raises(ValueError, match="full: expected a torch.bool tensor"):
        kernels.mixture_logits(z, dz, odds, rest, full.float())
    with pytest.raises(ValueError, match="log_odds: expected a torch.float32 tensor"):
        kernels.mixture_logits(z, dz, odds[:2], rest, full)


def test_the_custom_op_passes_opcheck():
    z, dz, odds, rest, full = _inputs(3, 70)
    torch.library.opcheck(torch.ops.faast_kernels.mixture_logits.default, (z, dz, odds, rest, full, 1.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("scale", [1.0, 0.8])
def test_the_torch_backend_matches_the_float64_oracle(dtype, scale):
    z, dz, odds, rest, full = _inputs(5, 150, dtype)
    out = mix_probabilities_torch(z, dz, odds, rest, full, scale)
    _assert_matches_oracle(out, z, dz, odds, rest, full, scale)


def test_the_torch_backend_without_full_rows_equals_all_false():
    z, dz, odds, rest, _ = _inputs(4, 80)
    none = mix_probabilities_torch(z, dz, odds, rest, None, 1.0)
    assert torch.equal(none, mix_probabilities_torch(z, dz, odds, rest, torch.zeros(4, dtype=torch.bool), 1.0))


def _spy(monkeypatch):
    calls = []
    real = kernels.mixture_logits

    def spy(*args):  # noqa: ANN002, ANN202
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(kernels, "mixture_logits", spy)
    return calls


def test_auto_keeps_the_torch_composition_on_the_cpu(monkeypatch):
    monkeypatch.delenv("FAAST_BACKEND", raising=False)
    calls = _spy(monkeypatch)
    z, dz, odds, rest, full = _inputs(5, 60, device="cpu")
    out = ops.mix_probabilities(z, dz, odds, rest, full)
    assert calls == []
    assert torch.equal(out, mix_probabilities_torch(z, dz, odds, rest, full, 1.0))


def test_a_request_for_triton_runs_the_kernel(monkeypatch):
    monkeypatch.setenv("FAAST_BACKEND", "mix_probabilities=triton")
    calls = _spy(monkeypatch)
    z, dz, odds, rest, full = _inputs(5, 60)
    out = ops.mix_probabilities(z, dz, odds, rest, None, 1.2)
    assert calls == [(5, 60)]
    _assert_matches_oracle(out, z, dz, odds, rest, torch.zeros_like(full), 1.2)


def test_auto_does_not_offer_the_kernel_float64_logits_on_a_gpu():
    bf16 = _dispatch.Call("mix_probabilities", torch.device("cuda"), (torch.bfloat16, torch.bfloat16))
    f64 = _dispatch.Call("mix_probabilities", torch.device("cuda"), (torch.float64, torch.float64))
    assert _triton_backend.gate("mix_probabilities", bf16) is None
    assert "float64" in _triton_backend.gate("mix_probabilities", f64)
    cpu = _dispatch.Call("mix_probabilities", torch.device("cpu"), (torch.float32, torch.float32))
    assert "interpreter" in _triton_backend.gate("mix_probabilities", cpu)


def test_the_op_refuses_bad_arguments_naming_them():
    z, dz, odds, rest, full = _inputs(3, 40)
    cases = [
        ((z[0], dz, odds, rest), ValueError, r"z: expected a tensor of shape \[n, V\]"),
        ((z, dz[:2], odds, rest), ValueError, "dz: expected shape"),
        ((z, dz, odds.half(), rest), TypeError, "log_odds: expected dtype in"),
        ((z, dz, odds, rest[:2]), ValueError, "log_rest: expected shape"),
        ((z, dz, odds, rest, full.int()), TypeError, "full: expected dtype in"),
        ((z, dz, odds, rest, full, 0.0), ValueError, "scale: expected a finite number > 0"),
        ((z, dz, odds, rest, full, math.inf), ValueError, "scale: expected a finite number > 0"),
        ((z, dz, odds, rest, full, True), ValueError, "scale: expected a finite number > 0"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            ops.mix_probabilities(*args)


@pytest.mark.parametrize("backend", ["auto", "mix_probabilities=triton"])
@pytest.mark.parametrize("weights", ["one", "full", "per-row"])
@pytest.mark.parametrize("chunk", [4, 16])  # three chunks, the last ragged; one chunk, whose mixture is the result
def test_the_gpu_read_path_equals_the_cpu_block_path(monkeypatch, backend, weights, chunk):
    # hf/mixture.py sends a GPU's rows through ops.mix_probabilities a chunk at a time; called directly here, on the
    # CPU, it must give what the CPU's cache-sized blocks give (the same arithmetic, in another order of blocks).
    monkeypatch.setenv("FAAST_BACKEND", backend)
    projected, logits, weight, options = read_case(weights, n=11, d=8, v=97, seed=3)
    keep = options["keep"]
    options["chunk"] = chunk
    cpu = hf_mixture.read_blocks(projected, logits, weight, compute=torch.float32, block=3, **options)
    on = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in options.items()}
    gpu = hf_mixture._read_chunks(projected.to(DEVICE), logits.to(DEVICE), weight.to(DEVICE), **on)
    assert gpu.dtype == logits.dtype
    torch.testing.assert_close(gpu.cpu(), cpu, atol=2e-5, rtol=2e-5)
    if keep is not None:
        assert torch.equal(gpu.cpu()[keep], logits[keep])


def test_the_gpu_read_path_of_no_rows_is_an_empty_result():
    projected, logits, weight = torch.zeros(0, 8), torch.zeros(0, 97, dtype=torch.bfloat16), torch.zeros(97, 8)
    options = {"scale": 1.0, "log_odds": 0.0, "log_rest": -0.5, "full": False, "keep": None}
    for chunk in (4, 16):
        out = hf_mixture._read_chunks(projected, logits, weight, chunk=chunk, **options)
        assert out.shape == (0, 97) and out.dtype == torch.bfloat16
