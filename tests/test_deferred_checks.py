"""FastWeights.update without host synchronisation (eager_checks=False, the default on CUDA): a batch with a bad
learned row is skipped on the device by the memory it belongs to, and the error surfaces at the next solve."""

from __future__ import annotations

import contextlib

import pytest
import torch

from faast import FastWeights
from faast.ops import _dispatch
from tolerances import REORDER_REL, rel


def _batches(seed: int = 0, memories: int = 3, n: int = 20, dk: int = 6, dv: int = 4):
    g = torch.Generator().manual_seed(seed)
    for _ in range(3):
        yield (
            torch.randn(memories, n, dk, generator=g),
            torch.randn(memories, n, dv, generator=g),
            torch.rand(memories, n, generator=g),
            torch.rand(memories, n, generator=g) > 0.2,
        )


@contextlib.contextmanager
def no_host_sync(monkeypatch):
    """Any bool()/item()/tolist() of a tensor inside the block fails the test: each is a host synchronisation."""

    def forbidden(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("host synchronisation on the update path")

    with monkeypatch.context() as m:
        for name in ("__bool__", "item", "tolist"):
            m.setattr(torch.Tensor, name, forbidden)
        yield


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_deferred_updates_learn_exactly_what_eager_ones_do_without_a_host_sync(monkeypatch, backend):
    if backend == "triton":
        pytest.importorskip("triton")
        import faast_kernels

        if not faast_kernels.interpreting():
            pytest.skip("the triton backend takes CPU tensors only in the interpreter")
    monkeypatch.setenv(_dispatch.ENV_VAR, backend)
    eager = FastWeights(6, 4, batch_shape=(3,), eager_checks=True, discount=0.9)
    deferred = FastWeights(6, 4, batch_shape=(3,), eager_checks=False, discount=0.9)
    for keys, values, scores, mask in _batches():
        eager.update(keys, values, scores, mask=mask)
        with no_host_sync(monkeypatch):
            deferred.update(keys, values, scores, mask=mask)
    for name in ("gram", "cross", "count", "target_sqnorm"):
        assert rel(getattr(deferred, name), getattr(eager, name)) <= REORDER_REL, name
    torch.testing.assert_close(deferred.weights, eager.weights, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("where", ["keys", "values", "scores", "negative"])
def test_a_bad_batch_is_skipped_by_its_memory_only_and_reported_at_the_next_solve(where):
    good = FastWeights(6, 4, batch_shape=(3,), eager_checks=False, discount=0.9)
    deferred = FastWeights(6, 4, batch_shape=(3,), eager_checks=False, discount=0.9)
    batches = list(_batches(seed=1))
    for i, (keys, values, scores, mask) in enumerate(batches):
        good_keys, good_values, good_scores, good_mask = keys, values, scores, mask.clone()
        if i == 1:  # memory 2 of update #2 holds a bad learned row: that memory must learn nothing from that batch
            keys, values, scores = keys.clone(), values.clone(), scores.clone()
            row = int(mask[2].nonzero()[0])
            {"keys": keys, "values": values, "scores": scores, "negative": scores}[where][2, row, ...] = (
                -0.5 if where == "negative" else float("nan")
            )
            good_mask[2] = False
            good.update(good_keys, good_values, good_scores, mask=good_mask)
            for name in ("gram", "cross", "count", "target_sqnorm"):
                getattr(good, name)[2] /= 0.9
        else:
            good.update(good_keys, good_values, good_scores, mask=good_mask)
        deferred.update(keys, values, scores, mask=mask)
    for name in ("gram", "cross", "count", "target_sqnorm"):
        assert torch.isfinite(getattr(deferred, name)).all(), name
        assert rel(getattr(deferred, name), getattr(good, name)) <= REORDER_REL, name
    name = "scores" if where == "negative" else where
    with pytest.raises(ValueError, match=rf"^{name}: expected .* update #2 \(memory \[2\]\)"):
        deferred.weights  # noqa: B018
    torch.testing.assert_close(deferred.weights, good.weights)  # reported once; the memory stays usable


def test_eager_is_the_default_on_cpu_and_raises_in_update():
    memory = FastWeights(3, 2)
    keys = torch.randn(5, 3)
    keys[2, 1] = float("inf")
    with pytest.raises(ValueError, match=r"keys: expected finite values, found inf at index \[2, 1\]"):
        memory.update(keys, torch.randn(5, 2))
    assert float(memory.count) == 0


def test_reset_clears_a_pending_error_and_eager_checks_is_validated():
    memory = FastWeights(3, 2, eager_checks=False)
    memory.update(torch.full((4, 3), float("nan")), torch.randn(4, 2))
    memory.reset()
    memory.check()  # nothing pending any more
    with pytest.raises(TypeError, match="eager_checks: expected None, True or False"):
        FastWeights(3, 2, eager_checks="yes")
