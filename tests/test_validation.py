"""Bad input gets a clear error (the right exception type, a message naming the argument) and leaves state untouched.

Covers faast.ops.{accumulate_gram, solve_fast_weights, residual_project, fold_readout},
faast.authors_reference.pinv_fast_weights and
faast.FastWeights (constructor, update, forget, merge, solve, forward, load_state), plus drop_nonfinite=True and the
rows that a mask excludes (which may hold anything).
"""

from __future__ import annotations

import pytest
import torch

import faast
from faast import ops
from faast.authors_reference import pinv_fast_weights
from oracles import statistics64
from tolerances import REORDER_REL, TRUTH_REL_W, rel

F32, F64, F16, BF16 = torch.float32, torch.float64, torch.float16, torch.bfloat16
NAN, INF = float("nan"), float("inf")
N, DK, DV = 6, 4, 3


# ---------------------------------------------------------------------------------------------------- helpers


def _randn(*shape: int, dtype: torch.dtype = F32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=F64).to(dtype)


def K(n: int = N, dk: int = DK, *, batch: tuple[int, ...] = (), dtype: torch.dtype = F32) -> torch.Tensor:
    return _randn(*batch, n, dk, dtype=dtype, seed=1)


def V(n: int = N, dv: int = DV, *, batch: tuple[int, ...] = (), dtype: torch.dtype = F32) -> torch.Tensor:
    return _randn(*batch, n, dv, dtype=dtype, seed=2)


def S(n: int = N, *, batch: tuple[int, ...] = (), dtype: torch.dtype = F32) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return (2 * torch.rand((*batch, n), generator=g, dtype=F64)).to(dtype)


def put(t: torch.Tensor, index: tuple[int, ...], value: float) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


def gram64(dk: int = DK, *, batch: tuple[int, ...] = ()) -> torch.Tensor:
    k = K(3 * dk, dk, batch=batch, dtype=F64)
    return k.mT @ k


def cross64(dk: int = DK, dv: int = DV, *, batch: tuple[int, ...] = ()) -> torch.Tensor:
    return K(3 * dk, dk, batch=batch, dtype=F64).mT @ V(3 * dk, dv, batch=batch, dtype=F64)


def snapshot(m: faast.FastWeights) -> tuple[dict[str, torch.Tensor], int]:
    return {name: t.clone() for name, t in m.state_dict().items()}, m.version


def assert_untouched(m: faast.FastWeights, before: tuple[dict[str, torch.Tensor], int]) -> None:
    buffers, version = before
    after = dict(m.state_dict())
    assert sorted(after) == sorted(buffers)
    for name, t in buffers.items():
        assert after[name].dtype == t.dtype and after[name].shape == t.shape, name
        assert torch.equal(after[name], t), f"buffer {name} changed by a call that raised"
    assert m.version == version, "version changed by a call that raised"


# ---------------------------------------------------------------------------------------------------- ops


def _case(id_: str, call, exc, match, *marks):
    return pytest.param(call, exc, match, id=id_, marks=marks)


ACCUMULATE_GRAM_CASES = [
    _case("keys-not-a-tensor", lambda: ops.accumulate_gram(K().tolist(), V()), TypeError, "keys"),
    _case("keys-1d", lambda: ops.accumulate_gram(K()[0], V()), ValueError, "keys"),
    _case("values-1d", lambda: ops.accumulate_gram(K(), V()[:, 0]), ValueError, "values"),
    _case("keys-no-features", lambda: ops.accumulate_gram(K(dk=0), V()), ValueError, "keys"),
    _case("values-rows-mismatch", lambda: ops.accumulate_gram(K(N), V(N - 1)), ValueError, "values"),
    _case("values-batch-mismatch", lambda: ops.accumulate_gram(K(batch=(2,)), V(batch=(3,))), ValueError, "values"),
    _case("keys-int", lambda: ops.accumulate_gram(K().to(torch.int64), V()), TypeError, "keys"),
    _case("values-bool", lambda: ops.accumulate_gram(K(), V() > 0), TypeError, "values"),
    _case("scores-int", lambda: ops.accumulate_gram(K(), V(), torch.ones(N, dtype=torch.int32)), TypeError, "scores"),
    _case("scores-wrong-length", lambda: ops.accumulate_gram(K(), V(), S(N + 1)), ValueError, "scores"),
    _case("scores-extra-dim", lambda: ops.accumulate_gram(K(), V(), S().unsqueeze(-1)), ValueError, "scores"),
    _case(
        "scores-negative", lambda: ops.accumulate_gram(K(), V(), put(S(), (3,), -0.5)), ValueError, r"scores.*\[3\]"
    ),
    _case(
        "scores-negative-batched",
        lambda: ops.accumulate_gram(K(batch=(2,)), V(batch=(2,)), put(S(batch=(2,)), (1, 4), -1.0)),
        ValueError,
        r"scores.*\[1, 4\]",
    ),
    _case("keys-nan", lambda: ops.accumulate_gram(put(K(), (2, 1), NAN), V()), ValueError, r"keys.*\[2, 1\]"),
    _case("keys-posinf", lambda: ops.accumulate_gram(put(K(), (2, 1), INF), V()), ValueError, r"keys.*\[2, 1\]"),
    _case("keys-neginf", lambda: ops.accumulate_gram(put(K(), (2, 1), -INF), V()), ValueError, r"keys.*\[2, 1\]"),
    _case("values-nan", lambda: ops.accumulate_gram(K(), put(V(), (4, 0), NAN)), ValueError, r"values.*\[4, 0\]"),
    _case("values-posinf", lambda: ops.accumulate_gram(K(), put(V(), (4, 0), INF)), ValueError, r"values.*\[4, 0\]"),
    _case("values-neginf", lambda: ops.accumulate_gram(K(), put(V(), (4, 0), -INF)), ValueError, r"values.*\[4, 0\]"),
    _case(
        "values-nan-batched",
        lambda: ops.accumulate_gram(K(batch=(2,)), put(V(batch=(2,)), (1, 3, 2), NAN)),
        ValueError,
        r"values.*\[1, 3, 2\]",
    ),
    _case("scores-nan", lambda: ops.accumulate_gram(K(), V(), put(S(), (3,), NAN)), ValueError, r"scores.*\[3\]"),
    _case("scores-posinf", lambda: ops.accumulate_gram(K(), V(), put(S(), (3,), INF)), ValueError, r"scores.*\[3\]"),
    _case("scores-neginf", lambda: ops.accumulate_gram(K(), V(), put(S(), (3,), -INF)), ValueError, r"scores.*\[3\]"),
    _case(
        "keys-overflow", lambda: ops.accumulate_gram(torch.full((N, DK), 1e200, dtype=F64), V()), ValueError, "keys"
    ),
    _case(
        "values-overflow",
        lambda: ops.accumulate_gram(K(), torch.full((N, DV), 1e200, dtype=F64)),
        ValueError,
        "values",
    ),
    _case("mask-float", lambda: ops.accumulate_gram(K(), V(), mask=torch.ones(N)), TypeError, "mask"),
    _case(
        "mask-uint8", lambda: ops.accumulate_gram(K(), V(), mask=torch.ones(N, dtype=torch.uint8)), TypeError, "mask"
    ),
    _case(
        "mask-wrong-shape",
        lambda: ops.accumulate_gram(K(), V(), mask=torch.ones(N + 1, dtype=torch.bool)),
        ValueError,
        "mask",
    ),
    _case("gram-fp16", lambda: ops.accumulate_gram(K(), V(), gram=torch.zeros(DK, DK, dtype=F16)), TypeError, "gram"),
    _case("gram-bf16", lambda: ops.accumulate_gram(K(), V(), gram=torch.zeros(DK, DK, dtype=BF16)), TypeError, "gram"),
    _case(
        "cross-fp16", lambda: ops.accumulate_gram(K(), V(), cross=torch.zeros(DK, DV, dtype=F16)), TypeError, "cross"
    ),
    _case(
        "cross-bf16", lambda: ops.accumulate_gram(K(), V(), cross=torch.zeros(DK, DV, dtype=BF16)), TypeError, "cross"
    ),
    _case(
        "target_sqnorm-bf16",
        lambda: ops.accumulate_gram(K(), V(), target_sqnorm=torch.zeros((), dtype=BF16)),
        TypeError,
        "target_sqnorm",
    ),
    _case("gram-not-a-tensor", lambda: ops.accumulate_gram(K(), V(), gram=[[0.0] * DK] * DK), TypeError, "gram"),
    _case(
        "gram-wrong-shape",
        lambda: ops.accumulate_gram(K(), V(), gram=torch.zeros(DK, DK + 1, dtype=F64)),
        ValueError,
        "gram",
    ),
    _case(
        "gram-wrong-batch",
        lambda: ops.accumulate_gram(K(), V(), gram=torch.zeros(2, DK, DK, dtype=F64)),
        ValueError,
        "gram",
    ),
    _case(
        "cross-wrong-shape",
        lambda: ops.accumulate_gram(K(), V(), cross=torch.zeros(DK, DV + 1, dtype=F64)),
        ValueError,
        "cross",
    ),
    _case(
        "target_sqnorm-wrong-shape",
        lambda: ops.accumulate_gram(K(), V(), target_sqnorm=torch.zeros(1, dtype=F64)),
        ValueError,
        "target_sqnorm",
    ),
    _case("compute_dtype-fp16", lambda: ops.accumulate_gram(K(), V(), compute_dtype=F16), TypeError, "compute_dtype"),
    _case("values-on-meta", lambda: ops.accumulate_gram(K(), V().to("meta")), ValueError, "values"),
    _case("scores-on-meta", lambda: ops.accumulate_gram(K(), V(), S().to("meta")), ValueError, "scores"),
    _case(
        "mask-on-meta",
        lambda: ops.accumulate_gram(K(), V(), mask=torch.ones(N, dtype=torch.bool, device="meta")),
        ValueError,
        "mask",
    ),
    _case(
        "gram-on-meta",
        lambda: ops.accumulate_gram(K(), V(), gram=torch.zeros(DK, DK, dtype=F64, device="meta")),
        ValueError,
        "gram",
    ),
    _case(
        "keys-on-meta-gram-on-cpu",
        lambda: ops.accumulate_gram(K().to("meta"), V().to("meta"), gram=torch.zeros(DK, DK, dtype=F64)),
        ValueError,
        "gram",
    ),
    _case(
        "keys-scores-on-meta-gram-on-cpu",
        lambda: ops.accumulate_gram(
            K().to("meta"), V().to("meta"), S().to("meta"), gram=torch.zeros(DK, DK, dtype=F64)
        ),
        ValueError,
        "gram",
    ),
]


@pytest.mark.parametrize(("call", "exc", "match"), ACCUMULATE_GRAM_CASES)
def test_accumulate_gram_rejects(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def _accumulators(batch=()):
    return {
        "gram": gram64(batch=batch),
        "cross": cross64(batch=batch),
        "target_sqnorm": torch.full(batch, 7.0, dtype=F64),
    }


ACCUMULATOR_SAFETY_CASES = [
    pytest.param(lambda: (put(K(), (5, 3), NAN), V(), None, None), ValueError, "keys", id="keys-nan-last-row"),
    pytest.param(lambda: (put(K(), (0, 0), INF), V(), None, None), ValueError, "keys", id="keys-inf-first-row"),
    pytest.param(lambda: (K(), put(V(), (5, 2), -INF), None, None), ValueError, "values", id="values-neginf"),
    pytest.param(lambda: (K(), V(), put(S(), (5,), NAN), None), ValueError, "scores", id="scores-nan"),
    pytest.param(lambda: (K(), V(), put(S(), (2,), -1.0), None), ValueError, "scores", id="scores-negative"),
    pytest.param(lambda: (K(dtype=F64) * 1e200, V(dtype=F64), None, None), ValueError, "keys", id="keys-overflow"),
    pytest.param(lambda: (K(), V(), None, torch.ones(N)), TypeError, "mask", id="mask-float"),
    pytest.param(lambda: (K(dk=DK + 1), V(), None, None), ValueError, "gram", id="keys-wider-than-gram"),
]


@pytest.mark.parametrize("acc_dtype", [F64, F32], ids=["float64-acc", "float32-acc"])
@pytest.mark.parametrize(("make", "exc", "match"), ACCUMULATOR_SAFETY_CASES)
def test_accumulate_gram_leaves_accumulators_untouched(make, exc, match, acc_dtype):
    keys, values, scores, mask = make()
    acc = {name: t.to(acc_dtype) for name, t in _accumulators().items()}
    before = {name: t.clone() for name, t in acc.items()}
    with pytest.raises(exc, match=match):
        ops.accumulate_gram(keys, values, scores, mask=mask, **acc)
    for name, t in acc.items():
        assert torch.equal(t, before[name]), f"{name} was modified by a call that raised"


def test_accumulate_gram_shape_error_on_cross_leaves_gram_untouched():
    gram = gram64()
    before = gram.clone()
    with pytest.raises(ValueError, match="cross"):
        ops.accumulate_gram(K(), V(), gram=gram, cross=torch.zeros(DK, DV + 1, dtype=F64))
    assert torch.equal(gram, before)


@pytest.mark.parametrize("bad", ["cross", "target_sqnorm"])
def test_accumulate_gram_rejects_an_unwritable_accumulator_before_touching_the_others(bad):
    batch = (2,)
    acc = _accumulators(batch)
    acc[bad] = acc[bad][0].expand_as(acc[bad])  # e.g. torch.zeros(dk, dv).expand(L, dk, dv): one shared buffer
    before = {name: t.clone() for name, t in acc.items()}
    with pytest.raises(ValueError, match=bad):
        ops.accumulate_gram(K(batch=batch), V(batch=batch), **acc)
    for name, t in acc.items():
        assert torch.equal(t, before[name]), f"{name} was modified by a call that raised"


@pytest.mark.parametrize("batch", [(), (2,)], ids=["unbatched", "batch2"])
@pytest.mark.parametrize(
    "poison",
    ["keys-nan", "values-inf", "scores-nan", "scores-negative", "scores-neginf"],
)
def test_accumulate_gram_ignores_masked_out_rows(poison, batch):
    keys, values, scores = K(batch=batch), V(batch=batch), S(batch=batch)
    row = (*([0] * len(batch)), 2)
    if poison == "keys-nan":
        keys = put(keys, (*row, 1), NAN)
    elif poison == "values-inf":
        values = put(values, (*row, 0), INF)
    elif poison == "scores-nan":
        scores = put(scores, row, NAN)
    elif poison == "scores-negative":
        scores = put(scores, row, -3.0)
    else:
        scores = put(scores, row, -INF)
    mask = put(torch.ones((*batch, N), dtype=torch.bool), row, False)
    mask[..., 4] = False
    sqnorm = torch.zeros(batch, dtype=F64)
    gram, cross = ops.accumulate_gram(keys, values, scores, mask=mask, target_sqnorm=sqnorm)
    ref_gram, ref_cross, _, ref_sqnorm = statistics64(keys, values, scores, mask)
    assert rel(gram, ref_gram) <= REORDER_REL
    assert rel(cross, ref_cross) <= REORDER_REL
    assert rel(sqnorm, ref_sqnorm) <= REORDER_REL


SOLVE_CASES = [
    _case(
        "gram-not-a-tensor", lambda: ops.solve_fast_weights(gram64().tolist(), cross64(), count=N), TypeError, "gram"
    ),
    _case("gram-int", lambda: ops.solve_fast_weights(gram64().to(torch.int64), cross64(), count=N), TypeError, "gram"),
    _case("gram-fp16", lambda: ops.solve_fast_weights(gram64().to(F16), cross64(), count=N), TypeError, "gram"),
    _case("gram-bf16", lambda: ops.solve_fast_weights(gram64().to(BF16), cross64(), count=N), TypeError, "gram"),
    _case("cross-fp16", lambda: ops.solve_fast_weights(gram64(), cross64().to(F16), count=N), TypeError, "cross"),
    _case("cross-bf16", lambda: ops.solve_fast_weights(gram64(), cross64().to(BF16), count=N), TypeError, "cross"),
    _case("gram-1d", lambda: ops.solve_fast_weights(gram64()[0], cross64(), count=N), ValueError, "gram"),
    _case("gram-not-square", lambda: ops.solve_fast_weights(gram64()[:, :-1], cross64(), count=N), ValueError, "gram"),
    _case(
        "cross-wrong-dim_key",
        lambda: ops.solve_fast_weights(gram64(), cross64(dk=DK + 1), count=N),
        ValueError,
        "cross",
    ),
    _case(
        "cross-batch-mismatch",
        lambda: ops.solve_fast_weights(gram64(batch=(2,)), cross64(batch=(3,)), count=N),
        ValueError,
        "cross",
    ),
    _case("cross-no-columns", lambda: ops.solve_fast_weights(gram64(), cross64(dv=0), count=N), ValueError, "cross"),
    _case(
        "gram-nan",
        lambda: ops.solve_fast_weights(put(gram64(), (1, 2), NAN), cross64(), count=N),
        ValueError,
        r"gram.*\[1, 2\]",
    ),
    _case(
        "gram-inf",
        lambda: ops.solve_fast_weights(put(gram64(), (3, 0), INF), cross64(), count=N),
        ValueError,
        r"gram.*\[3, 0\]",
    ),
    _case(
        "cross-neginf",
        lambda: ops.solve_fast_weights(gram64(), put(cross64(), (0, 1), -INF), count=N),
        ValueError,
        r"cross.*\[0, 1\]",
    ),
    _case(
        "cross-on-meta", lambda: ops.solve_fast_weights(gram64(), cross64().to("meta"), count=N), ValueError, "cross"
    ),
    _case("count-negative", lambda: ops.solve_fast_weights(gram64(), cross64(), count=-1), ValueError, "count"),
    _case("count-nan", lambda: ops.solve_fast_weights(gram64(), cross64(), count=NAN), ValueError, "count"),
    _case("count-inf", lambda: ops.solve_fast_weights(gram64(), cross64(), count=INF), ValueError, "count"),
    _case(
        "count-tensor-negative",
        lambda: ops.solve_fast_weights(gram64(batch=(2,)), cross64(batch=(2,)), count=torch.tensor([3.0, -1.0])),
        ValueError,
        "count",
    ),
    _case(
        "count-tensor-nan",
        lambda: ops.solve_fast_weights(gram64(batch=(2,)), cross64(batch=(2,)), count=torch.tensor([3.0, NAN])),
        ValueError,
        "count",
    ),
    _case(
        "count-wrong-shape",
        lambda: ops.solve_fast_weights(gram64(batch=(2,)), cross64(batch=(2,)), count=torch.tensor([1.0, 2.0, 3.0])),
        ValueError,
        "count",
    ),
    _case(
        "count-bool-tensor",
        lambda: ops.solve_fast_weights(gram64(), cross64(), count=torch.tensor(True)),
        TypeError,
        "count",
    ),
    _case("count-bool", lambda: ops.solve_fast_weights(gram64(), cross64(), count=True), TypeError, "count"),
    _case("count-str", lambda: ops.solve_fast_weights(gram64(), cross64(), count="6"), TypeError, "count"),
    _case(
        "alpha-negative", lambda: ops.solve_fast_weights(gram64(), cross64(), count=N, alpha=-1.0), ValueError, "alpha"
    ),
    _case("alpha-nan", lambda: ops.solve_fast_weights(gram64(), cross64(), count=N, alpha=NAN), ValueError, "alpha"),
    _case(
        "alpha-bad-string",
        lambda: ops.solve_fast_weights(gram64(), cross64(), count=N, alpha="fast"),
        ValueError,
        "alpha",
    ),
    _case("alpha-bool", lambda: ops.solve_fast_weights(gram64(), cross64(), count=N, alpha=True), TypeError, "alpha"),
    _case(
        "rtol-negative", lambda: ops.solve_fast_weights(gram64(), cross64(), count=N, rtol=-0.1), ValueError, "rtol"
    ),
    _case(
        "rtol-with-alpha-auto",
        lambda: ops.solve_fast_weights(
            gram64(), cross64(), count=N, alpha="auto", rtol=0.1, target_sqnorm=torch.tensor(1.0, dtype=F64)
        ),
        ValueError,
        "rtol",
    ),
    _case(
        "ridge-with-rtol",
        lambda: ops.solve_fast_weights(gram64(), cross64(), count=N, ridge=0.1, rtol=0.1),
        ValueError,
        "ridge",
    ),
    _case(
        "ridge-with-alpha-auto",
        lambda: ops.solve_fast_weights(
            gram64(), cross64(), count=N, ridge=0.1, alpha="auto", target_sqnorm=torch.tensor(1.0, dtype=F64)
        ),
        ValueError,
        "ridge",
    ),
    _case(
        "ridge-negative", lambda: ops.solve_fast_weights(gram64(), cross64(), count=N, ridge=-1.0), ValueError, "ridge"
    ),
    _case(
        "ridge-bad-string",
        lambda: ops.solve_fast_weights(gram64(), cross64(), count=N, ridge="gcv"),
        ValueError,
        "ridge",
    ),
    _case(
        "alpha-auto-without-target_sqnorm",
        lambda: ops.solve_fast_weights(gram64(), cross64(), count=N, alpha="auto"),
        ValueError,
        "target_sqnorm",
    ),
    _case(
        "ridge-auto-without-target_sqnorm",
        lambda: ops.solve_fast_weights(gram64(), cross64(), count=N, ridge="auto"),
        ValueError,
        "target_sqnorm",
    ),
    _case(
        "target_sqnorm-wrong-shape",
        lambda: ops.solve_fast_weights(
            gram64(), cross64(), count=N, alpha="auto", target_sqnorm=torch.ones(2, dtype=F64)
        ),
        ValueError,
        "target_sqnorm",
    ),
    _case(
        "target_sqnorm-bf16",
        lambda: ops.solve_fast_weights(
            gram64(), cross64(), count=N, alpha="auto", target_sqnorm=torch.ones((), dtype=BF16)
        ),
        TypeError,
        "target_sqnorm",
    ),
]


@pytest.mark.parametrize(("call", "exc", "match"), SOLVE_CASES)
def test_solve_fast_weights_rejects(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


RESIDUAL_PROJECT_CASES = [
    _case("x-not-a-tensor", lambda: ops.residual_project([1.0, 2.0], torch.eye(2)), TypeError, "x"),
    _case("x-int", lambda: ops.residual_project(torch.ones(4, 3, dtype=torch.int32), torch.eye(3)), TypeError, "x"),
    _case("m-bool", lambda: ops.residual_project(torch.ones(4, 3), torch.eye(3) > 0), TypeError, "m"),
    _case("x-0d", lambda: ops.residual_project(torch.tensor(1.0), torch.eye(1)), ValueError, "x"),
    _case("m-not-square", lambda: ops.residual_project(torch.ones(4, 3), torch.ones(3, 4)), ValueError, "m"),
    _case("m-wrong-width", lambda: ops.residual_project(torch.ones(4, 3), torch.eye(4)), ValueError, "m"),
    _case(
        "m-batched", lambda: ops.residual_project(torch.ones(2, 4, 3), torch.eye(3).expand(2, 3, 3)), ValueError, "m"
    ),
    _case("m-on-meta", lambda: ops.residual_project(torch.ones(4, 3), torch.eye(3, device="meta")), ValueError, "m"),
]


@pytest.mark.parametrize(("call", "exc", "match"), RESIDUAL_PROJECT_CASES)
def test_residual_project_rejects(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


FOLD_READOUT_CASES = [
    _case("weights-not-a-tensor", lambda: ops.fold_readout([[1.0]], torch.ones(1, 2)), TypeError, "weights"),
    _case(
        "weights-int",
        lambda: ops.fold_readout(torch.ones(DK, DV, dtype=torch.int64), torch.ones(DV, 5)),
        TypeError,
        "weights",
    ),
    _case("readout-bool", lambda: ops.fold_readout(torch.ones(DK, DV), torch.ones(DV, 5) > 0), TypeError, "readout"),
    _case("weights-1d", lambda: ops.fold_readout(torch.ones(DV), torch.ones(DV, 5)), ValueError, "weights"),
    _case("readout-1d", lambda: ops.fold_readout(torch.ones(DK, DV), torch.ones(DV)), ValueError, "readout"),
    _case(
        "readout-wrong-dim_value",
        lambda: ops.fold_readout(torch.ones(DK, DV), torch.ones(DV + 1, 5)),
        ValueError,
        "readout",
    ),
    _case(
        "readout-on-meta",
        lambda: ops.fold_readout(torch.ones(DK, DV), torch.ones(DV, 5, device="meta")),
        ValueError,
        "readout",
    ),
    _case(
        "readout-batch-mismatch",
        lambda: ops.fold_readout(torch.ones(2, DK, DV), torch.ones(3, DV, 5)),
        ValueError,
        "readout",
    ),
]


@pytest.mark.parametrize(("call", "exc", "match"), FOLD_READOUT_CASES)
def test_fold_readout_rejects(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


PINV_CASES = [
    _case("keys-1d", lambda: pinv_fast_weights(K()[0], V(), 0.1), ValueError, "keys"),
    _case("keys-int", lambda: pinv_fast_weights(K().to(torch.int32), V(), 0.1), TypeError, "keys"),
    _case("values-bool", lambda: pinv_fast_weights(K(), V() > 0, 0.1), TypeError, "values"),
    _case("values-rows-mismatch", lambda: pinv_fast_weights(K(N), V(N + 1), 0.1), ValueError, "values"),
    _case("values-batch-mismatch", lambda: pinv_fast_weights(K(batch=(2,)), V(batch=(3,)), 0.1), ValueError, "values"),
    _case("scores-wrong-shape", lambda: pinv_fast_weights(K(), V(), 0.1, S(N - 1)), ValueError, "scores"),
    _case(
        "scores-negative",
        lambda: pinv_fast_weights(K(), V(), 0.1, put(S(), (1,), -2.0)),
        ValueError,
        r"scores.*\[1\]",
    ),
    _case("values-on-meta", lambda: pinv_fast_weights(K(), V().to("meta"), 0.1), ValueError, "values"),
    _case("rtol-negative", lambda: pinv_fast_weights(K(), V(), -0.1), ValueError, "rtol"),
    _case("rtol-nan", lambda: pinv_fast_weights(K(), V(), NAN), ValueError, "rtol"),
    _case("rtol-string", lambda: pinv_fast_weights(K(), V(), "auto"), TypeError, "rtol"),
    _case(
        "rtol-tensor-wrong-shape",
        lambda: pinv_fast_weights(K(batch=(2,)), V(batch=(2,)), torch.tensor([0.1, 0.2, 0.3])),
        ValueError,
        "rtol",
    ),
    _case(
        "keys-nan",
        lambda: pinv_fast_weights(put(K(), (2, 1), NAN), V(), 0.1),
        ValueError,
        r"keys.*\[2, 1\]",
    ),
    _case(
        "values-inf",
        lambda: pinv_fast_weights(K(), put(V(), (3, 1), INF), 0.1),
        ValueError,
        r"values.*\[3, 1\]",
    ),
]


@pytest.mark.parametrize(("call", "exc", "match"), PINV_CASES)
def test_pinv_fast_weights_rejects(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_pinv_fast_weights_accepts_a_tensor_rtol_of_the_batch_shape():
    keys, values = K(8, batch=(2,), dtype=F64), V(8, batch=(2,), dtype=F64)
    rtol = torch.tensor([0.05, 0.3], dtype=F64)
    weights = pinv_fast_weights(keys, values, rtol)
    for b in range(2):
        expected = torch.linalg.pinv(keys[b], atol=0.0, rtol=float(rtol[b])) @ values[b]
        assert rel(weights[b], expected) <= TRUTH_REL_W


# ---------------------------------------------------------------------------------------------------- FastWeights()


CONSTRUCTOR_CASES = [
    _case("dim_key-zero", lambda: faast.FastWeights(0, DV), ValueError, "dim_key"),
    _case("dim_key-float", lambda: faast.FastWeights(4.0, DV), TypeError, "dim_key"),
    _case("dim_value-negative", lambda: faast.FastWeights(DK, -1), ValueError, "dim_value"),
    _case("batch_shape-zero", lambda: faast.FastWeights(DK, DV, batch_shape=(0,)), ValueError, "batch_shape"),
    _case(
        "batch_shape-fractional",
        lambda: faast.FastWeights(DK, DV, batch_shape=(2.5,)),
        TypeError,
        "batch_shape",
    ),
    _case("alpha-negative", lambda: faast.FastWeights(DK, DV, alpha=-0.5), ValueError, "alpha"),
    _case("alpha-bad-string", lambda: faast.FastWeights(DK, DV, alpha="gcv"), ValueError, "alpha"),
    _case("rtol-with-alpha-auto", lambda: faast.FastWeights(DK, DV, alpha="auto", rtol=0.1), ValueError, "rtol"),
    _case("ridge-with-rtol", lambda: faast.FastWeights(DK, DV, rtol=0.1, ridge=1.0), ValueError, "ridge"),
    _case("ridge-bad-string", lambda: faast.FastWeights(DK, DV, ridge="gcv"), ValueError, "ridge"),
    _case("prior_count-without-prior", lambda: faast.FastWeights(DK, DV, prior_count=2.0), ValueError, "prior_count"),
    _case(
        "prior_count-negative",
        lambda: faast.FastWeights(DK, DK, prior="identity", prior_count=-1.0),
        ValueError,
        "prior_count",
    ),
    _case(
        "prior-identity-not-square",
        lambda: faast.FastWeights(DK, DV, prior="identity", prior_count=1.0),
        ValueError,
        "prior",
    ),
    _case("prior-bad-string", lambda: faast.FastWeights(DK, DK, prior="eye"), ValueError, "prior"),
    _case(
        "prior-wrong-shape",
        lambda: faast.FastWeights(DK, DV, prior=torch.zeros(DV, DK), prior_count=1.0),
        ValueError,
        "prior",
    ),
    _case(
        "prior-int",
        lambda: faast.FastWeights(DK, DV, prior=torch.zeros(DK, DV, dtype=torch.int64)),
        TypeError,
        "prior",
    ),
    _case(
        "prior-nan",
        lambda: faast.FastWeights(DK, DV, prior=put(torch.zeros(DK, DV), (1, 2), NAN), prior_count=1.0),
        ValueError,
        r"prior.*\[1, 2\]",
    ),
    _case("discount-zero", lambda: faast.FastWeights(DK, DV, discount=0.0), ValueError, "discount"),
    _case("discount-above-one", lambda: faast.FastWeights(DK, DV, discount=1.5), ValueError, "discount"),
    _case("discount-nan", lambda: faast.FastWeights(DK, DV, discount=NAN), ValueError, "discount"),
    _case("mode-unknown", lambda: faast.FastWeights(DK, DV, mode="capped"), ValueError, "mode"),
    _case(
        "blend-with-discount", lambda: faast.FastWeights(DK, DV, mode="blend", discount=0.9), ValueError, "discount"
    ),
    _case(
        "blend-with-drop_nonfinite",
        lambda: faast.FastWeights(DK, DV, mode="blend", drop_nonfinite=True),
        ValueError,
        "drop_nonfinite",
    ),
    _case(
        "blend_window-below-chunk",
        lambda: faast.FastWeights(DK, DV, mode="blend", blend_window=4, blend_chunk=8),
        ValueError,
        "blend_window",
    ),
    _case(
        "blend_chunk-zero", lambda: faast.FastWeights(DK, DV, mode="blend", blend_chunk=0), ValueError, "blend_chunk"
    ),
    _case(
        "blend_discount-zero",
        lambda: faast.FastWeights(DK, DV, mode="blend", blend_discount=0.0),
        ValueError,
        "blend_discount",
    ),
    _case("compute_dtype-fp16", lambda: faast.FastWeights(DK, DV, compute_dtype=F16), TypeError, "compute_dtype"),
    _case("dtype-int", lambda: faast.FastWeights(DK, DV, dtype=torch.int64), TypeError, "dtype"),
]


@pytest.mark.parametrize(("call", "exc", "match"), CONSTRUCTOR_CASES)
def test_fastweights_constructor_rejects(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# ------------------------------------------------------------------------------------------------ FastWeights methods


def _memory(kind: str) -> faast.FastWeights:
    """A memory that already holds data, so that 'untouched' is a meaningful check."""
    if kind == "exact":
        m = faast.FastWeights(DK, DV)
        m.update(K(10), V(10), S(10))
    elif kind == "discount":
        m = faast.FastWeights(DK, DV, discount=0.9)
        m.update(K(10), V(10))
        m.update(K(4), V(4))
    elif kind == "batched":
        m = faast.FastWeights(DK, DV, batch_shape=(2,))
        m.update(K(10, batch=(2,)), V(10, batch=(2,)), S(10, batch=(2,)))
    elif kind == "prior":
        m = faast.FastWeights(DK, DV, prior=torch.ones(DK, DV), prior_count=3.0, drop_nonfinite=True)
        m.update(put(K(10), (0, 0), NAN), V(10))
    elif kind == "blend":
        m = faast.FastWeights(DK, DV, mode="blend", blend_window=8, blend_chunk=4)
        m.update(K(10), V(10))
    else:
        raise AssertionError(kind)
    m.weights  # noqa: B018 - fill the cache, so that a failed call cannot hide behind an empty one
    return m


def _batch_of(m: faast.FastWeights) -> tuple[int, ...]:
    return m.batch_shape


def _kv(m, n=N, dk=DK, dv=DV, dtype=F32):
    b = _batch_of(m)
    return K(n, dk, batch=b, dtype=dtype), V(n, dv, batch=b, dtype=dtype)


def _rows_index(m, *rest):
    return (*([len(m.batch_shape) and 1] * len(m.batch_shape)), *rest)


def _update_with(fn):
    """Update with the (keys, values, scores, mask) that fn(memory) returns."""

    def call(m, tmp_path):
        keys, values, scores, mask = fn(m)
        m.update(keys, values, scores, mask=mask)

    return call


def _forget_with(fn):
    def call(m, tmp_path):
        keys, values, scores, mask = fn(m)
        m.forget(keys, values, scores, mask=mask)

    return call


def _bad_rows(what: str):
    """(keys, values, scores, mask) for memory m with one defect."""

    def make(m):
        keys, values = _kv(m)
        b = m.batch_shape
        scores, mask = S(batch=b), None
        i = _rows_index(m, 2)
        if what == "keys-1d":
            keys = K()[0]
        elif what == "keys-wrong-dim_key":
            keys = K(dk=DK + 1, batch=b)
        elif what == "values-wrong-dim_value":
            values = V(dv=DV + 1, batch=b)
        elif what == "values-rows-mismatch":
            values = V(N - 1, batch=b)
        elif what == "keys-batch-mismatch":
            keys, values, scores = K(batch=(3,)), V(batch=(3,)), S(batch=(3,))
        elif what == "keys-int":
            keys = keys.to(torch.int64)
        elif what == "values-bool":
            values = values > 0
        elif what == "scores-wrong-shape":
            scores = S(N + 1, batch=b)
        elif what == "scores-negative":
            scores = put(scores, i, -0.25)
        elif what == "keys-nan":
            keys = put(keys, (*i, 1), NAN)
        elif what == "keys-posinf":
            keys = put(keys, (*i, 1), INF)
        elif what == "keys-neginf":
            keys = put(keys, (*i, 1), -INF)
        elif what == "values-nan":
            values = put(values, (*i, 0), NAN)
        elif what == "values-posinf":
            values = put(values, (*i, 0), INF)
        elif what == "values-neginf":
            values = put(values, (*i, 0), -INF)
        elif what == "scores-nan":
            scores = put(scores, i, NAN)
        elif what == "scores-posinf":
            scores = put(scores, i, INF)
        elif what == "keys-overflow":
            keys = keys.to(F64) * 1e200
        elif what == "mask-float":
            mask = torch.ones((*b, N))
        elif what == "mask-wrong-shape":
            mask = torch.ones((*b, N + 1), dtype=torch.bool)
        elif what == "keys-values-on-meta":
            keys, values, scores = keys.to("meta"), values.to("meta"), None
        elif what == "keys-values-scores-on-meta":
            keys, values, scores = keys.to("meta"), values.to("meta"), scores.to("meta")
        elif what == "values-on-meta":
            values = values.to("meta")
        else:
            raise AssertionError(what)
        return keys, values, scores, mask

    return make


# (defect, exception, match): the message must name the offending argument (and the index for non-finite input).
ROW_DEFECTS = [
    ("keys-1d", ValueError, "keys"),
    ("keys-wrong-dim_key", ValueError, "keys"),
    ("values-wrong-dim_value", ValueError, "values"),
    ("values-rows-mismatch", ValueError, "values"),
    ("keys-batch-mismatch", ValueError, "keys"),
    ("keys-int", TypeError, "keys"),
    ("values-bool", TypeError, "values"),
    ("scores-wrong-shape", ValueError, "scores"),
    ("scores-negative", ValueError, "scores"),
    ("keys-nan", ValueError, "keys"),
    ("keys-posinf", ValueError, "keys"),
    ("keys-neginf", ValueError, "keys"),
    ("values-nan", ValueError, "values"),
    ("values-posinf", ValueError, "values"),
    ("values-neginf", ValueError, "values"),
    ("scores-nan", ValueError, "scores"),
    ("scores-posinf", ValueError, "scores"),
    ("keys-overflow", ValueError, "keys"),
    ("mask-float", TypeError, "mask"),
    ("mask-wrong-shape", ValueError, "mask"),
    ("keys-values-on-meta", ValueError, "keys"),
    ("values-on-meta", ValueError, "values"),
    ("keys-values-scores-on-meta", ValueError, "keys"),
]
# Defects a memory with drop_nonfinite=True drops instead of raising.
_DROPPED = {
    "keys-nan",
    "keys-posinf",
    "keys-neginf",
    "values-nan",
    "values-posinf",
    "values-neginf",
    "scores-nan",
    "scores-posinf",
}


def _method_cases():
    cases = []
    for kind in ("exact", "discount", "batched", "prior", "blend"):
        for defect, exc, match in ROW_DEFECTS:
            if kind == "prior" and defect in _DROPPED:
                continue
            if kind != "batched" and defect == "keys-batch-mismatch":
                continue  # only a batched memory has a batch shape to mismatch ([3, N, dk] vs (2,))
            cases.append(pytest.param(kind, _update_with(_bad_rows(defect)), exc, match, id=f"{kind}-update-{defect}"))
    for kind in ("exact", "batched"):
        for defect, exc, match in [
            ("keys-wrong-dim_key", ValueError, "keys"),
            ("values-wrong-dim_value", ValueError, "values"),
            ("keys-nan", ValueError, "keys"),
            ("values-posinf", ValueError, "values"),
            ("scores-nan", ValueError, "scores"),
            ("scores-negative", ValueError, "scores"),
            ("keys-overflow", ValueError, "keys"),
            ("keys-values-on-meta", ValueError, "keys"),
        ]:
            cases.append(pytest.param(kind, _forget_with(_bad_rows(defect)), exc, match, id=f"{kind}-forget-{defect}"))
    return cases


def _forget_too_many(m, tmp_path):
    n = int(m.count.max()) + 1  # one row more than the memory holds (10 rows, or 0.9 * 10 + 4 with the discount)
    m.forget(K(n), V(n))


def _forget_masked_too_many(m, tmp_path):
    # batch element 0 learned 10 rows; forgetting 11 from it must fail although element 1 forgets only 1.
    mask = torch.zeros(2, 11, dtype=torch.bool)
    mask[0] = True
    mask[1, 0] = True
    m.forget(K(11, batch=(2,)), V(11, batch=(2,)), mask=mask)


def _forget_blend(m, tmp_path):
    m.forget(K(2), V(2))


def _merge_with(**config):
    def call(m, tmp_path):
        other = faast.FastWeights(**{"dim_key": DK, "dim_value": DV, "batch_shape": m.batch_shape, **config})
        other.update(*_kv(other, 3, other.dim_key, other.dim_value))
        m.merge(other)

    return call


def _merge_not_a_memory(m, tmp_path):
    m.merge({"gram": m.gram, "cross": m.cross})


def _merge_blend(m, tmp_path):
    other = faast.FastWeights(DK, DV, batch_shape=m.batch_shape, mode="blend", blend_window=8, blend_chunk=4)
    other.update(*_kv(other, 3))
    m.merge(other)


def _solve(**options):
    def call(m, tmp_path):
        m.solve(**options)

    return call


def _forward(query_fn):
    def call(m, tmp_path):
        m(query_fn(m))

    return call


def _saved(path, **config):
    m = faast.FastWeights(**{"dim_key": DK, "dim_value": DV, **config})
    m.update(*_kv(m, 5, m.dim_key, m.dim_value))
    return m.save(path)


def _load_state(**config):
    def call(m, tmp_path):
        m.load_state(_saved(tmp_path / "other.safetensors", **config))

    return call


def _load_state_corrupted(m, tmp_path):
    path = _saved(tmp_path / "mem.safetensors")
    blob = bytearray(path.read_bytes())
    blob[-3] ^= 0xFF
    path.write_bytes(bytes(blob))
    m.load_state(path)


def _load_state_missing(m, tmp_path):
    m.load_state(tmp_path / "missing.safetensors")


OTHER_METHOD_CASES = [
    pytest.param(
        "exact", _forget_too_many, ValueError, r"keys.*forget would remove", id="exact-forget-count-going-negative"
    ),
    pytest.param(
        "discount",
        _forget_too_many,
        ValueError,
        r"keys.*forget would remove",
        id="discount-forget-count-going-negative",
    ),
    pytest.param(
        "batched",
        _forget_masked_too_many,
        ValueError,
        r"keys.*forget would remove",
        id="batched-forget-one-element-negative",
    ),
    pytest.param("blend", _forget_blend, ValueError, "forget", id="blend-forget"),
    pytest.param("exact", _merge_not_a_memory, TypeError, "other", id="exact-merge-not-a-memory"),
    pytest.param("exact", _merge_with(dim_key=DK + 1), ValueError, "other.*dim_key", id="exact-merge-dim_key"),
    pytest.param("exact", _merge_with(dim_value=DV + 1), ValueError, "other.*dim_value", id="exact-merge-dim_value"),
    pytest.param(
        "exact", _merge_with(batch_shape=(2,)), ValueError, "other.*batch_shape", id="exact-merge-batch_shape"
    ),
    pytest.param(
        "batched", _merge_with(batch_shape=(3,)), ValueError, "other.*batch_shape", id="batched-merge-batch_shape"
    ),
    pytest.param(
        "exact",
        _merge_with(weighted_least_squares=True),
        ValueError,
        "other.*weighted_least_squares",
        id="exact-merge-weighted",
    ),
    pytest.param("exact", _merge_blend, ValueError, "mode='exact'", id="exact-merge-blend-other"),
    pytest.param("blend", _merge_with(), ValueError, "mode='exact'", id="blend-merge-into-blend"),
    pytest.param("exact", _solve(alpha=-1.0), ValueError, "alpha", id="exact-solve-alpha-negative"),
    pytest.param("exact", _solve(alpha="gcv"), ValueError, "alpha", id="exact-solve-alpha-bad-string"),
    pytest.param("exact", _solve(alpha="auto", rtol=0.1), ValueError, "rtol", id="exact-solve-rtol-with-alpha-auto"),
    pytest.param("exact", _solve(rtol=0.1, ridge=1.0), ValueError, "ridge", id="exact-solve-ridge-with-rtol"),
    pytest.param("exact", _solve(rtol=-0.1), ValueError, "rtol", id="exact-solve-rtol-negative"),
    pytest.param("batched", _solve(ridge=-1.0), ValueError, "ridge", id="batched-solve-ridge-negative"),
    pytest.param("blend", _solve(alpha=-1.0), ValueError, "alpha", id="blend-solve-alpha-negative"),
    pytest.param(
        "exact", _forward(lambda m: torch.ones(5, DK + 1)), ValueError, "query", id="exact-forward-query-width"
    ),
    pytest.param(
        "batched", _forward(lambda m: torch.ones(2, 5, DK - 1)), ValueError, "query", id="batched-forward-query-width"
    ),
    pytest.param(
        "exact",
        _forward(lambda m: torch.ones(5, DK, dtype=torch.int64)),
        TypeError,
        "query",
        id="exact-forward-query-int",
    ),
    pytest.param(
        "exact", _forward(lambda m: torch.ones(5, DK).tolist()), TypeError, "query", id="exact-forward-query-list"
    ),
    pytest.param(
        "exact",
        _forward(lambda m: torch.ones(5, DK, device="meta")),
        ValueError,
        "query",
        id="exact-forward-query-on-meta",
    ),
    # Found as a bug (the query was silently regrouped); fixed in memory.py forward.
    pytest.param(
        "batched",
        _forward(lambda m: torch.ones(3, 2, DK)),
        ValueError,
        "query",
        id="batched-forward-query-batch-mismatch",
    ),
    pytest.param(
        "batched",
        _forward(lambda m: torch.ones(4, DK)),
        ValueError,
        "query",
        id="batched-forward-query-without-batch-dims",
    ),
    pytest.param("exact", _load_state(dim_key=DK + 1), ValueError, "dim_key", id="exact-load_state-dim_key"),
    pytest.param("exact", _load_state(dim_value=DV + 1), ValueError, "dim_value", id="exact-load_state-dim_value"),
    pytest.param("batched", _load_state(), ValueError, "batch_shape", id="batched-load_state-batch_shape"),
    pytest.param(
        "exact",
        _load_state(mode="blend", blend_window=8, blend_chunk=4),
        ValueError,
        "mode",
        id="exact-load_state-blend-file",
    ),
    pytest.param(
        "exact",
        _load_state(prior=torch.ones(DK, DV), prior_count=1.0),
        ValueError,
        "prior",
        id="exact-load_state-file-with-prior",
    ),
    pytest.param("prior", _load_state(), ValueError, "prior", id="prior-load_state-file-without-prior"),
    pytest.param("exact", _load_state_corrupted, ValueError, "checksum", id="exact-load_state-corrupted"),
    pytest.param(
        "exact", _load_state_missing, FileNotFoundError, "missing.safetensors", id="exact-load_state-missing-file"
    ),
]


def _load_state_poisoned(m, tmp_path):
    donor = faast.FastWeights(DK, DV)
    donor.update(K(5), V(5))
    donor.count.fill_(-3.0)  # a negative row count and a NaN in S: statistics no update could produce
    donor.gram[0, 0] = NAN
    m.load_state(donor.save(tmp_path / "poisoned.safetensors"))


OTHER_METHOD_CASES.append(
    pytest.param(
        "exact",
        _load_state_poisoned,
        ValueError,
        "count|gram",
        id="exact-load_state-nonfinite-or-negative-statistics",
    )
)


@pytest.mark.parametrize(("kind", "call", "exc", "match"), [*_method_cases(), *OTHER_METHOD_CASES])
def test_fastweights_method_rejects_and_leaves_state_untouched(kind, call, exc, match, tmp_path):
    m = _memory(kind)
    before = snapshot(m)
    weights_before = m.weights.clone()
    with pytest.raises(exc, match=match):
        call(m, tmp_path)
    assert_untouched(m, before)
    assert torch.equal(m.weights, weights_before)


@pytest.mark.parametrize(
    ("defect", "index"),
    [
        ("keys-nan", r"\[2, 1\]"),
        ("values-neginf", r"\[2, 0\]"),
        ("scores-posinf", r"\[2\]"),
        ("scores-negative", r"\[2\]"),
    ],
)
def test_fastweights_update_error_names_the_index(defect, index):
    m = _memory("exact")
    keys, values, scores, mask = _bad_rows(defect)(m)
    with pytest.raises(ValueError, match=defect.split("-")[0] + ".*" + index):
        m.update(keys, values, scores, mask=mask)


def test_fastweights_update_error_index_refers_to_the_callers_tensor():
    m = faast.FastWeights(DK, DV)
    keys = put(K(8).reshape(2, 4, DK), (1, 2, 0), NAN)
    with pytest.raises(ValueError, match=r"keys.*\[1, 2, 0\]"):
        m.update(keys, V(8).reshape(2, 4, DV))


# ---------------------------------------------------------------------------------------------------- masked rows


@pytest.mark.parametrize("batch", [(), (2,)], ids=["unbatched", "batch2"])
@pytest.mark.parametrize("poison", ["keys-nan", "values-neginf", "scores-nan", "scores-negative", "scores-neginf"])
def test_fastweights_update_ignores_masked_out_rows(poison, batch):
    keys, values, scores = K(batch=batch), V(batch=batch), S(batch=batch)
    row = (*([1] * len(batch)), 3)
    if poison == "keys-nan":
        keys = put(keys, (*row, 0), NAN)
    elif poison == "values-neginf":
        values = put(values, (*row, 2), -INF)
    elif poison == "scores-nan":
        scores = put(scores, row, NAN)
    elif poison == "scores-negative":
        scores = put(scores, row, -1.0)
    else:
        scores = put(scores, row, -INF)
    mask = put(torch.ones((*batch, N), dtype=torch.bool), row, False)
    m = faast.FastWeights(DK, DV, batch_shape=batch)
    m.update(keys, values, scores, mask=mask)
    gram, cross, count, sqnorm = statistics64(keys, values, scores, mask)
    assert rel(m.gram, gram) <= REORDER_REL
    assert rel(m.cross, cross) <= REORDER_REL
    assert rel(m.target_sqnorm, sqnorm) <= REORDER_REL
    assert torch.equal(m.count, count)
    assert torch.equal(m.num_dropped, torch.zeros(batch, dtype=torch.int64))
    assert bool(torch.isfinite(m.weights).all())


# ---------------------------------------------------------------------------------------------------- drop_nonfinite


_DROP_POISONS = {
    "keys-nan": ("keys", NAN),
    "keys-posinf": ("keys", INF),
    "keys-neginf": ("keys", -INF),
    "values-nan": ("values", NAN),
    "values-posinf": ("values", INF),
    "values-neginf": ("values", -INF),
    "scores-nan": ("scores", NAN),
    "scores-posinf": ("scores", INF),
    "scores-neginf": ("scores", -INF),
}


def _dirty_batch(poison: str, batch: tuple[int, ...], n: int = 12):
    """Rows 1, 5 and 6 (of every batch element) get a non-finite entry; row 9 is masked out and also poisoned."""
    keys, values, scores = K(n, batch=batch), V(n, batch=batch), S(n, batch=batch)
    where, bad = _DROP_POISONS[poison]
    tensors = {"keys": keys, "values": values, "scores": scores}
    for row, col in ((1, 0), (5, 1), (6, 2), (9, 0)):
        t = tensors[where]
        index = (..., row) if where == "scores" else (..., row, col % t.shape[-1])
        t[index] = bad
    mask = torch.ones((*batch, n), dtype=torch.bool)
    mask[..., 9] = False
    good = mask.clone()
    good[..., [1, 5, 6]] = False
    return tensors["keys"], tensors["values"], tensors["scores"], mask, good


@pytest.mark.parametrize("batch", [(), (2,)], ids=["unbatched", "batch2"])
@pytest.mark.parametrize("poison", _DROP_POISONS)
def test_drop_nonfinite_equals_the_clean_rows_alone(poison, batch):
    keys, values, scores, mask, good = _dirty_batch(poison, batch)
    m = faast.FastWeights(DK, DV, batch_shape=batch, drop_nonfinite=True)
    m.update(K(7, batch=batch), V(7, batch=batch))  # some clean history first
    m.update(keys, values, scores, mask=mask)
    g0, c0, n0, y0 = statistics64(K(7, batch=batch), V(7, batch=batch))
    g1, c1, n1, y1 = statistics64(keys, values, scores, good)
    assert torch.equal(m.num_dropped, torch.full(batch, 3, dtype=torch.int64))
    assert torch.equal(m.count, n0 + n1)
    assert rel(m.gram, g0 + g1) <= REORDER_REL
    assert rel(m.cross, c0 + c1) <= REORDER_REL
    assert rel(m.target_sqnorm, y0 + y1) <= REORDER_REL
    assert bool(torch.isfinite(m.weights).all())


def test_drop_nonfinite_counts_per_batch_element_and_forget_skips_the_same_rows():
    batch = (2,)
    keys, values, scores = K(8, batch=batch), V(8, batch=batch), S(8, batch=batch)
    keys[0, 2, 1] = NAN
    values[1, 4, 0] = INF
    values[1, 6, 2] = NAN
    m = faast.FastWeights(DK, DV, batch_shape=batch, drop_nonfinite=True)
    m.update(keys, values, scores)
    assert m.num_dropped.tolist() == [1, 2]
    assert m.count.tolist() == [7.0, 6.0]
    m.forget(keys, values, scores)
    # Everything that was learned is forgotten: exact zeros, not rounding residue.
    assert m.count.tolist() == [0.0, 0.0]
    for name in ("gram", "cross", "target_sqnorm"):
        assert torch.equal(getattr(m, name), torch.zeros_like(getattr(m, name))), name
    assert torch.equal(m.weights, torch.zeros_like(m.weights))


def test_drop_nonfinite_still_rejects_overflow_and_shapes():
    m = faast.FastWeights(DK, DV, drop_nonfinite=True)
    m.update(K(), V())
    before = snapshot(m)
    with pytest.raises(ValueError, match="keys"):
        m.update(K(dtype=F64) * 1e200, V())  # finite rows whose squares overflow: not droppable, must raise
    with pytest.raises(ValueError, match="values"):
        m.update(K(), V(N - 1))
    assert_untouched(m, before)


# ------------------------------------------------------------------------------------ the door's one-pass check


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("bad", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
def test_all_finite_finds_one_bad_entry_at_any_position(dtype, bad):
    from faast.ops import _validate

    for shape in ((1,), (7,), (33, 5), (2, 65, 17)):
        clean = torch.randn(shape).to(dtype)
        assert _validate.all_finite(clean)
        assert _validate.all_finite(clean.mT if clean.dim() > 1 else clean, None, clean[..., ::2])
        for flat in range(clean.numel()):
            x = clean.clone()
            x.view(-1)[flat] = bad
            assert not _validate.all_finite(x), (shape, flat)
            assert not _validate.all_finite(clean, None, x.mT if x.dim() > 1 else x), (shape, flat)


def test_all_finite_on_empty_extreme_and_absent_tensors():
    from faast.ops import _validate

    assert _validate.all_finite()
    assert _validate.all_finite(None, torch.empty(0, 5))
    # Finite but huge float64 entries are finite: nothing is summed, so nothing overflows.
    assert _validate.all_finite(torch.tensor([1e308, -1e308, 1e308], dtype=torch.float64))
    assert not _validate.all_finite(torch.tensor([1e308, NAN], dtype=torch.float64), None)


def test_update_takes_the_fast_pass_and_still_names_a_bad_last_row():
    # Clean rows are learned exactly; a NaN in the very last entry is still found, named, and nothing is learned.
    keys, values = torch.randn(300, DK, dtype=torch.float64), torch.randn(300, DV, dtype=torch.float64)
    mem = faast.FastWeights(DK, DV).update(keys, values)
    s_ref, t_ref, _, yy_ref = statistics64(keys, values)
    for got, want in ((mem.gram, s_ref), (mem.cross, t_ref), (mem.target_sqnorm, yy_ref)):
        assert rel(got, want) <= REORDER_REL
    before = {k: v.clone() for k, v in mem.state_dict().items()}
    poisoned = values.clone()
    poisoned[-1, -1] = NAN
    with pytest.raises(ValueError, match=rf"values.*\[299, {DV - 1}\]"):
        mem.update(keys, poisoned)
    for k, v in mem.state_dict().items():
        assert torch.equal(v, before[k]), k
