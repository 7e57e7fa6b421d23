"""faast.FastWeights: streaming, merge, forget, discount, prior, batching, caching."""

from __future__ import annotations

import warnings

import pytest
import torch

from faast import FastWeights
from faast.authors_reference import pinv_fast_weights
from tolerances import REORDER_REL, TRUTH_REL_W, assert_close, rel

DK, DV = 24, 5


def data(n, *batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(*batch, n, DK, generator=g, dtype=torch.float64),
        torch.randn(*batch, n, DV, generator=g, dtype=torch.float64),
        torch.rand(*batch, n, generator=g, dtype=torch.float64),
    )


def memory(**kwargs):
    return FastWeights(DK, DV, dtype=torch.float64, **kwargs)


def statistics(m):
    return {name: getattr(m, name).clone() for name in ("gram", "cross", "count", "target_sqnorm")}


def assert_same_statistics(a, b, scale=1.0):
    for name in a:
        tolerance = REORDER_REL * max(scale, float(b[name].norm()))
        assert float((a[name] - b[name]).norm()) <= tolerance, name


def truth(keys, values, scores, alpha=1.0):
    return torch.linalg.pinv(keys, atol=0.0, rtol=keys.shape[-2] ** -alpha) @ (scores.unsqueeze(-1) * values)


def test_streaming_equals_one_shot_and_truth():
    keys, values, scores = data(700)
    one = memory().update(keys, values, scores)
    streamed = memory()
    for start in range(0, 700, 64):
        streamed.update(keys[start : start + 64], values[start : start + 64], scores[start : start + 64])
    assert_same_statistics(statistics(streamed), statistics(one))
    assert float(streamed.count) == 700
    assert rel(streamed.weights, truth(keys, values, scores)) < TRUTH_REL_W


def test_merge_equals_union():
    keys, values, scores = data(500)
    left = memory().update(keys[:123], values[:123], scores[:123])
    right = memory().update(keys[123:], values[123:], scores[123:])
    union = memory().update(keys, values, scores)
    assert left.merge(right) is left
    assert_same_statistics(statistics(left), statistics(union))
    assert rel(left.weights, union.weights) < TRUTH_REL_W


def test_forget_equals_never_seen():
    keys, values, scores = data(400)
    seen = memory().update(keys, values, scores)
    seen.forget(keys[300:], values[300:], scores[300:])
    never = memory().update(keys[:300], values[:300], scores[:300])
    assert float(seen.count) == 300
    assert_same_statistics(
        statistics(seen),
        statistics(never),
        scale=float(statistics(memory().update(keys, values, scores))["gram"].norm()),
    )
    assert rel(seen.weights, never.weights) < TRUTH_REL_W


def test_forget_everything_is_exactly_empty():
    keys, values, scores = data(50)
    m = memory().update(keys, values, scores).forget(keys, values, scores)
    assert float(m.count) == 0
    assert all(torch.count_nonzero(t) == 0 for t in statistics(m).values())
    assert torch.equal(m.weights, torch.zeros(DK, DV, dtype=torch.float64))


def test_forget_more_than_learned_is_refused():
    keys, values, _ = data(20)
    m = memory().update(keys[:10], values[:10])
    before = statistics(m)
    with pytest.raises(ValueError, match="forget"):
        m.forget(keys, values)
    assert_same_statistics(statistics(m), before, scale=0.0)


def test_discount_weights_old_rows_geometrically():
    keys, values, scores = data(90)
    gamma = 0.9
    m = memory(discount=gamma)
    for i in range(3):
        rows = slice(30 * i, 30 * (i + 1))
        m.update(keys[rows], values[rows], scores[rows])
    # Rows of batch i end up weighted by gamma^(2 - i) in S, T and N.
    w = torch.cat([torch.full((30,), gamma ** (2 - i), dtype=torch.float64) for i in range(3)])
    assert_close(m.gram, keys.mT @ (w.unsqueeze(-1) * keys), torch.float64)
    assert_close(m.cross, keys.mT @ ((w * scores).unsqueeze(-1) * values), torch.float64)
    assert abs(float(m.count) - float(w.sum())) < 1e-12
    manual = memory().update(keys, values, scores).apply_discount(0.5)
    assert abs(float(manual.count) - 45.0) < 1e-12


@pytest.mark.parametrize("ridge", [None, 0.5, "auto"])
def test_scale_values_equals_learning_scaled_values_and_keeps_the_spectrum(ridge):
    keys, values, scores = data(90)
    scaled = memory(ridge=ridge).update(keys, values, scores)
    one = scaled.weights
    spectrum = scaled._cache.get(("eigh", scaled.state_key))
    assert scaled.scale_values(3.0) is scaled
    learned = memory(ridge=ridge).update(keys, 3.0 * values, scores)
    assert_same_statistics(statistics(scaled), statistics(learned))
    assert rel(scaled.weights, learned.weights) < TRUTH_REL_W
    assert rel(scaled.weights, 3.0 * one) < TRUTH_REL_W  # GCV picks the same ridge for scaled values
    assert (spectrum is None) == (ridge == 0.5)  # a fixed ridge solves by Cholesky, the others by eigh
    if spectrum is not None:  # the eigendecomposition of the unchanged S is reused, not recomputed
        assert scaled._cache[("eigh", scaled.state_key)] is spectrum


@pytest.mark.parametrize("factor", [0, -1.0, float("nan"), float("inf"), True, "2"])
def test_scale_values_refuses_a_bad_factor_untouched(factor):
    keys, values, scores = data(40)
    m = memory().update(keys, values, scores)
    before = statistics(m)
    with pytest.raises((TypeError, ValueError), match="factor"):
        m.scale_values(factor)
    assert_same_statistics(statistics(m), before, scale=0.0)


def test_prior_interpolation():
    keys, values, scores = data(60)
    prior = torch.randn(DK, DV, dtype=torch.float64)
    m = memory(prior=prior, prior_count=40.0)
    assert torch.equal(m.weights, prior)  # nothing learned yet: the prior alone
    m.update(keys, values, scores)
    expected = (40.0 * prior + 60.0 * truth(keys, values, scores)) / 100.0
    assert rel(m.weights, expected) < TRUTH_REL_W
    identity = FastWeights(DK, DK, prior="identity", prior_count=10.0, dtype=torch.float64)
    assert torch.equal(identity.weights, torch.eye(DK, dtype=torch.float64))


def test_batch_shape_holds_independent_memories():
    keys, values, scores = data(80, 2, 3)
    batched = memory(batch_shape=(2, 3)).update(keys, values, scores)
    assert batched.weights.shape == (2, 3, DK, DV)
    for i in range(2):
        for j in range(3):
            single = memory().update(keys[i, j], values[i, j], scores[i, j])
            assert rel(batched.weights[i, j], single.weights) < TRUTH_REL_W
    query = torch.randn(2, 3, 7, DK, dtype=torch.float64)
    assert_close(batched(query), query @ batched.weights, torch.float64)


def test_row_dims_are_flattened_and_mask_skips_padding():
    keys, values, scores = data(12, 4)  # [B=4, T=12, d]: every (b, t) is a row
    mask = torch.ones(4, 12, dtype=torch.bool)
    mask[0, :3] = False  # left padding
    mask[2, 9:] = False  # right padding
    m = memory().update(keys, values, scores, mask=mask)
    flat = memory().update(keys[mask], values[mask], scores[mask])
    assert float(m.count) == int(mask.sum())
    assert_same_statistics(statistics(m), statistics(flat))


def test_drop_nonfinite_counts_dropped_rows():
    keys, values, scores = data(30)
    keys[3, 0], values[7, 1], scores[11] = float("nan"), float("inf"), float("nan")
    m = memory(drop_nonfinite=True).update(keys, values, scores)
    good = torch.ones(30, dtype=torch.bool)
    good[[3, 7, 11]] = False
    clean = memory().update(keys[good], values[good], scores[good])
    assert int(m.num_dropped) == 3 and float(m.count) == 27
    assert_same_statistics(statistics(m), statistics(clean))


def test_weights_are_cached_and_never_stale():
    keys, values, _ = data(100)
    m = memory().update(keys[:50], values[:50])
    first = m.weights
    assert m.weights is first  # cached
    version = m.version
    m.update(keys[50:], values[50:])
    assert m.version > version
    assert rel(m.weights, memory().update(keys, values).weights) < TRUTH_REL_W
    # An in-place edit behind the memory's back must not return the stale W either.
    before = m.weights
    m.gram.mul_(4.0)
    assert rel(m.weights, before / 4.0) < 1e-9


def test_mark_changed_bumps_the_version_and_drops_the_cached_solution():
    keys, values, _ = data(100)
    m = memory().update(keys, values)
    first, version, key = m.weights, m.version, m.solution_key
    m.mark_changed()
    assert m.version == version + 1 and m.solution_key != key
    second = m.weights
    assert second is not first and torch.equal(second, first)  # solved again, from the same statistics


def test_the_core_modules_do_not_import_the_memory():
    # _persist is a codec over plain data and the blend window is handed what it needs: neither reaches back into
    # memory.py (which imports them), not even for type checking.
    import ast
    from pathlib import Path

    import faast

    package = Path(faast.__file__).parent
    for name in ("_persist.py", "_blend.py", "statistics.py", "accumulator.py"):
        tree = ast.parse((package / name).read_text(encoding="utf-8"))
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):  # from .memory import X / from . import memory
                imported |= {node.module or "", *(f"{node.module or ''}.{a.name}" for a in node.names)}
        assert not {"memory", "faast.memory", ".memory"} & imported, name


def test_solve_overrides_do_not_change_the_configuration():
    keys, values, scores = data(300)
    m = memory(alpha=1.0).update(keys, values, scores)
    with pytest.warns(UserWarning, match="one-off solve"):
        assert rel(m.solve(alpha=0.5), truth(keys, values, scores, alpha=0.5)) < TRUTH_REL_W
    _, info = m.solve(ridge="auto", return_info=True)
    assert info.ridge is not None
    assert rel(m.weights, truth(keys, values, scores)) < TRUTH_REL_W
    assert m.solve_info.ridge is None


def test_dtype_casts_leave_statistics_in_float64():
    keys, values, _ = data(40)
    m = memory().update(keys, values)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3))
    model.memory = m
    model.to(torch.float16)
    assert m.gram.dtype == torch.float64 and model[0].weight.dtype == torch.float16
    assert_close(m.gram, keys.mT @ keys, torch.float64)


def test_float32_inputs_and_output_dtype():
    keys, values, _ = data(200)
    m = FastWeights(DK, DV).update(keys.float(), values.float())
    assert m.weights.dtype == torch.float32
    assert m.gram.dtype == torch.float64
    assert (
        rel(m.weights, truth(keys.float().double(), values.float().double(), torch.ones(200, dtype=torch.float64)))
        < 1e-6
    )


def test_state_dict_round_trip():
    keys, values, scores = data(64)
    m = memory(alpha=0.7).update(keys, values, scores)
    other = memory(alpha=0.7)
    other.load_state_dict(m.state_dict())
    assert torch.equal(other.weights, m.weights)


def test_update_returns_self_and_reset_clears():
    keys, values, _ = data(10)
    m = memory()
    assert m.update(keys, values) is m
    m.reset()
    assert float(m.count) == 0 and torch.count_nonzero(m.gram) == 0
    assert torch.equal(m.weights, torch.zeros(DK, DV, dtype=torch.float64))


def test_forward_reads_the_memory():
    keys, values, _ = data(100)
    m = memory().update(keys, values)
    query = torch.randn(3, 4, DK, dtype=torch.float64)
    assert_close(m(query), query @ pinv_fast_weights(keys, values, 0.01), torch.float64)


def test_import_faast_loads_the_core_only_and_the_subpackages_on_first_use():
    import subprocess
    import sys

    code = (
        "import sys, faast; loaded = sorted(m for m in ('faast.hf', 'faast.classify', 'faast.checkpoint', "
        "'faast.distributed') if m in sys.modules); print(loaded); print(faast.hf.FaastConfig.__name__, "
        "faast.checkpoint.Checkpointer.__name__); print('hf' in dir(faast))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split("\n")[:3] == ["[]", "FaastConfig Checkpointer", "True"], out.stdout + out.stderr
    with pytest.raises(AttributeError, match="module 'faast' has no attribute 'nope'"):
        import faast

        faast.nope  # noqa: B018


def test_a_float32_memory_warns_once_where_its_cut_is_below_float32_resolution():
    keys, values, _ = data(4000)
    m = memory(compute_dtype=torch.float32).update(keys, values)  # eps² = 4000^-2 ≈ 6e-8 < 1e-7
    with pytest.warns(RuntimeWarning, match="below the ~1e-07"):
        m.solve()
    m.update(keys[:1], values[:1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m.solve()  # once per memory
        memory(compute_dtype=torch.float32, ridge="auto").update(keys, values).solve()  # a ridge: no cut
        memory(compute_dtype=torch.float32).update(keys[:1000], values[:1000]).solve()  # 1e-6: resolved
