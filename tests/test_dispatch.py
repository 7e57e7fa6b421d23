"""faast.ops._dispatch: FAAST_BACKEND, the automatic fallback (logged once per (op, backend)), and registration.

Every test works on copies of the global registries (monkeypatch), so nothing leaks into other tests.
"""

from __future__ import annotations

import logging

import pytest
import torch

from faast import ops
from faast.ops import _dispatch, reference

CPU = torch.device("cpu")
OPS = ("accumulate_gram", "eigh", "residual_project")


@pytest.fixture
def registry(monkeypatch):
    """Private copies of the registry, preferences and log memory; FAAST_BACKEND unset."""
    # Only the always-present torch backend: each test registers the others it needs (fakes), so results do not
    # depend on whether Triton is installed here.
    monkeypatch.setattr(_dispatch, "_REGISTRY", {"torch": _dispatch._REGISTRY["torch"]})
    monkeypatch.setattr(_dispatch, "_PREFERENCE", dict(_dispatch._PREFERENCE))
    monkeypatch.setattr(_dispatch, "_logged", set())
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    return _dispatch._REGISTRY


def _records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "faast"]


def _gram(d: int = 5) -> torch.Tensor:
    k = torch.randn(3 * d, d, dtype=torch.float64)
    return k.mT @ k


# ---------------------------------------------------------------------------------------------------- FAAST_BACKEND


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("value", [None, "", "auto", "torch", "AUTO", "Torch", " torch "], ids=repr)
def test_torch_backend_runs_on_cpu(registry, monkeypatch, value, op):
    if value is not None:
        monkeypatch.setenv("FAAST_BACKEND", value)
    name, impl = _dispatch.resolve(op, CPU)
    assert name == "torch"
    assert impl is registry["torch"].ops[op]


def test_torch_backend_is_the_reference_module(registry):
    assert _dispatch.resolve("accumulate_gram", CPU)[1] is reference.accumulate_gram_streaming
    assert _dispatch.resolve("eigh", CPU)[1] is reference.eigh
    assert _dispatch.resolve("residual_project", CPU)[1] is reference.residual_project


@pytest.mark.parametrize("backend", ["triton", "cuda", "TRITON", "Cuda"])
@pytest.mark.parametrize("op", OPS)
def test_requesting_a_missing_backend_raises_with_the_reason(registry, monkeypatch, backend, op):
    monkeypatch.setenv("FAAST_BACKEND", backend)
    wanted = backend.lower()
    with pytest.raises(RuntimeError, match=f"FAAST_BACKEND={wanted}") as info:
        _dispatch.resolve(op, CPU)
    message = str(info.value)
    assert op in message
    assert f"no {wanted} backend" in message  # the reason, not just the request


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_public_ops_raise_when_a_missing_backend_is_requested(registry, monkeypatch, backend):
    monkeypatch.setenv("FAAST_BACKEND", backend)
    keys, values = torch.randn(8, 4), torch.randn(8, 3)
    calls = {
        "accumulate_gram": lambda: ops.accumulate_gram(keys, values),
        "eigh_gram": lambda: ops.eigh_gram(_gram()),
        "solve_fast_weights": lambda: ops.solve_fast_weights(
            _gram(4), torch.randn(4, 3, dtype=torch.float64), count=8
        ),
        "residual_project": lambda: ops.residual_project(torch.randn(2, 4), torch.randn(4, 4)),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=f"FAAST_BACKEND={backend}.*no {backend} backend"):
            call()
            pytest.fail(f"{name} did not raise")


def test_requested_backend_does_not_touch_the_accumulators(registry, monkeypatch):
    monkeypatch.setenv("FAAST_BACKEND", "triton")
    gram, cross = _gram(4), torch.ones(4, 3, dtype=torch.float64)
    before = gram.clone(), cross.clone()
    with pytest.raises(RuntimeError, match="FAAST_BACKEND=triton"):
        ops.accumulate_gram(torch.randn(8, 4), torch.randn(8, 3), gram=gram, cross=cross)
    assert torch.equal(gram, before[0]) and torch.equal(cross, before[1])


@pytest.mark.parametrize("value", ["cudnn", "numpy", "gpu", "torch,triton"], ids=lambda v: f"FAAST_BACKEND={v}")
def test_unknown_backend_value_raises_value_error_naming_the_variable(registry, monkeypatch, value):
    monkeypatch.setenv("FAAST_BACKEND", value)
    with pytest.raises(ValueError, match="FAAST_BACKEND") as info:
        _dispatch.resolve("eigh", CPU)
    assert repr(value.strip().lower()) in str(info.value)
    with pytest.raises(ValueError, match="FAAST_BACKEND"):
        ops.accumulate_gram(torch.randn(8, 4), torch.randn(8, 3))


# ---------------------------------------------------------------------------------------------------- auto fallback


def _fake(name="triton", ops_=None, reason=None, devices=None) -> _dispatch.Backend:
    return _dispatch.Backend(
        name=name, ops=ops_ or {"eigh": reference.eigh}, devices=devices, unavailable_reason=lambda: reason
    )


def test_unavailable_preferred_backend_falls_back_to_torch_and_logs_once(registry, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="faast")
    _dispatch.register_backend(_fake(reason="no GPU here"))
    monkeypatch.setitem(_dispatch._PREFERENCE, "cpu", ("triton", "torch"))
    first = _dispatch.resolve("eigh", CPU)
    second = _dispatch.resolve("eigh", CPU)
    assert first[0] == second[0] == "torch"
    assert first[1] is registry["torch"].ops["eigh"]
    records = _records(caplog)
    assert len(records) == 1, [r.getMessage() for r in records]
    message = records[0].getMessage()
    assert "triton" in message and "no GPU here" in message and "eigh" in message
    # A different op is a different (op, backend) pair: logged once more, then never again.
    _dispatch.resolve("accumulate_gram", CPU)
    _dispatch.resolve("accumulate_gram", CPU)
    _dispatch.resolve("eigh", CPU)
    # (Only the fake's records: torch's own variants may log a gate of theirs, e.g. torch.syrk's.)
    about_fake = [r.getMessage() for r in _records(caplog) if "the triton backend" in r.getMessage()]
    assert len(about_fake) == 2 and "accumulate_gram" in about_fake[1]


def test_fallback_through_a_public_op_logs_once(registry, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="faast")
    _dispatch.register_backend(_fake(reason="no GPU here"))
    monkeypatch.setitem(_dispatch._PREFERENCE, "cpu", ("triton", "torch"))
    gram = _gram()
    for _ in range(3):
        lam, vecs = ops.eigh_gram(gram)
    expected = torch.linalg.eigh(gram)
    assert torch.equal(lam, expected.eigenvalues) and torch.equal(vecs, expected.eigenvectors)
    assert len(_records(caplog)) == 1


@pytest.mark.parametrize(
    ("fake", "reason"),
    [
        (dict(ops_={"eigh": reference.eigh}, devices=("cuda",)), "does not run on cpu"),
        (dict(ops_={"residual_project": reference.residual_project}), "does not implement eigh"),
    ],
    ids=["wrong-device", "op-not-implemented"],
)
def test_fallback_reasons_from_the_registry(registry, monkeypatch, caplog, fake, reason):
    caplog.set_level(logging.INFO, logger="faast")
    _dispatch.register_backend(_fake(**fake))
    monkeypatch.setitem(_dispatch._PREFERENCE, "cpu", ("triton", "torch"))
    assert _dispatch.resolve("eigh", CPU)[0] == "torch"
    assert _dispatch.resolve("eigh", CPU)[0] == "torch"
    records = _records(caplog)
    assert len(records) == 1 and reason in records[0].getMessage()


def test_cuda_preference_falls_back_to_torch_with_one_record_per_backend(registry, caplog):
    # This registry holds only torch: on cuda tensors the preferred cuda, cupy and triton backends are skipped.
    caplog.set_level(logging.INFO, logger="faast")
    for _ in range(3):
        name, _ = _dispatch.resolve("eigh", torch.device("cuda"))
        assert name == "torch"
    messages = [r.getMessage() for r in _records(caplog)]
    assert len(messages) == 3, messages
    assert all(any(f"the {b} backend" in m for m in messages) for b in ("cuda", "cupy", "triton"))


def test_no_backend_at_all_raises(registry, monkeypatch):
    monkeypatch.setitem(_dispatch._PREFERENCE, "cpu", ("triton",))
    with pytest.raises(RuntimeError, match="no faast backend can run eigh on cpu"):
        _dispatch.resolve("eigh", CPU)


def test_available_preferred_backend_is_chosen_and_called(registry, monkeypatch, caplog):
    # Measuring off: auto takes the first eligible candidate in preference order (measured choices: test_autotune.py).
    monkeypatch.setenv("FAAST_AUTOTUNE", "0")
    caplog.set_level(logging.INFO, logger="faast")
    calls = []

    def fake_eigh(gram):
        calls.append(gram.shape)
        lam, vecs = torch.linalg.eigh(gram.to(torch.float64))
        return lam + 1000.0, vecs  # a recognisable result: proves this function's output is what eigh_gram returns

    _dispatch.register_backend(_fake(ops_={"eigh": fake_eigh}))
    monkeypatch.setitem(_dispatch._PREFERENCE, "cpu", ("triton", "torch"))
    assert _dispatch.resolve("eigh", CPU) == ("triton", fake_eigh)
    # Ops the fake does not implement still go to torch.
    assert _dispatch.resolve("accumulate_gram", CPU)[0] == "torch"

    gram = _gram(5).expand(3, 5, 5)
    lam, vecs = ops.eigh_gram(gram)
    assert calls == [torch.Size([3, 5, 5])]  # called once, batched across the leading dims
    expected = torch.linalg.eigh(gram)
    assert torch.equal(lam, expected.eigenvalues + 1000.0)
    assert torch.equal(vecs, expected.eigenvectors)
    assert not [r for r in _records(caplog) if "eigh" in r.getMessage()]


def test_explicit_request_uses_an_available_backend_and_reports_an_unavailable_one(registry, monkeypatch, caplog):
    fn = lambda gram: torch.linalg.eigh(gram)  # noqa: E731
    _dispatch.register_backend(_fake(ops_={"eigh": fn}))
    monkeypatch.setenv("FAAST_BACKEND", "triton")
    assert _dispatch.resolve("eigh", CPU) == ("triton", fn)
    # An op the requested backend does not provide takes the automatic choice (torch here), said once.
    with caplog.at_level(logging.INFO, logger="faast"):
        assert _dispatch.resolve("accumulate_gram", CPU)[0] == "torch"
        assert _dispatch.resolve("accumulate_gram", CPU)[0] == "torch"
    lacks = [r for r in _records(caplog) if "has no accumulate_gram" in r.getMessage()]
    assert len(lacks) == 1
    _dispatch.register_backend(_fake(ops_={"eigh": fn}, reason="no GPU here"))
    with pytest.raises(RuntimeError, match="FAAST_BACKEND=triton.*no GPU here"):
        _dispatch.resolve("eigh", CPU)


@pytest.mark.parametrize("name", ["cudnn", "numpy", ""])
def test_register_backend_rejects_unknown_names(registry, name):
    before = dict(registry)
    with pytest.raises(ValueError, match="backend.name"):
        _dispatch.register_backend(_dispatch.Backend(name=name))
    assert _dispatch._REGISTRY == before
