"""The cupy backend (faast/ops/_cupy_backend.py) on the CPU: why it is unavailable, its place in the dispatch, and its
glue around cuSOLVER's syevjBatched, run against a fake cupy whose solver works on the same memory through numpy.

The fake receives raw pointers, as cuSOLVER does, and finds the arrays only through what the backend exported by
DLPack: a copy anywhere in the plumbing leaves the result unwritten (NaN-poisoned) and the tests fail. Its numerics on
a GPU are measured by lab/benchmarks/bench_eigh.py.
"""

from __future__ import annotations

import logging
import sys
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest
import torch

from faast.ops import _cupy_backend, _dispatch
from tolerances import assert_close, rel

CUDA = torch.device("cuda")
STREAM = 0x5EED  # the "torch current stream" the tests pretend to run on
LOWER, UPPER = 0, 1  # cublasFillMode_t
NOVECTOR, VECTOR = 0, 1  # cusolverEigMode_t


class FakeCupy:
    """cupy, cupy_backends.cuda.libs.{cusolver, cublas}: the parts the backend uses, solving with numpy on the CPU."""

    def __init__(self, runtime: int = 13000, *, missing: tuple[str, ...] = ()) -> None:
        self.exported: dict[int, np.ndarray] = {}  # pointer -> array, filled by from_dlpack only
        self.params: dict[int, dict] = {}
        self.destroyed: list[int] = []
        self.stream: int | None = None
        self.calls: list[dict] = []
        self.descending = False  # return eigenpairs in descending order
        self.garbage: set[int] = set()  # batch elements whose eigenvalues come back wrong, with info = 0
        self.unconverged: set[int] = set()  # batch elements reported as not converged (info = n + 1)
        self.bad_parameter = False
        cupy = ModuleType("cupy")
        cupy.__version__ = "14.2.0.fake"
        cupy.from_dlpack = self.from_dlpack
        device_module = SimpleNamespace(get_cusolver_handle=lambda: 77)
        stream_class = SimpleNamespace(from_external=self.from_external)
        cupy.cuda = SimpleNamespace(
            Device=lambda index: _Context(lambda: None, lambda: None),
            device=device_module,
            Stream=stream_class,
            runtime=SimpleNamespace(runtimeGetVersion=lambda: runtime),
        )
        cusolver = ModuleType("cupy_backends.cuda.libs.cusolver")
        cusolver.CUSOLVER_EIG_MODE_VECTOR, cusolver.CUSOLVER_EIG_MODE_NOVECTOR = VECTOR, NOVECTOR
        functions = {
            "createSyevjInfo": self.create_info,
            "destroySyevjInfo": self.destroyed.append,
            "xsyevjSetTolerance": lambda p, tol: self.params[p].update(tol=tol),
            "xsyevjSetMaxSweeps": lambda p, sweeps: self.params[p].update(sweeps=sweeps),
            "xsyevjSetSortEig": lambda p, sort: self.params[p].update(sort=sort),
            "dsyevjBatched_bufferSize": self.buffer_size,
            "dsyevjBatched": self.syevj_batched,
        }
        for name, fn in functions.items():
            if name not in missing:
                setattr(cusolver, name, fn)
        cublas = ModuleType("cupy_backends.cuda.libs.cublas")
        cublas.CUBLAS_FILL_MODE_LOWER, cublas.CUBLAS_FILL_MODE_UPPER = LOWER, UPPER
        libs = ModuleType("cupy_backends.cuda.libs")
        libs.cusolver, libs.cublas = cusolver, cublas
        self.modules = {
            "cupy": cupy,
            "cupy_backends": ModuleType("cupy_backends"),
            "cupy_backends.cuda": ModuleType("cupy_backends.cuda"),
            "cupy_backends.cuda.libs": libs,
            "cupy_backends.cuda.libs.cusolver": cusolver,
            "cupy_backends.cuda.libs.cublas": cublas,
        }

    def install(self, monkeypatch) -> FakeCupy:
        for name, module in self.modules.items():
            monkeypatch.setitem(sys.modules, name, module)
        return self

    def from_dlpack(self, tensor: torch.Tensor) -> SimpleNamespace:
        array = np.from_dlpack(tensor)
        self.exported[array.ctypes.data] = array
        return SimpleNamespace(data=SimpleNamespace(ptr=array.ctypes.data))

    def from_external(self, obj: object) -> _Context:
        version, pointer = obj.__cuda_stream__()
        assert version == 0

        def enter() -> None:
            self.stream = pointer

        def leave() -> None:
            self.stream = None

        return _Context(enter, leave)

    def create_info(self) -> int:
        handle = 1000 + len(self.params)
        self.params[handle] = {}
        return handle

    def buffer_size(self, handle, jobz, uplo, n, a, lda, w, params, batch) -> int:  # noqa: ANN001
        assert self.stream == STREAM and a in self.exported and w in self.exported
        return 3

    def syevj_batched(self, handle, jobz, uplo, n, a, lda, w, work, lwork, info, params, batch) -> None:  # noqa: ANN001
        assert self.stream == STREAM, "the solver must run on torch's current stream"
        assert handle == 77 and jobz == VECTOR and lda == n and params in self.params and params not in self.destroyed
        matrices, values, flags = self.exported[a], self.exported[w], self.exported[info]
        assert self.exported[work].size >= lwork >= 3
        assert matrices.shape == (batch, n, n) and matrices.dtype == np.float64 and values.shape == (batch, n)
        self.calls.append({"uplo": uplo, **self.params[params]})
        for b in range(batch):
            column_major = matrices[b].T  # what cuSOLVER reads at this address
            tri = np.tril if uplo == LOWER else np.triu
            sym = tri(column_major) + tri(column_major, -1 if uplo == LOWER else 1).T
            lam, vecs = np.linalg.eigh(sym)
            if self.descending:
                lam, vecs = lam[::-1], vecs[:, ::-1]
            if b in self.garbage:
                lam = lam * (1 + 1e-6)
            matrices[b] = vecs.T  # column-major eigenvectors, in place
            values[b] = lam
            flags[b] = n + 1 if b in self.unconverged else 0
        if self.bad_parameter:
            flags[0] = -4


class _Context:
    def __init__(self, enter, leave) -> None:  # noqa: ANN001
        self._enter, self._leave = enter, leave

    def __enter__(self) -> _Context:
        self._enter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._leave()


@pytest.fixture
def fresh(monkeypatch):
    """A fresh backend state (the reason is worked out once per process otherwise), a CUDA 13 torch with a GPU."""
    monkeypatch.setattr(_cupy_backend, "_state", {})
    monkeypatch.setattr(_cupy_backend, "_stream_pointer", lambda device: STREAM)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_dispatch, "_logged", set())
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)


@pytest.fixture
def fake(fresh, monkeypatch) -> FakeCupy:
    return FakeCupy().install(monkeypatch)


def _grams(batch: int = 4, d: int = 12, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, 3 * d, d, generator=g, dtype=torch.float64)
    return keys.mT @ keys


def _solved_without_fallback(gram: torch.Tensor, caplog) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """The backend's result, asserting that it came from the (fake) solver and not from the torch recomputation."""
    with caplog.at_level(logging.INFO, logger="faast"):
        lam, vecs = _cupy_backend.eigh(gram)
    assert not [r for r in caplog.records if "cupy eigh" in r.getMessage()]
    return lam, vecs


def _check_decomposition(gram: torch.Tensor, lam: torch.Tensor, vecs: torch.Tensor) -> None:
    """The accuracy contract against torch.linalg.eigh (float64): eigenvalues, residual, orthonormality."""
    sym = gram.tril() + gram.tril(-1).mT
    ref = torch.linalg.eigvalsh(sym)
    assert lam.dtype == vecs.dtype == torch.float64
    assert lam.shape == gram.shape[:-1] and vecs.shape == gram.shape
    assert rel(lam, ref) <= 1e-12
    assert rel(sym @ vecs, vecs * lam.unsqueeze(-2)) <= 1e-12
    assert_close(vecs.mT @ vecs, torch.eye(gram.shape[-1], dtype=torch.float64).expand_as(vecs), torch.float64)


# ------------------------------------------------------------------------------------------- why it cannot run


def test_without_cupy_the_reason_says_so_and_is_worked_out_once(fresh, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    reason = _cupy_backend.unavailable_reason()
    assert reason.startswith("cupy is not importable") and "pip install cupy-cuda" in reason
    FakeCupy().install(monkeypatch)  # importable now, but the answer was remembered
    assert _cupy_backend.unavailable_reason() == reason


def test_a_cupy_built_for_another_cuda_major_version_is_unavailable(fresh, monkeypatch):
    FakeCupy(runtime=12080).install(monkeypatch)
    reason = _cupy_backend.unavailable_reason()
    assert "built for CUDA 12.8 but torch for CUDA 13.0" in reason


def test_without_a_gpu_or_a_cuda_torch_it_is_unavailable(fresh, monkeypatch):
    FakeCupy().install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _cupy_backend.unavailable_reason() == "no CUDA device is visible to torch"
    monkeypatch.setattr(_cupy_backend, "_state", {})
    monkeypatch.setattr(torch.version, "cuda", None)
    assert "is not a CUDA build" in _cupy_backend.unavailable_reason()


def test_a_cupy_without_the_batched_solver_bindings_is_unavailable(fresh, monkeypatch):
    FakeCupy(missing=("dsyevjBatched",)).install(monkeypatch)
    assert "lacks the cuSOLVER bindings ['dsyevjBatched']" in _cupy_backend.unavailable_reason()


def test_a_matching_cupy_with_a_gpu_is_available(fake):
    assert _cupy_backend.unavailable_reason() is None


# ------------------------------------------------------------------------------------------------- the dispatch


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setattr(_dispatch, "_REGISTRY", {"torch": _dispatch._REGISTRY["torch"]})
    _cupy_backend.register()
    return _dispatch._REGISTRY


def test_without_cupy_an_explicit_request_raises_and_auto_falls_back_with_one_log_line(
    fresh, registry, monkeypatch, caplog
):
    monkeypatch.setitem(sys.modules, "cupy", None)
    with caplog.at_level(logging.INFO, logger="faast"):
        for _ in range(3):
            name, impl = _dispatch.resolve("eigh", CUDA)
    assert (name, impl) == ("torch", registry["torch"].ops["eigh"])
    lines = [r.getMessage() for r in caplog.records if "skips the cupy backend" in r.getMessage()]
    assert len(lines) == 1 and "cupy is not importable" in lines[0]
    monkeypatch.setenv(_dispatch.ENV_VAR, "eigh=cupy")
    with pytest.raises(RuntimeError, match=r"FAAST_BACKEND=cupy was requested for eigh on cuda, but cupy is not"):
        _dispatch.resolve("eigh", CUDA)


def test_an_available_cupy_serves_explicit_requests_on_cuda_tensors_only(fake, registry, monkeypatch):
    monkeypatch.setenv(_dispatch.ENV_VAR, "cupy")
    assert _dispatch.resolve("eigh", CUDA) == ("cupy", _cupy_backend.eigh)
    with pytest.raises(RuntimeError, match="does not run on cpu"):
        _dispatch.resolve("eigh", torch.device("cpu"))


@pytest.mark.parametrize(("d", "declined"), [(64, False), (256, False), (575, False), (576, True), (1600, True)])
def test_auto_is_kept_away_from_the_widths_where_cupy_was_measured_slower(fake, registry, d, declined):
    call = _dispatch.Call("eigh", CUDA, (torch.float64,), ((48, d, d),))
    why = dict(_dispatch.explain("eigh", CUDA, call))["cupy"]
    assert (why is not None) == declined
    if declined:
        assert f"d = {d}" in why and "FAAST_BACKEND=cupy" in why


# ------------------------------------------------------------------------------------------ the solver's glue


def test_eigh_matches_torch_through_one_batched_call_on_torchs_stream(fake, caplog):
    gram = _grams(batch=5, d=12)
    garbage = gram + torch.randn(5, 12, 12, dtype=torch.float64).triu(1)  # only the lower triangle is read
    before = garbage.clone()
    lam, vecs = _solved_without_fallback(garbage, caplog)
    _check_decomposition(garbage, lam, vecs)
    assert torch.equal(garbage, before)  # the solver overwrote a private copy
    (call,) = fake.calls
    assert call == {"uplo": UPPER, "tol": 2.0**-52, "sweeps": 100, "sort": 1}
    assert fake.destroyed == list(fake.params)  # the syevj parameters are freed
    assert vecs.mT.is_contiguous()  # column-major eigenvectors, like torch.linalg.eigh


def test_float32_statistics_are_solved_in_float64(fake, caplog):
    gram = _grams(batch=3, d=9)
    lam, vecs = _solved_without_fallback(gram.float(), caplog)
    _check_decomposition(gram.float().double(), lam, vecs)


def test_eigenvalues_come_back_ascending_even_if_the_solver_does_not_sort(fake, caplog):
    fake.descending = True
    gram = _grams(batch=3, d=10)
    lam, vecs = _solved_without_fallback(gram, caplog)
    assert bool((lam[:, 1:] >= lam[:, :-1]).all())
    _check_decomposition(gram, lam, vecs)


def test_results_missing_the_accuracy_contract_are_recomputed_and_said_once(fake, caplog):
    fake.garbage, fake.unconverged = {1}, {3}
    gram = _grams(batch=5, d=8)
    with caplog.at_level(logging.INFO, logger="faast"):
        for _ in range(2):
            lam, vecs = _cupy_backend.eigh(gram)
            _check_decomposition(gram, lam, vecs)
    lines = [r.getMessage() for r in caplog.records if "cupy eigh" in r.getMessage()]
    assert len(lines) == 1 and "2 of 5 matrices" in lines[0]


def test_a_rejected_parameter_raises(fake):
    fake.bad_parameter = True
    with pytest.raises(RuntimeError, match="rejected parameter 4"):
        _cupy_backend.eigh(_grams(batch=2, d=6))


@pytest.mark.parametrize(
    ("gram", "error", "match"),
    [
        (torch.zeros(4, 4, dtype=torch.float64), ValueError, r"gram: expected symmetric matrices \[B, d, d\]"),
        (torch.zeros(2, 4, 5, dtype=torch.float64), ValueError, r"got shape \[2, 4, 5\]"),
        (torch.zeros(2, 4, 4, dtype=torch.bfloat16), TypeError, "gram: expected float32 or float64"),
    ],
)
def test_bad_input_is_named(fake, gram, error, match):
    with pytest.raises(error, match=match):
        _cupy_backend.eigh(gram)
    assert fake.calls == []


def test_an_empty_batch_needs_no_solver(fake):
    lam, vecs = _cupy_backend.eigh(torch.zeros(0, 7, 7, dtype=torch.float64))
    assert lam.shape == (0, 7) and vecs.shape == (0, 7, 7) and fake.calls == []


# ------------------------------------------------------------------------------------ on a GPU, with the real cupy


def _needs_cupy() -> None:
    if not torch.cuda.is_available() or _cupy_backend.unavailable_reason() is not None:
        pytest.skip(f"needs a GPU and a matching cupy ({_cupy_backend.unavailable_reason()})")


def _spectrum(layers: int, d: int, kind: str) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(d)
    q, _ = torch.linalg.qr(torch.randn(layers, d, d, device="cuda", dtype=torch.float64, generator=g))
    if kind == "power":
        lam = torch.logspace(0, -10, d, device="cuda", dtype=torch.float64)
    elif kind == "rank_deficient":
        lam = torch.cat([torch.zeros(d // 2, device="cuda"), torch.rand(d - d // 2, device="cuda", generator=g)])
    else:  # degenerate: three distinct eigenvalues
        lam = torch.tensor([1.0, 0.5, 0.25], device="cuda").repeat_interleave(d // 3 + 1)[:d]
    return (q * lam.to(torch.float64)) @ q.mT


@pytest.mark.gpu
@pytest.mark.parametrize(("layers", "d"), [(48, 20), (48, 64), (16, 256)])
@pytest.mark.parametrize("kind", ["power", "rank_deficient", "degenerate"])
def test_on_the_gpu_the_backend_meets_the_accuracy_contract(layers, d, kind):
    _needs_cupy()
    gram = _spectrum(layers, d, kind)
    lam, vecs = _cupy_backend.eigh(gram)
    _check_decomposition(gram.cpu(), lam.cpu(), vecs.cpu())


@pytest.mark.gpu
def test_on_the_gpu_it_runs_on_torchs_current_stream_and_upcasts_float32():
    _needs_cupy()
    gram = _spectrum(8, 48, "power")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        lam, vecs = _cupy_backend.eigh(gram.float())
    torch.cuda.current_stream().wait_stream(side)
    assert lam.dtype == torch.float64
    _check_decomposition(gram.float().double().cpu(), lam.cpu(), vecs.cpu())
