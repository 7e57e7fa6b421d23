"""faast.ops.backends, the public view of the dispatch that benchmarks read: candidates and why auto passes over
them, a backend's own implementation, an extra variant, and the cache of measured choices."""

from __future__ import annotations

import json

import pytest
import torch

from faast import ops
from faast.ops import backends

CPU = torch.device("cpu")


def test_explain_lists_the_candidates_auto_chooses_among_with_the_reasons_it_skips_others():
    gram = torch.eye(4, dtype=torch.float64)[None]
    found = dict(backends.explain("eigh", CPU, ops.eigh_call(gram)))
    assert found.get("torch", "absent") is None  # torch runs everywhere and competes
    cuda = dict(backends.explain("eigh", torch.device("cuda")))
    assert "cupy" in cuda and "torch" in cuda  # a GPU's preference list names every backend it would try


def test_a_backends_reason_and_implementation():
    assert backends.unavailable_reason("torch") is None
    with pytest.raises(ValueError, match="backend: expected one of"):
        backends.unavailable_reason("numpy")
    eigh = backends.implementation("torch", "eigh")
    gram = torch.tensor([[[2.0, 1.0], [1.0, 2.0]]], dtype=torch.float64)
    values, _ = eigh(gram)
    torch.testing.assert_close(values, torch.tensor([[1.0, 3.0]], dtype=torch.float64))
    assert backends.implementation("torch", "no_such_op") is None
    assert backends.cupy_eigh_recomputed() == 0 or backends.unavailable_reason("cupy") is None


def test_a_registered_variant_becomes_a_candidate_unless_it_cannot_run():
    backends.register_variant("torch", "test_backends_op", "plain", lambda x: x)
    backends.register_variant("torch", "test_backends_op", "never", lambda x: x, cannot_run=lambda call: "no")
    backends.register_variant("torch", "test_backends_op", "gated", lambda x: x, gate=lambda call: "slow here")
    found = dict(backends.explain("test_backends_op", CPU, backends.Call("test_backends_op", CPU)))
    assert found == {"torch.plain": None, "torch.gated": "slow here"}


def test_measured_choices_reads_the_cache_file_the_environment_names(tmp_path, monkeypatch):
    path = tmp_path / "cache" / backends.AUTOTUNE_FILE_NAME
    monkeypatch.setenv(backends.AUTOTUNE_CACHE_ENV, str(path))
    assert backends.autotune_cache_path() == path
    assert backends.measured_choices() == {}  # absent
    entry = {"choice": "torch", "seconds": {"torch": 0.1, "triton": "failed: x"}}
    path.parent.mkdir()
    path.write_text(json.dumps({"format": 1, "entries": {"cpu: a": {"eigh 64": entry}, "cpu: b": {"eigh 8": entry}}}))
    assert backends.measured_choices() == {"eigh 64": entry, "eigh 8": entry}
    path.write_text("not json")
    assert backends.measured_choices(path) == {}
    backends.forget_measurements()
