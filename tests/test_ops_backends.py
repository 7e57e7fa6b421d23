"""faast.ops.backends, the public view of the dispatch that benchmarks read: candidates and why auto passes over
them, a backend's own implementation, an extra variant, and the cache of measured choices."""

from __future__ import annotations

import json
import re

import pytest
import torch

from faast import ops
from faast.ops import _autotune, backends

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


def test_assume_loadable_lets_a_backend_compete_only_within_the_block():
    call = backends.Call("eigh", torch.device("cuda"), (torch.float64,), ((4, 64, 64),))
    before = {name: backends.unavailable_reason(name) for name in ("cupy", "triton")}
    with backends.assume_loadable("cupy", "triton"):
        assert backends.unavailable_reason("cupy") is None and backends.unavailable_reason("triton") is None
        assert dict(backends.explain("eigh", call.device, call)).get("cupy", "absent") is None  # d = 64: it competes
    assert {name: backends.unavailable_reason(name) for name in before} == before
    with pytest.raises(RuntimeError, match="inside"), backends.assume_loadable("cupy"):
        raise RuntimeError("inside")  # restored however the block ends
    assert backends.unavailable_reason("cupy") == before["cupy"]
    with pytest.raises(ValueError, match="backends: expected registered backends"):
        with backends.assume_loadable("cupy", "numpy"):
            pass
    assert backends.unavailable_reason("cupy") == before["cupy"]  # refused before anything changed


def test_write_measured_choices_writes_a_file_the_dispatch_and_measured_choices_read(tmp_path, monkeypatch):
    monkeypatch.setenv(backends.AUTOTUNE_CACHE_ENV, str(tmp_path / "default.json"))
    entry = {"choice": "torch.syrk", "seconds": {"torch": 0.2, "torch.syrk": 0.1}}
    assert _autotune.lookup(CPU, "accumulate_gram", "N64") is None  # read (and remembered) before the write
    path = backends.write_measured_choices({_autotune.context_key(CPU): {"accumulate_gram N64": entry}})
    assert path == tmp_path / "default.json"
    assert backends.measured_choices() == {"accumulate_gram N64": entry}
    # what the dispatch itself reads for this machine: the file is read afresh, not the memory of it before the write
    assert _autotune.lookup(CPU, "accumulate_gram", "N64") == "torch.syrk"
    other = backends.write_measured_choices({"GPU | torch x": {"eigh B8 d64": entry}}, tmp_path / "sub" / "a.json")
    assert backends.measured_choices(other) == {"eigh B8 d64": entry}
    for bad, named in (([1], "entries:"), ({"c": {"k": {"seconds": {}}}}, "entries['c']['k']:")):
        with pytest.raises(ValueError, match=re.escape(named)):
            backends.write_measured_choices(bad, tmp_path / "bad.json")
    assert not (tmp_path / "bad.json").exists()
    backends.forget_measurements()
