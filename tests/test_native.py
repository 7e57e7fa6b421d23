"""The optional native extension faast._C (csrc/): loading, fallback and the op's schema + fake implementation on
the CPU; its numerics on a GPU (marked gpu, skipped without one). The CUDA sources are compile-checked by
scripts/check_cuda_sources.sh in CI."""

from __future__ import annotations

import logging

import pytest
import torch

from faast.ops import _cuda_backend, _dispatch
from tolerances import rel

CUDA = torch.device("cuda")


@pytest.fixture
def fresh_state(monkeypatch):
    monkeypatch.setattr(_cuda_backend, "_state", {})
    monkeypatch.setattr(_dispatch, "_logged", set())
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)


def _not_built(monkeypatch):
    def fail():
        raise ModuleNotFoundError("No module named 'faast._C'")

    monkeypatch.setattr(_cuda_backend, "_import_extension", fail)


def test_a_missing_extension_is_reported_and_auto_falls_back_with_one_log_line(fresh_state, monkeypatch, caplog):
    _not_built(monkeypatch)
    assert "faast._C is not built" in _cuda_backend.load_error()
    assert [name for name, _ in _dispatch.explain("eigh", CUDA)][0] == "cuda"
    with caplog.at_level(logging.INFO, logger="faast"):
        for _ in range(3):
            name, _ = _dispatch.resolve("eigh", CUDA)
    assert name == "torch"
    lines = [r.getMessage() for r in caplog.records if "skips the cuda backend" in r.getMessage()]
    assert len(lines) == 1 and "faast._C is not built" in lines[0]


def test_an_explicit_request_raises_with_the_load_error(fresh_state, monkeypatch):
    _not_built(monkeypatch)
    monkeypatch.setenv("FAAST_BACKEND", "cuda")
    with pytest.raises(
        RuntimeError, match="FAAST_BACKEND=cuda was requested for eigh on cuda, but faast._C is not built"
    ):
        _dispatch.resolve("eigh", CUDA)
    with pytest.raises(RuntimeError, match="does not run on cpu"):
        _dispatch.resolve("eigh", torch.device("cpu"))


def test_a_broken_extension_reports_its_error_and_does_not_break_faast(fresh_state, monkeypatch):
    def broken():
        raise OSError("libcusolver.so.12: cannot open shared object file")

    monkeypatch.setattr(_cuda_backend, "_import_extension", broken)
    error = _cuda_backend.load_error()
    assert error.startswith("faast._C failed to load: OSError: libcusolver.so.12")
    from faast import env

    assert env.report()["native_extension"] == error


@pytest.fixture
def schema_only_library():
    """The op's schema as csrc/faast_ops.cpp defines it, with a CPU kernel for testing, when faast._C is absent."""
    if _cuda_backend.load_error() is None:
        pytest.skip("faast._C is loaded here; its own schema is tested on the GPU")
    lib = torch.library.Library("faast", "DEF")
    lib.define('batched_eigh(Tensor gram, str algorithm="auto") -> (Tensor, Tensor)')
    lib.impl("batched_eigh", lambda gram, algorithm="auto": torch.linalg.eigh(gram), "CPU")
    _cuda_backend._register_fake()
    yield
    lib._destroy()


def test_the_fake_implementation_matches_the_op(schema_only_library):
    from torch._subclasses.fake_tensor import FakeTensorMode

    gram = torch.randn(3, 5, 5, dtype=torch.float64)
    gram = gram @ gram.mT
    with FakeTensorMode() as mode:
        lam, vecs = torch.ops.faast.batched_eigh(mode.from_tensor(gram))
    assert lam.shape == (3, 5) and vecs.shape == (3, 5, 5) and lam.dtype == torch.float64
    torch.library.opcheck(torch.ops.faast.batched_eigh, (gram,), test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------------------------------------------- on a GPU


def _spectra(layers: int, d: int, kind: str) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(d + layers)
    q, _ = torch.linalg.qr(torch.randn(layers, d, d, generator=g, dtype=torch.float64))
    if kind == "power":
        lam = torch.logspace(0, -12, d, dtype=torch.float64).expand(layers, d)
    elif kind == "rank_deficient":
        lam = torch.cat(
            [
                torch.rand(layers, d // 3, generator=g, dtype=torch.float64) + 1,
                torch.zeros(layers, d - d // 3, dtype=torch.float64),
            ],
            -1,
        )
    else:  # degenerate: repeated eigenvalues
        lam = torch.ones(layers, d, dtype=torch.float64)
        lam[:, : d // 2] = 3.0
    return (q * lam.unsqueeze(-2)) @ q.mT


@pytest.mark.gpu
@pytest.mark.parametrize("layers,d", [(1, 64), (16, 64), (48, 64), (16, 768), (48, 1600), (4, 3584), (3, 20)])
@pytest.mark.parametrize("kind", ["power", "rank_deficient", "degenerate"])
def test_batched_eigh_on_the_gpu_satisfies_the_eigen_equations(layers, d, kind):
    if not torch.cuda.is_available() or _cuda_backend.load_error() is not None:
        pytest.skip("needs a GPU and the built extension faast._C")
    gram = _spectra(layers, d, kind).cuda()
    lam, vecs = torch.ops.faast.batched_eigh(gram)
    scale = gram.norm(dim=(-2, -1)).max()
    residual = (gram @ vecs - vecs * lam.unsqueeze(-2)).norm() / scale
    eye = torch.eye(d, dtype=torch.float64, device="cuda")
    assert float(residual) < 1e-10 * d
    assert float((vecs.mT @ vecs - eye).norm()) < 1e-10 * d
    assert bool((lam[:, 1:] >= lam[:, :-1]).all())
    expected, _ = torch.linalg.eigh(gram)
    assert rel(lam, expected) < 1e-12


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ["auto", "syevj_batched", "syev_batched", "syevd_streams"])
@pytest.mark.parametrize("layers,d", [(5, 24), (3, 200)])
def test_every_algorithm_matches_torch(algorithm, layers, d):
    if not torch.cuda.is_available() or _cuda_backend.load_error() is not None:
        pytest.skip("needs a GPU and the built extension faast._C")
    gram = _spectra(layers, d, "power").cuda()
    if algorithm == "syevj_batched" and d > 32:
        with pytest.raises(RuntimeError, match="syevj_batched supports d <= 32"):
            torch.ops.faast.batched_eigh(gram, algorithm)
        return
    lam, vecs = torch.ops.faast.batched_eigh(gram, algorithm)
    residual = (gram @ vecs - vecs * lam.unsqueeze(-2)).norm() / gram.norm(dim=(-2, -1)).max()
    assert float(residual) < 1e-10 * d
    expected, _ = torch.linalg.eigh(gram)
    assert rel(lam, expected) < 1e-12


@pytest.mark.gpu
def test_float32_is_rejected_by_the_op_and_upcast_by_the_backend():
    if not torch.cuda.is_available() or _cuda_backend.load_error() is not None:
        pytest.skip("needs a GPU and the built extension faast._C")
    gram = _spectra(2, 40, "power").cuda()
    with pytest.raises(RuntimeError, match="gram must be float64"):
        torch.ops.faast.batched_eigh(gram.float())
    lam, vecs = _cuda_backend.eigh(gram.float())
    assert lam.dtype == vecs.dtype == torch.float64


@pytest.mark.gpu
def test_a_failing_layer_is_named():
    if not torch.cuda.is_available() or _cuda_backend.load_error() is not None:
        pytest.skip("needs a GPU and the built extension faast._C")
    gram = _spectra(4, 40, "power").cuda()
    gram[2, 3, 1] = float("nan")
    with pytest.raises(RuntimeError, match="layer 2"):
        torch.ops.faast.batched_eigh(gram)
