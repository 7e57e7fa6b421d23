"""A saved folder that is damaged says so (the server loads its memories from one): memory files without the manifest
that names them, and a manifest with fields this faast does not know, are refused by FaastModel.from_pretrained with
the missing file or the unknown field named, and the base model is left bare. And the `faast` command's `serve`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from faast.hf import FaastConfig, FaastModel, apply_faast
from faast.serve.__main__ import cli, parse_args
from hf_models import VOCAB, tiny_model


def saved_with_two_memories(folder):
    model = apply_faast(tiny_model("llama"), FaastConfig())
    g = torch.Generator().manual_seed(0)
    for name in ("a", "b"):
        model.learn(torch.randint(3, VOCAB, (6, 40), generator=g), memory=name)
    model.save_pretrained(folder)
    return model


def test_memory_files_without_the_manifest_are_refused_naming_the_manifest_and_the_files(tmp_path):
    saved_with_two_memories(tmp_path)
    (tmp_path / "faast_manifest.json").unlink()
    base = tiny_model("llama")
    with pytest.raises(ValueError, match=r"faast_manifest\.json is missing.*'a\.safetensors', 'b\.safetensors'"):
        FaastModel.from_pretrained(base, tmp_path)
    apply_faast(base, FaastConfig())  # the refused load left the base model bare


def test_a_manifest_with_an_unknown_top_level_field_is_refused_naming_it(tmp_path):
    saved_with_two_memories(tmp_path)
    path = tmp_path / "faast_manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "adapters": ["x"]}))
    with pytest.raises(ValueError, match=r"unknown fields \['adapters'\]"):
        FaastModel.from_pretrained(tiny_model("llama"), tmp_path)


def test_an_intact_folder_still_loads_and_one_saved_without_memories_loads_without_a_manifest(tmp_path):
    model = saved_with_two_memories(tmp_path / "full")
    reloaded = FaastModel.from_pretrained(tiny_model("llama"), tmp_path / "full")
    x = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(reloaded(x, memory_names=["a", "b"]).logits, model(x, memory_names=["a", "b"]).logits)
    # the configuration and adapter alone (no memories/ files): a plain folder, loaded with an empty memory
    model.save_pretrained(tmp_path / "bare", memories=False)
    (tmp_path / "bare" / "faast_manifest.json").unlink()
    assert FaastModel.from_pretrained(tiny_model("llama"), tmp_path / "bare").memories == ["default"]


def test_the_faast_command_runs_serve_and_refuses_anything_else(capsys, monkeypatch):
    setup = (Path(__file__).resolve().parents[1] / "setup.py").read_text()
    assert '"faast=faast.serve.__main__:cli"' in setup  # the console script is this function
    monkeypatch.setattr(sys, "argv", ["faast", "train"])
    assert cli() == 2
    assert "faast serve" in capsys.readouterr().err
    args = parse_args(["--memories", "m", "--max-resident", "3"])
    assert (args.base, args.memories, args.max_resident, args.host) == ("smollm2", "m", 3, "127.0.0.1")
