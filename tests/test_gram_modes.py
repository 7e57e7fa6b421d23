"""faast.ops.gram_modes (torch.exact16, torch.syrk) against the float64 definition of the statistics.

torch.syrk is float64 (same exact products, another summation order: REORDER_REL). torch.exact16 on this CPU runs
the 16-bit products on float32 copies with float32 sums over R rows, flushed into float64 (EXACT16_REL); the inputs'
float64 truth is that of the 16-bit-rounded rows. Buffers from torch.empty start NaN under test (conftest.py).
"""

from __future__ import annotations

import sys

import pytest
import torch

from faast.ops import gram_modes, reference
from faast.ops._dispatch import Call
from oracles import statistics64
from tolerances import ELEMENTWISE, EXACT16_REL, EXACT16_SCORED_REL, REORDER_REL, rel

F64 = torch.float64
SIXTEEN = [torch.bfloat16, torch.float16]

# (B, N, dk, dv)
SHAPES = [
    pytest.param(1, 77, 60, 33, id="N77-dk60-dv33"),
    pytest.param(3, 150, 20, 7, id="B3-N150"),
    pytest.param(2, 5, 7, 1, id="B2-N5-dv1"),
    pytest.param(1, 40, 1, 1, id="d1"),
    pytest.param(1, 33, 9, 24, id="dk<dv"),
    pytest.param(2, 0, 13, 5, id="N0"),
]


def rows(batch, n, dk, dv, *, scored, masked, dtype=torch.float32):
    """Keys, values, scores, mask; masked-out rows hold NaN in keys, values and scores (they must not leak)."""
    keys = torch.randn(batch, n, dk).to(dtype)
    values = torch.randn(batch, n, dv).to(dtype)
    scores = torch.rand(batch, n) + 0.1 if scored else None
    mask = None
    if masked:
        mask = torch.rand(batch, n) > 0.3
        keys[~mask] = float("nan")
        values[~mask] = float("nan")
        if scores is not None:
            scores[~mask] = float("nan")
    return keys, values, scores, mask


def truth(keys, values, scores, mask, wls):
    if mask is not None:  # the oracle zeroes excluded rows with where(); scores too
        scores = None if scores is None else torch.nan_to_num(scores)
    s, t, _, yy = statistics64(keys, values, scores, mask, wls=wls)
    return s, t, yy


def small_chunks(monkeypatch):
    # 8 bytes x 48 columns x 16 rows: chunks of 16 rows (the floor of chunk_rows is 64 rows; 16 MB at full size).
    monkeypatch.setattr(reference, "_CHUNK_BYTES", 8 * 48 * 16)


# ---------------------------------------------------------------------------------------------------- torch.syrk


@pytest.mark.parametrize("batch,n,dk,dv", SHAPES)
@pytest.mark.parametrize("scored", [False, True], ids=["noscores", "scores"])
@pytest.mark.parametrize("masked", [False, True], ids=["all-rows", "masked-nan"])
@pytest.mark.parametrize("wls", [False, True], ids=["values-weighted", "wls"])
def test_syrk_equals_the_float64_definition(batch, n, dk, dv, scored, masked, wls):
    keys, values, scores, mask = rows(batch, n, dk, dv, scored=scored, masked=masked)
    gram, cross, yy = gram_modes.accumulate_gram_syrk(
        keys, values, scores, mask, weighted_least_squares=wls, compute_dtype=F64
    )
    s_ref, t_ref, yy_ref = truth(keys, values, scores, mask, wls)
    assert gram.shape == (batch, dk, dk) and cross.shape == (batch, dk, dv) and yy.shape == (batch,)
    assert gram.dtype == cross.dtype == yy.dtype == F64
    assert rel(gram, s_ref) <= REORDER_REL
    assert rel(cross, t_ref) <= REORDER_REL
    assert rel(yy, yy_ref) <= REORDER_REL
    assert torch.equal(gram, gram.mT)  # one triangle computed, mirrored


def test_syrk_streams_many_ragged_chunks_through_the_poisoned_buffers(monkeypatch):
    small_chunks(monkeypatch)
    assert reference.chunk_rows(1, 48, F64, 1000) == 63  # 16 chunks: 15 x 63 and a ragged 55
    keys, values, scores, mask = rows(2, 1000, 37, 11, scored=True, masked=True)
    got = gram_modes.accumulate_gram_syrk(keys, values, scores, mask, weighted_least_squares=False, compute_dtype=F64)
    for g, want in zip(got, truth(keys, values, scores, mask, False), strict=True):
        assert rel(g, want) <= REORDER_REL


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_syrk_takes_any_float_dtype_and_strides(dtype):
    keys = torch.randn(2, 24, 90).to(dtype).mT  # [2, 90, 24], not contiguous
    values = torch.randn(2, 90, 10).to(dtype)[:, :, ::2]
    got = gram_modes.accumulate_gram_syrk(keys, values, None, None, weighted_least_squares=False, compute_dtype=F64)
    for g, want in zip(got, truth(keys, values, None, None, False), strict=True):
        assert rel(g, want) <= REORDER_REL


def test_syrk_agrees_with_the_reference_path():
    keys, values, scores, mask = rows(2, 700, 50, 30, scored=True, masked=True)
    kwargs = {"weighted_least_squares": True, "compute_dtype": F64}
    ours = gram_modes.accumulate_gram_syrk(keys, values, scores, mask, **kwargs)
    ref = reference.accumulate_gram_streaming(keys, values, scores, mask, **kwargs)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, atol=ELEMENTWISE[F64][0], rtol=ELEMENTWISE[F64][1])


def test_syrk_rejects_float32_compute_naming_it():
    keys, values = torch.randn(1, 10, 4), torch.randn(1, 10, 3)
    with pytest.raises(ValueError, match="compute_dtype.*float64"):
        gram_modes.accumulate_gram_syrk(keys, values, None, None, weighted_least_squares=False,
                                        compute_dtype=torch.float32)  # fmt: skip
    call = Call("accumulate_gram", torch.device("cpu"), (torch.float32,) * 2, options={"compute_dtype": torch.float32})
    assert "compute_dtype" in gram_modes.syrk_cannot_run(call)
    ok = Call("accumulate_gram", torch.device("cpu"), (torch.float32,) * 2, options={"compute_dtype": F64})
    assert gram_modes.syrk_cannot_run(ok) is None


def test_syrk_refuses_inputs_that_require_grad():
    values = torch.randn(1, 10, 3, requires_grad=True)
    with pytest.raises(ValueError, match="values: torch.syrk is not differentiable"):
        gram_modes.accumulate_gram_syrk(torch.randn(1, 10, 4), values, None, None, weighted_least_squares=False,
                                        compute_dtype=F64)  # fmt: skip
    with torch.no_grad():  # how FastWeights calls it
        gram_modes.accumulate_gram_syrk(torch.randn(1, 10, 4), values, None, None, weighted_least_squares=False,
                                        compute_dtype=F64)  # fmt: skip


def test_syrk_is_cpu_only():
    assert "CPU only" in gram_modes.syrk_unavailable_reason(torch.device("cuda"))
    call = Call("accumulate_gram", torch.device("cuda"), (torch.bfloat16,) * 2, options={"compute_dtype": F64})
    assert "CPU only" in gram_modes.syrk_cannot_run(call)
    assert gram_modes.syrk_unavailable_reason(torch.device("cpu")) is None


def test_syrk_without_scipy_says_so_and_raises(monkeypatch):
    monkeypatch.setitem(sys.modules, "scipy.linalg", None)  # `from scipy.linalg import blas` raises ImportError
    gram_modes._scipy_blas.cache_clear()
    try:
        reason = gram_modes.syrk_unavailable_reason()
        assert reason is not None and "scipy" in reason
        with pytest.raises(RuntimeError, match="scipy"):
            gram_modes.accumulate_gram_syrk(torch.randn(1, 4, 3), torch.randn(1, 4, 2), None, None,
                                            weighted_least_squares=False, compute_dtype=F64)  # fmt: skip
    finally:
        monkeypatch.undo()
        gram_modes._scipy_blas.cache_clear()
    assert gram_modes.syrk_unavailable_reason() is None


@pytest.fixture
def fresh_blas_probe(monkeypatch):
    """gram_modes._scipy_blas runs again inside the test (its first-load decisions), and is reset afterwards."""
    gram_modes._scipy_blas.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    gram_modes._scipy_blas.cache_clear()


@pytest.mark.parametrize("user_value", [None, "10"])
def test_syrk_shortens_openblas_spin_before_it_loads_unless_the_user_chose(fresh_blas_probe, user_value):
    fresh_blas_probe.setattr(gram_modes, "_scipy_openblas_loaded", lambda: False)
    if user_value is None:
        fresh_blas_probe.delenv("OPENBLAS_THREAD_TIMEOUT", raising=False)
    else:
        fresh_blas_probe.setenv("OPENBLAS_THREAD_TIMEOUT", user_value)
    assert gram_modes.syrk_unavailable_reason() is None
    assert gram_modes.os.environ["OPENBLAS_THREAD_TIMEOUT"] == (user_value or "4")
    cpu = Call("accumulate_gram", torch.device("cpu"), (torch.float32,) * 2, options={"compute_dtype": F64})
    assert gram_modes.syrk_gate(cpu) is None


def test_syrk_gate_declines_an_openblas_loaded_with_the_default_spin(fresh_blas_probe):
    fresh_blas_probe.setattr(gram_modes, "_scipy_openblas_loaded", lambda: True)
    fresh_blas_probe.delenv("OPENBLAS_THREAD_TIMEOUT", raising=False)
    cpu = Call("accumulate_gram", torch.device("cpu"), (torch.float32,) * 2, options={"compute_dtype": F64})
    reason = gram_modes.syrk_gate(cpu)
    assert reason is not None and "OPENBLAS_THREAD_TIMEOUT" in reason
    assert "OPENBLAS_THREAD_TIMEOUT" not in gram_modes.os.environ  # too late to matter: not set behind the user's back
    assert gram_modes.syrk_cannot_run(cpu) is None  # an explicit request still runs


# ---------------------------------------------------------------------------------------------------- torch.exact16


@pytest.mark.parametrize("batch,n,dk,dv", SHAPES)
@pytest.mark.parametrize("dtype", SIXTEEN, ids=str)
@pytest.mark.parametrize("scored", [False, True], ids=["noscores", "scores"])
@pytest.mark.parametrize("masked", [False, True], ids=["all-rows", "masked-nan"])
@pytest.mark.parametrize("wls", [False, True], ids=["values-weighted", "wls"])
def test_exact16_matches_the_float64_definition(batch, n, dk, dv, dtype, scored, masked, wls):
    keys, values, scores, mask = rows(batch, n, dk, dv, scored=scored, masked=masked, dtype=dtype)
    # R = 16 does not divide N: full chunks and a ragged tail.
    gram, cross, yy = gram_modes.accumulate_gram_exact16(
        keys, values, scores, mask, weighted_least_squares=wls, compute_dtype=torch.float32, flush_rows=16
    )
    s_ref, t_ref, yy_ref = truth(keys, values, scores, mask, wls)
    assert gram.shape == (batch, dk, dk) and cross.shape == (batch, dk, dv) and yy.shape == (batch,)
    assert gram.dtype == cross.dtype == yy.dtype == F64
    tol = EXACT16_SCORED_REL if scored else EXACT16_REL
    assert rel(gram, s_ref) <= (tol if scored and wls else EXACT16_REL)  # S is scaled only with wls
    assert rel(cross, t_ref) <= tol
    assert rel(yy, yy_ref) <= REORDER_REL  # float64 from the 16-bit values
    assert torch.equal(gram, gram.mT)


@pytest.mark.parametrize("dtype", SIXTEEN, ids=str)
def test_exact16_flushes_into_float64_every_r_rows(dtype):
    """R = 1 flushes every product (exact in float32) into float64: the float64 definition up to summation order.
    One flush over all rows sums them in float32: measurably not float64, still float32-grade."""
    keys, values, _, _ = rows(2, 600, 30, 8, scored=False, masked=False, dtype=dtype)
    s_ref, t_ref, _ = truth(keys, values, None, None, False)

    def run(r):
        return gram_modes.accumulate_gram_exact16(keys, values, None, None, weighted_least_squares=False,
                                                  compute_dtype=torch.float32, flush_rows=r)  # fmt: skip

    gram, cross, _ = run(1)
    assert rel(gram, s_ref) <= REORDER_REL and rel(cross, t_ref) <= REORDER_REL
    gram, cross, _ = run(600)
    assert REORDER_REL < rel(gram, s_ref) <= EXACT16_REL
    assert REORDER_REL < rel(cross, t_ref) <= EXACT16_REL


def test_exact16_groups_of_chunks_and_a_ragged_tail(monkeypatch):
    # Partials of at most two chunks per batched GEMM: several groups, the last one ragged.
    monkeypatch.setattr(gram_modes, "_PARTIAL_BYTES", 2 * 2 * 12 * (12 + 2 * 5) * 4)
    keys, values, scores, mask = rows(2, 203, 12, 5, scored=True, masked=True, dtype=torch.bfloat16)
    got = gram_modes.accumulate_gram_exact16(keys, values, scores, mask, weighted_least_squares=False,
                                             compute_dtype=torch.float32, flush_rows=1)  # fmt: skip
    s_ref, t_ref, yy_ref = truth(keys, values, scores, mask, False)
    assert rel(got[0], s_ref) <= REORDER_REL  # unscaled keys, R = 1: exact
    assert rel(got[1], t_ref) <= EXACT16_SCORED_REL
    assert rel(got[2], yy_ref) <= REORDER_REL


def test_exact16_fp16_scaled_rows_do_not_overflow():
    # s·v up to 4e5 exceeds fp16's 65504: the split must rescale (by a power of two) rather than overflow.
    keys = torch.randn(1, 64, 6).half()
    values = (8 * torch.randn(1, 64, 3)).half()
    scores = torch.full((1, 64), 5e4)
    for wls in (False, True):
        gram, cross, _ = gram_modes.accumulate_gram_exact16(keys, values, scores, None, weighted_least_squares=wls,
                                                            compute_dtype=torch.float32)  # fmt: skip
        s_ref, t_ref, _ = truth(keys, values, scores, None, wls)
        assert torch.isfinite(gram).all() and torch.isfinite(cross).all()
        assert rel(gram, s_ref) <= EXACT16_SCORED_REL and rel(cross, t_ref) <= EXACT16_SCORED_REL


def test_exact16_layers_are_independent():
    keys, values, scores, _ = rows(3, 50, 8, 4, scored=True, masked=False, dtype=torch.bfloat16)
    kwargs = {"weighted_least_squares": False, "compute_dtype": torch.float32, "flush_rows": 7}
    together = gram_modes.accumulate_gram_exact16(keys, values, scores, None, **kwargs)
    for b in range(3):
        alone = gram_modes.accumulate_gram_exact16(keys[b : b + 1], values[b : b + 1], scores[b : b + 1], None,
                                                   **kwargs)  # fmt: skip
        for t, a in zip(together, alone, strict=True):
            assert torch.equal(t[b], a[0])


@pytest.mark.parametrize(
    "kdtype,vdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float16), (torch.float16, torch.float32)]
)
def test_exact16_rejects_inputs_that_are_not_one_16_bit_dtype(kdtype, vdtype):
    keys, values = torch.randn(1, 8, 4).to(kdtype), torch.randn(1, 8, 3).to(vdtype)
    with pytest.raises(ValueError, match="keys, values: .*16-bit"):
        gram_modes.accumulate_gram_exact16(keys, values, None, None, weighted_least_squares=False,
                                           compute_dtype=torch.float32)  # fmt: skip
    call = Call("accumulate_gram", torch.device("cpu"), (kdtype, vdtype), options={"compute_dtype": torch.float32})
    assert "16-bit" in gram_modes.exact16_cannot_run(call)


@pytest.mark.parametrize("bad", [0, -4, 2.5, True])
def test_exact16_rejects_a_bad_flush_length(bad):
    keys = torch.randn(1, 8, 4).bfloat16()
    with pytest.raises(ValueError, match="flush_rows"):
        gram_modes.accumulate_gram_exact16(keys, keys, None, None, weighted_least_squares=False,
                                           compute_dtype=torch.float32, flush_rows=bad)  # fmt: skip


def test_exact16_gate_allows_only_float32_compute_on_a_gpu():
    def call(device, compute):
        return Call("accumulate_gram", torch.device(device), (torch.bfloat16,) * 2, options={"compute_dtype": compute})

    assert "float64 fidelity" in gram_modes.exact16_gate(call("cuda", F64))
    assert gram_modes.exact16_gate(call("cuda", torch.float32)) is None
    assert "emulation" in gram_modes.exact16_gate(call("cpu", torch.float32))
    assert gram_modes.exact16_cannot_run(call("cpu", torch.float32)) is None
    if not torch.cuda.is_available():  # a CPU build of torch has no CUDA bmm at all: said, not raised
        assert "out_dtype" in gram_modes.exact16_cannot_run(call("cuda", torch.float32))
