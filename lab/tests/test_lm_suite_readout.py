"""Middle layers read through a trained readout as an lm_suite setting (lab/experiments/lm_suite.py, "readout"): its
own learning pass, loaded from a save_pretrained folder, recorded in the protocol, and read by the report."""

from __future__ import annotations

import json
import math

import pytest
import torch

from faast.hf import FaastConfig, MiddleLayers, apply_faast
from faast_lab.experiments import lm_suite, lm_suite_report
from hf_models import tiny_model
from test_lm_suite import ARGS, fake_manifest, fake_tree, loader


def readout_folder(path, std: float) -> str:
    """A save_pretrained folder of the tiny model with 2 middle layers, their readouts N(0, std²) (0: untrained)."""
    model = apply_faast(tiny_model("llama"), FaastConfig(middle=MiddleLayers(num_layers=2)))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.memory_layers.values():
            layer.readout.weight.copy_(torch.randn(layer.readout.weight.shape, generator=g) * std)
    model.save_pretrained(path, memories=False)
    return str(path)


def test_a_readout_setting_learns_its_own_pass_through_the_saved_middle_layers(tmp_path):
    bases, sources = fake_tree(tmp_path / "tree")
    manifest = fake_manifest(bases, sources)
    untrained, trained = readout_folder(tmp_path / "zero", 0.0), readout_folder(tmp_path / "random", 0.5)
    settings = {"default": {}, "no_bias": {"bias": 0}, "zero": {"readout": untrained},
                "zero_no_bias": {"readout": untrained, "bias": 0}, "random": {"readout": trained}}  # fmt: skip
    out = tmp_path / "shards"
    lm_suite.main([*ARGS, "--settings", json.dumps(settings), "--out", str(out)],
                  load_model=loader, manifest=manifest, bases=bases)  # fmt: skip
    shard = json.loads((out / "code.json").read_text())
    rows, defined = shard["settings"], shard["protocol"]["settings"]
    # A readout's settings share a pass among themselves only; the protocol records the readout.
    assert rows["default"]["shared_pass"] == ["default", "no_bias"]
    assert rows["zero"]["shared_pass"] == ["zero", "zero_no_bias"] and rows["random"]["shared_pass"] == ["random"]
    assert defined["zero"]["readout"] == untrained and "readout" not in defined["default"]
    assert (
        rows["zero"]["middle_layers"] == rows["random"]["middle_layers"] and len(rows["random"]["middle_layers"]) == 2
    )
    assert "middle_layers" not in rows["default"]
    # An untrained readout is the identity: the output layer learns and reads as without middle layers, bit for bit.
    for a, b in (("zero", "default"), ("zero_no_bias", "no_bias")):
        assert rows[a]["curve"]["ppl"] == rows[b]["curve"]["ppl"], a
    # A trained one rewrites the middle blocks' inputs: another score at every point, and its statistics' bytes.
    assert all(x != y for x, y in zip(rows["random"]["curve"]["ppl"], rows["default"]["curve"]["ppl"], strict=True))
    assert rows["random"]["memory_bytes"] > rows["default"]["memory_bytes"]
    # The report reads them as settings that leave-one-kind-out may choose; none is the default.
    merged = lm_suite_report.merge(lm_suite_report.load_shards([out]))
    assert set(merged["reductions"]["code"]) == set(settings)
    assert not math.isnan(merged["loko"]["median"])


@pytest.mark.parametrize("readout", ["", 3, "no/such/folder"])
def test_a_bad_readout_is_refused_naming_the_setting(readout):
    with pytest.raises(ValueError, match="setting 'bad'.*readout"):
        lm_suite.split_readout("bad", {"readout": readout})
    assert lm_suite.split_readout("ok", {"bias": 0}) == ({"bias": 0}, None)
    assert lm_suite.split_readout("ok", {"readout": "shipped"}) == ({}, "shipped")
