"""The optional native extension faast._C (csrc/): loading, fallback, argument checks and the ops' schemas + fake
implementations on the CPU; its numerics on a GPU (marked gpu, skipped without one). The CUDA sources are
compile-checked by scripts/check_cuda_sources.sh in CI.

On a GPU, every call that is expected to raise from inside the extension (and every routine on small batches) runs in
a child process first (`gpu_probe`): the first GPU run crashed the whole test session with a segmentation fault at
the extension's first throw, and a crash in the child fails only the case it happened in, with the child's stderr
(and a native backtrace where gdb is installed). Run one case alone with -k, e.g. -k syevd_streams_3x200.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from faast.ops import _cuda_backend, _dispatch
from tolerances import rel

CUDA = torch.device("cuda")
ROOT = Path(__file__).resolve().parents[1]
RELEASE = re.match(r"\d+\.\d+\.\d+", torch.__version__).group(0)


@pytest.fixture
def fresh_state(monkeypatch):
    monkeypatch.setattr(_cuda_backend, "_state", {})
    monkeypatch.setattr(_dispatch, "_logged", set())
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)


def _raise(err: BaseException):
    def fail():
        raise err

    return fail


def _returns(record: object):
    return lambda: record


# name -> (what torch.version.cuda is made to be, the simulated import, a fragment the reason must contain)
LOAD_FAILURES = {
    "not_built": (None, _raise(ModuleNotFoundError("No module named 'faast._C'", name="faast._C")), "is not built"),
    "missing_symbol": (
        None,
        _raise(ImportError("faast/_C.so: undefined symbol: _ZN2at4cuda28getCurrentCUDASolverDnHandleEv")),
        "undefined symbol: _ZN2at4cuda28getCurrentCUDASolverDnHandleEv: it was built against another torch",
    ),
    "missing_library": (
        None,
        _raise(ImportError("libcusolver.so.11: cannot open shared object file: No such file or directory")),
        "does not load: libcusolver.so.11: cannot open shared object file",
    ),
    "os_error": (None, _raise(OSError("libcudart.so.13: cannot open shared object file")), "OSError: libcudart.so.13"),
    "torch_mismatch": (
        "13.0",
        _returns(SimpleNamespace(torch_version="2.10.0", cuda_version="13.0")),
        "built for torch 2.10.0 with CUDA 13.0, but this is torch",
    ),
    "cuda_mismatch": (
        "13.0",
        _returns(SimpleNamespace(torch_version=RELEASE, cuda_version="12.6")),
        f"built for torch {RELEASE} with CUDA 12.6, but this is torch {torch.__version__} (CUDA 13.0)",
    ),
    "cpu_torch": (
        None,
        _returns(SimpleNamespace(torch_version=RELEASE, cuda_version="13.0")),
        "(a CPU build); install a CUDA build of torch",
    ),
    "no_build_record": ("13.0", _returns(SimpleNamespace()), "has no build record"),
}


@pytest.fixture(params=sorted(LOAD_FAILURES))
def load_failure(request, fresh_state, monkeypatch):
    """faast._C failing to load in one of the ways of LOAD_FAILURES; yields (the fragment, the number of imports)."""
    torch_cuda, importer, fragment = LOAD_FAILURES[request.param]
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    imports = []

    def counted():
        imports.append(1)
        return importer()

    monkeypatch.setattr(_cuda_backend, "_import_extension", counted)
    return fragment, imports


def test_a_load_failure_is_reported_with_its_cause_and_tried_once(load_failure):
    fragment, imports = load_failure
    for _ in range(3):
        assert fragment in _cuda_backend.load_error()
    assert len(imports) == 1
    assert _cuda_backend.build_record() is None
    assert [name for name, _ in _dispatch.explain("eigh", CUDA)][0] == "cuda"


def test_a_load_failure_makes_auto_fall_back_with_one_log_line(load_failure, caplog):
    fragment, _ = load_failure
    with caplog.at_level(logging.INFO, logger="faast"):
        for _ in range(3):
            name, _ = _dispatch.resolve("eigh", CUDA)
            assert name == "torch"
    lines = [r.getMessage() for r in caplog.records if "skips the cuda backend" in r.getMessage()]
    assert len(lines) == 1 and fragment in lines[0], lines


def test_a_load_failure_makes_an_explicit_request_raise_naming_it(load_failure, monkeypatch):
    fragment, _ = load_failure
    monkeypatch.setenv("FAAST_BACKEND", "cuda")
    with pytest.raises(RuntimeError, match="FAAST_BACKEND=cuda was requested for eigh on cuda, but ") as raised:
        _dispatch.resolve("eigh", CUDA)
    assert fragment in str(raised.value)
    with pytest.raises(RuntimeError, match="does not run on cpu"):
        _dispatch.resolve("eigh", torch.device("cpu"))


def test_a_load_failure_is_shown_by_the_environment_report(load_failure):
    from faast import env

    fragment, _ = load_failure
    assert fragment in env.report()["native_extension"]


def test_a_build_for_this_torch_and_cuda_major_loads(fresh_state, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    record = SimpleNamespace(torch_version=RELEASE, cuda_version="13.2", cusolver_version="12.0.4", compiler="gcc 13")
    monkeypatch.setattr(_cuda_backend, "_import_extension", _returns(record))
    registered = []
    monkeypatch.setattr(_cuda_backend, "_register_fake", lambda: registered.append(1))
    assert _cuda_backend.load_error() is None
    assert registered == [1]
    assert _cuda_backend.build_record() == vars(record)


def test_a_build_whose_ops_differ_from_this_faast_is_reported(fresh_state, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    record = SimpleNamespace(torch_version=RELEASE, cuda_version="13.0")
    monkeypatch.setattr(_cuda_backend, "_import_extension", _returns(record))
    monkeypatch.setattr(_cuda_backend, "_register_fake", _raise(RuntimeError("operator faast::x does not exist")))
    assert "its ops do not match this faast: RuntimeError: operator faast::x" in _cuda_backend.load_error()


# ------------------------------------------------------------------------------------- argument checks on the CPU


@pytest.mark.parametrize(
    "algorithm,layers,d,fragment",
    [
        ("eig", 2, 8, "algorithm: expected one of"),
        (None, 2, 8, "algorithm: expected one of"),
        ("syevj_batched", 2, 33, "supports d <= 32"),
        ("syev_batched", 2**15, 2**8, "supports L * d * d <= 2**31 - 1"),
    ],
)
def test_an_algorithm_the_op_would_reject_is_named_before_calling_it(algorithm, layers, d, fragment):
    assert fragment in _cuda_backend.algorithm_error(algorithm, layers, d)


@pytest.mark.parametrize(
    "algorithm,layers,d",
    [("auto", 10**6, 4096), ("syevj_batched", 48, 32), ("syev_batched", 2**15 - 1, 2**8), ("syevd_streams", 48, 4096)],
)
def test_an_algorithm_within_its_limits_is_accepted(algorithm, layers, d):
    assert _cuda_backend.algorithm_error(algorithm, layers, d) is None


def test_syev_batched_needs_a_recent_cusolver():
    error = _cuda_backend.algorithm_error("syev_batched", 2, 8, syev_batched_available=False)
    assert "needs faast._C built with cuSOLVER 11.7" in error


@pytest.mark.parametrize(
    "gram,error,fragment",
    [
        ([[1.0]], TypeError, "gram: expected a torch.Tensor, got list"),
        (torch.zeros(2, 3, 4), ValueError, r"gram: expected shape \[L, d, d\], got \[2, 3, 4\]"),
        (torch.zeros(3, 3), ValueError, r"gram: expected shape \[L, d, d\], got \[3, 3\]"),
        (torch.zeros(2, 3, 3), ValueError, "gram: expected a CUDA tensor"),
    ],
)
def test_bad_arguments_raise_before_the_extension_is_loaded_or_called(fresh_state, monkeypatch, gram, error, fragment):
    monkeypatch.setattr(_cuda_backend, "_import_extension", _raise(AssertionError("the extension was reached")))
    with pytest.raises(error, match=fragment):
        _cuda_backend.batched_eigh(gram)
    assert "error" not in _cuda_backend._state


# ------------------------------------------------------------------------ the schemas of csrc/faast_ops.cpp on the CPU


def _schemas() -> dict[str, str]:
    """name -> schema, as csrc/faast_ops.cpp defines them (m.def("...") string literals)."""
    text = (ROOT / "csrc" / "faast_ops.cpp").read_text()
    found = [s.replace('\\"', '"') for s in re.findall(r'm\.def\("((?:[^"\\]|\\.)*)"\)', text)]
    return {schema.split("(")[0]: schema for schema in found}


def test_the_cuda_file_implements_every_op_the_schema_defines():
    text = (ROOT / "csrc" / "cuda" / "batched_eigh.cu").read_text()
    assert set(re.findall(r'm\.impl\("(\w+)"', text)) == set(_schemas()) == {"batched_eigh", "batched_eigh_info"}


def _cpu_kernel(name: str):
    def eigh(gram, algorithm="auto"):
        return torch.linalg.eigh(gram)

    def eigh_info(gram, algorithm="auto"):
        return (*torch.linalg.eigh(gram), torch.zeros(gram.shape[0], dtype=torch.int32))

    return {"batched_eigh": eigh, "batched_eigh_info": eigh_info}[name]


@pytest.fixture
def schema_only_library():
    """The ops' schemas as csrc/faast_ops.cpp defines them, with CPU kernels for testing, when faast._C is absent."""
    if _cuda_backend.load_error() is None:
        pytest.skip("faast._C is loaded here; its own schema is tested on the GPU")
    lib = torch.library.Library("faast", "DEF")
    for name, schema in _schemas().items():
        lib.define(schema)
        lib.impl(name, _cpu_kernel(name), "CPU")
    _cuda_backend._register_fake(lib)
    yield
    lib._destroy()


@pytest.mark.parametrize("name", ["batched_eigh", "batched_eigh_info"])
def test_the_fake_implementations_match_the_ops(schema_only_library, name):
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = getattr(torch.ops.faast, name)
    gram = torch.randn(3, 5, 5, dtype=torch.float64)
    gram = gram @ gram.mT
    with FakeTensorMode() as mode:
        out = op(mode.from_tensor(gram))
    assert out[0].shape == (3, 5) and out[1].shape == (3, 5, 5) and out[0].dtype == out[1].dtype == torch.float64
    assert out[1].stride() == torch.linalg.eigh(gram).eigenvectors.stride()
    if name == "batched_eigh_info":
        assert out[2].shape == (3,) and out[2].dtype == torch.int32 and out[2].device.type == "cpu"
    torch.library.opcheck(op, (gram,), test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(op, (gram, "syevd_streams"), test_utils=("test_schema", "test_faketensor"))


def test_a_nonzero_info_raises_naming_the_first_failing_layer():
    with pytest.raises(torch.linalg.LinAlgError, match=r"could not decompose layer 2 of gram \(info = 7: did not"):
        _cuda_backend._raise_for_info(torch.tensor([0, 0, 7, 3], dtype=torch.int32), "auto")
    with pytest.raises(torch.linalg.LinAlgError, match=r"layer 0 of gram \(info = -4: invalid argument"):
        _cuda_backend._raise_for_info(torch.tensor([-4], dtype=torch.int32), "syevd_streams")
    _cuda_backend._raise_for_info(torch.zeros(3, dtype=torch.int32), "auto")


def test_nonfinite_eigenvalues_raise_naming_the_first_such_layer():
    # Jacobi may return info = 0 on NaN statistics: the eigenvalues are checked as well.
    lam = torch.arange(12, dtype=torch.float64).reshape(4, 3)
    _cuda_backend._raise_for_nonfinite(lam, "auto")
    lam[3, 0], lam[1, 2] = float("inf"), float("nan")
    with pytest.raises(torch.linalg.LinAlgError, match=r"layer 1 of gram has non-finite eigenvalues"):
        _cuda_backend._raise_for_nonfinite(lam, "syevj_batched")
    _cuda_backend._raise_for_nonfinite(torch.zeros(0, 5, dtype=torch.float64), "auto")


def test_auto_may_time_the_extension_wherever_it_loads():
    # Measured on an H100 (gpu_h100_run3): no gate keeps auto from timing it against torch and cupy.
    assert _cuda_backend.gate("eigh", _dispatch.Call("eigh", CUDA, (torch.float64,), ((48, 1600, 1600),))) is None


# ---------------------------------------------------------------------------------------------------- on a GPU


def _spectra(layers: int, d: int, kind: str, device: str = "cpu") -> torch.Tensor:
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
    return ((q * lam.unsqueeze(-2)) @ q.mT).to(device)


def _assert_decomposes(gram: torch.Tensor, lam: torch.Tensor, vecs: torch.Tensor) -> None:
    d = gram.shape[-1]
    scale = gram.norm(dim=(-2, -1)).max()
    residual = (gram @ vecs - vecs * lam.unsqueeze(-2)).norm() / scale
    eye = torch.eye(d, dtype=torch.float64, device=gram.device)
    assert float(residual) < 1e-10 * d, float(residual)
    assert float((vecs.mT @ vecs - eye).norm()) < 1e-10 * d
    assert bool((lam[:, 1:] >= lam[:, :-1]).all())
    assert rel(lam, torch.linalg.eigh(gram).eigenvalues) < 1e-12


def _expect_raise(fragment: str, fn) -> None:
    try:
        fn()
    except RuntimeError as err:
        assert fragment in str(err), str(err)
        return
    raise AssertionError(f"expected a RuntimeError containing {fragment!r}")


def _routine_case(algorithm: str, layers: int, d: int):
    def case():
        gram = _spectra(layers, d, "power", "cuda")
        _assert_decomposes(gram, *torch.ops.faast.batched_eigh(gram, algorithm))
        lam, vecs, info = torch.ops.faast.batched_eigh_info(gram, algorithm)
        assert info.device.type == "cpu" and info.dtype == torch.int32 and not bool(info.any())
        _assert_decomposes(gram, lam, vecs)

    return case


def _nan_layer(layers: int = 4, d: int = 40) -> torch.Tensor:
    gram = _spectra(layers, d, "power", "cuda")
    gram[2, 3, 1] = float("nan")
    return gram


def _info_case():
    for algorithm in ("syev_batched", "syevd_streams"):
        _, _, info = torch.ops.faast.batched_eigh_info(_nan_layer(), algorithm)
        assert int(info[2]) != 0 and int(info[0]) == int(info[1]) == int(info[3]) == 0, (algorithm, info)


def _strided_case():
    big = _spectra(5, 80, "power", "cuda")
    gram = big[:, :40, :40]  # not contiguous
    assert not gram.is_contiguous()
    _assert_decomposes(gram, *torch.ops.faast.batched_eigh(gram, "syevd_streams"))


def _empty_case():
    lam, vecs = torch.ops.faast.batched_eigh(torch.zeros(0, 6, 6, dtype=torch.float64, device="cuda"))
    assert lam.shape == (0, 6) and vecs.shape == (0, 6, 6)


# Run in a child process, in this order; the raising cases first, because the first GPU run crashed at the
# extension's first throw: if "raises_for_an_unknown_algorithm" crashes in a fresh process, before any cuSOLVER call,
# a throw through faast._C itself is what crashes (csrc/README.md), not memory damaged by a routine.
GPU_CASES = {
    "torch_raises_in_this_process": lambda: _expect_raise("shape", lambda: torch.zeros(4, device="cuda").view(3)),
    "raises_for_an_unknown_algorithm": lambda: _expect_raise(
        "algorithm must be auto", lambda: torch.ops.faast.batched_eigh(_spectra(2, 8, "power", "cuda"), "eig")
    ),
    "raises_for_float32": lambda: _expect_raise(
        "gram must be float64", lambda: torch.ops.faast.batched_eigh(_spectra(2, 40, "power", "cuda").float())
    ),
    "raises_for_syevj_batched_above_32": lambda: _expect_raise(
        "syevj_batched supports d <= 32",
        lambda: torch.ops.faast.batched_eigh(_spectra(3, 200, "power", "cuda"), "syevj_batched"),
    ),
    "raises_naming_the_failing_layer": lambda: _expect_raise(
        "failed on layer 2", lambda: torch.ops.faast.batched_eigh(_nan_layer())
    ),
    **{
        f"{algorithm}_{layers}x{d}": _routine_case(algorithm, layers, d)
        for layers, d in [(5, 24), (3, 200)]
        for algorithm in ("auto", "syevj_batched", "syev_batched", "syevd_streams")
        if not (algorithm == "syevj_batched" and d > 32)
    },
    "syevd_streams_more_layers_than_streams": _routine_case("syevd_streams", 9, 40),
    "info_names_the_failing_layer": _info_case,
    "strided_input": _strided_case,
    "empty_batch": _empty_case,
}


def _harness_segfault():
    os.kill(os.getpid(), signal.SIGSEGV)


def _harness_fails():
    raise AssertionError("a wrong eigenvalue")


# Cases of the child harness itself (tested on the CPU): a crash, a failure, a pass.
_HARNESS_CASES = {"harness_ok": lambda: None, "harness_segfault": _harness_segfault, "harness_fails": _harness_fails}


def _child(names: list[str]) -> None:
    """The child process: each case in order, one line before and one after, flushed (a crash leaves the START)."""
    error = _cuda_backend.load_error()
    print("BUILD", json.dumps(_cuda_backend.build_record() if error is None else {"error": error}), flush=True)
    for name in names:
        print("START", name, flush=True)
        try:
            {**GPU_CASES, **_HARNESS_CASES}[name]()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            verdict = "ok"
        except BaseException as err:  # noqa: BLE001 - reported to the parent
            verdict = f"failed: {type(err).__name__}: {err}"
        print("DONE", name, json.dumps(verdict), flush=True)


CHILD_TIMEOUT_S = 180
GDB_TIMEOUT_S = 60


def _run_child(names: list[str], gdb: bool = False) -> subprocess.CompletedProcess:
    command = [sys.executable, "-X", "faulthandler", __file__, "--gpu-probe", *names]
    if gdb:
        command = ["gdb", "-q", "-batch", "-ex", "run", "-ex", "bt 40", "--args", *command]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    timeout = GDB_TIMEOUT_S if gdb else CHILD_TIMEOUT_S
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name if code < 0 else f"exit status {code}"
    except ValueError:
        return f"exit status {code}"


def probe(names: list[str]) -> dict[str, str]:
    """case -> "ok" or why not, running the cases in child processes: after a crash, the rest in a new one."""
    verdicts: dict[str, str] = {}
    remaining = list(names)
    while remaining:
        try:
            done = _run_child(remaining)
            out, err, code = done.stdout, done.stderr, done.returncode
        except subprocess.TimeoutExpired as timeout:
            out, err, code = timeout.stdout or "", timeout.stderr or "", None
            out, err = (s.decode() if isinstance(s, bytes) else s for s in (out, err))
        started, build = None, "not reported"
        for line in out.splitlines():
            kind, _, rest = line.partition(" ")
            if kind == "BUILD":
                build = rest
            elif kind == "START":
                started = rest
            elif kind == "DONE":
                name, _, verdict = rest.partition(" ")
                verdicts[name] = json.loads(verdict)
                started = None
        if started is None:
            break
        why = f"timed out ({CHILD_TIMEOUT_S} s)" if code is None else f"crashed ({_signal_name(code)})"
        detail = f"the child process {why} in case {started!r} (faast._C build: {build}). Its stderr:\n{err[-3000:]}"
        if code is not None and shutil.which("gdb"):
            try:
                gdb_out = _run_child([started], gdb=True).stdout
            except subprocess.TimeoutExpired:
                gdb_out = "received signal: none within the time limit (gdb timed out)"
            detail += f"\nNative backtrace (gdb):\n{gdb_out[gdb_out.find('received signal') :][:4000]}"
        verdicts[started] = detail
        remaining = remaining[remaining.index(started) + 1 :]
    return verdicts


def test_the_child_harness_reports_a_crash_for_its_case_and_runs_the_rest_in_a_new_child():
    verdicts = probe(["harness_ok", "harness_segfault", "harness_fails", "harness_ok"])
    assert verdicts["harness_ok"] == "ok"
    assert verdicts["harness_fails"] == "failed: AssertionError: a wrong eigenvalue"
    crash = verdicts["harness_segfault"]
    assert crash.startswith("the child process crashed (SIGSEGV) in case 'harness_segfault'")
    assert "Fatal Python error: Segmentation fault" in crash and "_harness_segfault" in crash


@pytest.fixture(scope="module")
def gpu_probe(request):
    if not torch.cuda.is_available() or _cuda_backend.load_error() is not None:
        pytest.skip(f"needs a GPU and the built extension faast._C ({_cuda_backend.load_error()})")
    selected = [
        item.callspec.params["case"]
        for item in request.session.items
        if item.nodeid.startswith(request.node.nodeid)
        and "case" in getattr(item, "callspec", SimpleNamespace(params={})).params
    ]
    return probe([name for name in GPU_CASES if name in selected])


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_on_the_gpu_in_a_child_process(case, gpu_probe):
    assert gpu_probe.get(case) == "ok", gpu_probe.get(case, "not run: the child process stopped before it")


def _needs_extension() -> None:
    if not torch.cuda.is_available() or _cuda_backend.load_error() is not None:
        pytest.skip(f"needs a GPU and the built extension faast._C ({_cuda_backend.load_error()})")


@pytest.mark.gpu
@pytest.mark.parametrize("layers,d", [(1, 64), (16, 64), (48, 64), (16, 768), (48, 1600), (4, 3584), (3, 20)])
@pytest.mark.parametrize("kind", ["power", "rank_deficient", "degenerate"])
def test_batched_eigh_on_the_gpu_satisfies_the_eigen_equations(layers, d, kind):
    _needs_extension()
    gram = _spectra(layers, d, kind, "cuda")
    _assert_decomposes(gram, *_cuda_backend.batched_eigh(gram))


@pytest.mark.gpu
def test_float32_statistics_are_upcast_by_the_backend():
    _needs_extension()
    gram = _spectra(2, 40, "power", "cuda")
    lam, vecs = _cuda_backend.eigh(gram.float())
    assert lam.dtype == vecs.dtype == torch.float64
    _assert_decomposes(gram.float().double(), lam, vecs)


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ["auto", "syev_batched", "syevd_streams"])
def test_a_failing_layer_is_named_by_the_backend(algorithm):
    _needs_extension()
    with pytest.raises(torch.linalg.LinAlgError, match="could not decompose layer 2 of gram"):
        _cuda_backend.batched_eigh(_nan_layer(), algorithm)


if __name__ == "__main__" and sys.argv[1:2] == ["--gpu-probe"]:
    _child(sys.argv[2:])
