"""faast with FAAST_BACKEND=triton: the kernels behind faast.ops and FastWeights give the torch backend's results.

On CPU this runs Triton's interpreter (conftest sets TRITON_INTERPRET=1), which the triton backend accepts for CPU
tensors; on a GPU machine the same tests exercise the compiled kernels through the gpu-marked test.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

pytest.importorskip("triton")

import faast_kernels  # noqa: E402

# These tests push CPU tensors through the triton backend, which only the interpreter accepts; on a GPU machine the
# kernel tests (tests/test_triton_kernels.py) run compiled, and test_auto_picks_triton_on_cuda checks the dispatch.
cpu_interpreter = pytest.mark.skipif(not faast_kernels.interpreting(), reason="needs TRITON_INTERPRET=1 (no GPU)")

import spectra  # noqa: E402
from faast import FastWeights, ops  # noqa: E402
from faast.ops import _dispatch  # noqa: E402
from tolerances import REORDER_REL, TRUTH_REL_P, TRUTH_REL_W, rel  # noqa: E402


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("FAAST_BACKEND", "triton")
    monkeypatch.setattr(_dispatch, "_logged", set())


def _learn(monkeypatch, backend, **kwargs):
    monkeypatch.setenv("FAAST_BACKEND", backend)
    g = torch.Generator().manual_seed(4)
    memory = FastWeights(24, 7, batch_shape=(2,), dtype=torch.float64, **kwargs)
    for n in (13, 40, 1):
        keys = torch.randn(2, n, 24, generator=g)
        values = torch.randn(2, n, 7, generator=g)
        scores = torch.rand(2, n, generator=g)
        mask = torch.rand(2, n, generator=g) > 0.3
        memory.update(keys, values, scores, mask=mask)
    return memory


@cpu_interpreter
@pytest.mark.parametrize("kwargs", [{}, {"weighted_least_squares": True}, {"alpha": "auto"}, {"ridge": "auto"}],
                         ids=["default", "wls", "gcv-rank", "gcv-ridge"])  # fmt: skip
def test_fastweights_through_triton_equals_torch(monkeypatch, kwargs):
    torch_memory = _learn(monkeypatch, "torch", **kwargs)
    triton_memory = _learn(monkeypatch, "triton", **kwargs)
    for name in ("gram", "cross", "target_sqnorm"):
        assert rel(getattr(triton_memory, name), getattr(torch_memory, name)) <= REORDER_REL, name
    assert torch.equal(triton_memory.count, torch_memory.count)
    assert rel(triton_memory.weights, torch_memory.weights) <= 1e-9


@cpu_interpreter
def test_accumulate_gram_uses_the_kernel(triton_backend, monkeypatch):
    from faast.ops import _triton_backend

    calls = []
    real = _triton_backend.accumulate_gram
    monkeypatch.setitem(_dispatch._REGISTRY["triton"].ops, "accumulate_gram",
                        lambda *a, **k: calls.append(1) or real(*a, **k))  # fmt: skip
    keys, values = torch.randn(3, 30, 10), torch.randn(3, 30, 4)
    gram, cross = ops.accumulate_gram(keys, values)
    assert calls == [1]
    torch.testing.assert_close(gram, keys.double().mT @ keys.double(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cross, keys.double().mT @ values.double(), rtol=1e-12, atol=1e-12)


@cpu_interpreter
def test_eigh_takes_the_automatic_choice_and_says_so(triton_backend, caplog):
    with caplog.at_level(logging.INFO, logger="faast"):
        memory = FastWeights(6, 2).update(torch.randn(20, 6), torch.randn(20, 2))
        _ = memory.weights
    assert any("FAAST_BACKEND=triton has no eigh" in r.getMessage() for r in caplog.records)


@cpu_interpreter
def test_residual_project_through_ops(triton_backend):
    x = torch.randn(2, 5, 48).bfloat16()
    m = (0.1 * torch.randn(48, 48)).bfloat16()
    out = ops.residual_project(x, m)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    expected = x.double() + x.double() @ m.double()
    torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=1.6e-2)


@cpu_interpreter
def test_gradients_through_faast_ops_use_the_kernel(triton_backend):
    keys = torch.randn(40, 12)
    values = torch.randn(40, 5, dtype=torch.float64, requires_grad=True)
    scores = torch.rand(40, dtype=torch.float64, requires_grad=True)
    _, cross = ops.accumulate_gram(keys, values, scores)
    g = torch.randn_like(cross)
    got = torch.autograd.grad((cross * g).sum(), (values, scores))
    ref = keys.double().mT @ (scores[:, None] * values)
    expected = torch.autograd.grad((ref * g).sum(), (values, scores))
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("compute_dtype", [torch.float64, torch.float32], ids=["fp64", "tf32x3"])
@cpu_interpreter
def test_rank_deficient_fidelity_in_both_modes(triton_backend, compute_dtype):
    # Duplicated rows (rank 64 of d = 128) at N = 4096, alpha = 1: float32 GEMM statistics over 4096-row chunks gain
    # spurious directions here; the kernel's modes must keep the true rank (fp64 exactly, tf32x3 thanks to the
    # float64 flush every 256 rows). lab/benchmarks/fidelity_triton_modes.py runs the whole suite.
    keys, held_out = spectra.make_keys("dup_gauss", 4096, 128, n_test=512)
    values = spectra.make_values(keys, 16)
    u, s, vh = torch.linalg.svd(keys.double(), full_matrices=False)
    keep = s > s[0] / 4096
    truth = vh[keep].T @ ((u[:, keep].T @ values.double()) / s[keep].unsqueeze(-1))
    memory = FastWeights(128, 16, dtype=torch.float64, compute_dtype=compute_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the opt-in float32 modes warn by policy
        memory.update(keys, values)
        weights = memory.weights
    assert int(memory.solve_info.rank) == int(keep.sum())
    assert rel(weights, truth) <= TRUTH_REL_W
    assert rel(held_out.double() @ weights, held_out.double() @ truth) <= TRUTH_REL_P


@cpu_interpreter
def test_tf32x3_mode_warns_once(triton_backend, monkeypatch):
    from faast.ops import _triton_backend

    monkeypatch.setattr(_triton_backend, "_warned", [])
    keys, values = torch.randn(30, 8), torch.randn(30, 3)
    with pytest.warns(RuntimeWarning, match="opt-in tf32x3 Gram mode"):
        ops.accumulate_gram(keys, values, compute_dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.accumulate_gram(keys, values, compute_dtype=torch.float32)  # once per process


def test_torch_float32_compute_fails_the_same_case(monkeypatch):
    # The contrast that makes the flush matter: float32 GEMMs over 4096-row chunks keep spurious directions here.
    monkeypatch.setenv("FAAST_BACKEND", "torch")
    keys, _ = spectra.make_keys("dup_gauss", 4096, 128, n_test=512)
    memory = FastWeights(128, 16, compute_dtype=torch.float32).update(keys, spectra.make_values(keys, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _ = memory.weights
    u_rank = int((torch.linalg.svdvals(keys.double()) > torch.linalg.svdvals(keys.double())[0] / 4096).sum())
    assert int(memory.solve_info.rank) > u_rank


def test_explicit_triton_request_without_triton_raises(monkeypatch):
    import faast_kernels

    monkeypatch.setenv("FAAST_BACKEND", "triton")
    monkeypatch.setattr(faast_kernels, "HAS_TRITON", False)
    with pytest.raises(RuntimeError, match="FAAST_BACKEND=triton.*Triton is not installed"):
        ops.accumulate_gram(torch.randn(5, 3), torch.randn(5, 2))


def test_auto_never_picks_the_interpreter_on_the_cpu(monkeypatch, caplog):
    # Triton's CPU interpreter is for tests: auto keeps torch on the CPU and says why, once; an explicit request still
    # selects the kernels.
    monkeypatch.delenv("FAAST_BACKEND", raising=False)
    monkeypatch.setattr(_dispatch, "_logged", set())
    monkeypatch.setitem(_dispatch._REGISTRY["triton"].__dict__, "devices", ("cuda", "cpu"))
    monkeypatch.setitem(_dispatch._PREFERENCE, "cpu", ("triton", "torch"))
    with caplog.at_level(logging.INFO, logger="faast"):
        assert _dispatch.resolve("accumulate_gram", torch.device("cpu"))[0].startswith("torch")
    assert any("interpreter is for tests" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("FAAST_BACKEND", "triton")
    assert _dispatch.resolve("accumulate_gram", torch.device("cpu"))[0] == "triton"


def _cuda_call(keys, values, compute, masked, capability):
    call = _dispatch.Call(
        "accumulate_gram", torch.device("cuda"), (keys, values), options={"compute_dtype": compute, "masked": masked}
    )
    return call, capability


@pytest.mark.parametrize(
    "keys,values,compute,masked,capability,expected",
    [
        # Measured on an H100 (gpu_h100_run2): the float64 dot does not compile with 16-bit inputs or a mask.
        (torch.bfloat16, torch.bfloat16, torch.float64, False, (9, 0), "does not compile on sm_90"),
        (torch.float32, torch.float32, torch.float64, True, (9, 0), "does not compile on sm_90"),
        (torch.float16, torch.float32, torch.float64, False, (8, 0), "does not compile on sm_80"),
        # float32 keys without a mask compiled there and passed the fidelity suite: auto may time it.
        (torch.float32, torch.float32, torch.float64, False, (9, 0), None),
        (torch.float32, torch.float32, torch.float64, True, (7, 5), None),
        # tf32x3 fails the fidelity suite on every device; exact16 (float32 compute, 16-bit inputs) may compete.
        (torch.float32, torch.float32, torch.float32, False, (9, 0), "tf32x3 mode"),
        (torch.bfloat16, torch.bfloat16, torch.float32, True, (9, 0), None),
    ],
)
def test_the_gate_declines_what_does_not_compile_or_pass_fidelity(
    monkeypatch, keys, values, compute, masked, capability, expected
):
    from faast.ops import _triton_backend

    pytest.importorskip("triton")
    call, cap = _cuda_call(keys, values, compute, masked, capability)
    monkeypatch.setattr(type(call), "capability", property(lambda self: cap))
    reason = _triton_backend.gate("accumulate_gram", call)
    if expected is None:
        assert reason is None
    else:
        assert reason is not None and expected in reason
    assert _triton_backend.gate("residual_project", call) is None
    cpu_call = _dispatch.Call("accumulate_gram", torch.device("cpu"), (keys, values))
    assert "interpreter" in _triton_backend.gate("accumulate_gram", cpu_call)


def test_an_fp64_kernel_failure_on_a_gpu_names_the_fix():
    # The previous kernel's float64 dot did not compile on an H100 (Triton 3.6: "PassManager::run failed",
    # lab/benchmarks/results/gpu_h100_run1.md); the rewritten one is unmeasured there. Such a failure names the way
    # out.
    from faast.ops._triton_backend import fp64_failure_explained

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    with pytest.raises(RuntimeError, match=r"FAAST_BACKEND=torch.*compute_dtype=torch\.float32") as caught:
        with fp64_failure_explained("fp64", cuda):
            raise RuntimeError("PassManager::run failed")
    assert "'fp64'" in str(caught.value) and "PassManager::run failed" in str(caught.value)
    assert str(caught.value.__cause__) == "PassManager::run failed"
    # Other modes, the CPU interpreter and running out of memory are not compile failures: they pass unchanged.
    cases = [("exact16", cuda, RuntimeError("x")), ("fp64", cpu, RuntimeError("x")),
             ("fp64", cuda, torch.cuda.OutOfMemoryError("x"))]  # fmt: skip
    for precision, device, error in cases:
        with pytest.raises(type(error)) as caught:
            with fp64_failure_explained(precision, device):
                raise error
        assert caught.value is error, (precision, device)
    with fp64_failure_explained("fp64", cuda):
        pass  # no failure, nothing raised
