"""lab/experiments/readout_recipe.py, the readout training for a lent GPU, dry-run on this CPU with a tiny config-built
model: a call exports a checkpoint that fits what a device call returns, and the next call resumes it (the step
count, the parameters, Adam's state and the learning-rate schedule continue)."""

from __future__ import annotations

import argparse
import importlib
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")


def _recipe():  # noqa: ANN202 - the module
    return importlib.import_module("faast_lab.experiments.readout_recipe")


@pytest.fixture(scope="module")
def recipe():  # noqa: ANN201
    return _recipe()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("text")
    words = ["def", "return", "self", "value", "import", "class", "for", "in", "if", "else", "print", "data"]
    g = torch.Generator().manual_seed(0)
    for i in range(6):
        lines = [" ".join(words[j] for j in torch.randint(0, len(words), (10,), generator=g)) for _ in range(40)]
        (folder / f"doc{i}.py").write_text("\n".join(lines))
    return str(folder / "*.py")


def _argv(corpus: str, out: Path, *extra: str) -> list[str]:
    return ["--out", str(out), "--model", "tiny", "--num-layers", "2", "--seq-len", "16", "--batch-size", "2",
            "--checkpoint-every", "2", "--warmup-steps", "1", "--device", "cpu", "--text-files", corpus,
            *extra]  # fmt: skip


def _readout(model) -> list[torch.Tensor]:  # noqa: ANN001
    return [layer.readout.weight.detach().clone() for layer in model.memory_layers.values()]


def test_a_call_exports_a_checkpoint_that_the_next_call_resumes(recipe, corpus, tmp_path):
    from faast.hf.train import TrainConfig, lr_factor

    first = recipe.run(_argv(corpus, tmp_path / "a", "--steps", "4", "--call-steps", "2"))
    assert (first["start_step"], first["end_step"], first["steps_this_call"]) == (0, 2, 2)
    files = sorted((tmp_path / "a").iterdir())
    assert len(files) <= 8 and all(f.stat().st_size <= 16 << 20 for f in files)  # what a device call returns
    assert first["export"]["step"] == 2 and first["export"]["adam_moments"] == "float32"
    assert not (tmp_path / "a" / "work").exists()  # the working checkpoints are not left behind to travel
    after_first = _readout(first["model_object"])
    assert any(w.abs().sum() > 0 for w in after_first)  # it trained (the readout starts at zero)

    # A call with nothing left to do shows what the import restored: exactly the first call's readout.
    idle = recipe.run(_argv(corpus, tmp_path / "b", "--steps", "2", "--resume-from", str(tmp_path / "a")))
    assert (idle["imported_step"], idle["start_step"], idle["end_step"]) == (2, 2, 2)
    for restored, saved in zip(_readout(idle["model_object"]), after_first, strict=True):
        assert torch.equal(restored, saved)

    second = recipe.run(_argv(corpus, tmp_path / "c", "--steps", "4", "--resume-from", str(tmp_path / "a")))
    assert (second["start_step"], second["end_step"]) == (2, 4)
    assert [h["step"] for h in second["history"]] == [3, 4]
    schedule = TrainConfig(steps=4, warmup_steps=1)
    for h in second["history"]:  # the warmup + cosine schedule goes on where the first call left it
        assert h["lr"] == pytest.approx(1e-3 * lr_factor(h["step"], schedule))
    assert any(not torch.equal(a, b) for a, b in zip(_readout(second["model_object"]), after_first, strict=True))
    state = _exported_state(recipe, tmp_path / "c")
    steps = {float(s["step"]) for s in state["optimizer"]["state"].values()}
    assert state["step"] == 4 and steps == {4.0}  # Adam's step count (and moments) continued, not restarted


def _exported_state(recipe, folder: Path) -> dict:  # noqa: ANN001
    import io
    import tarfile

    data = b"".join(p.read_bytes() for p in sorted(folder.glob(recipe.PART + "*")))
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return torch.load(tar.extractfile("trainer_state.pt"), weights_only=True)


def test_a_call_stops_on_a_checkpoint_boundary(recipe):
    args = argparse.Namespace(checkpoint_every=2, minutes=0.0, call_steps=0)
    # No time left: the first boundary after some steps ends the call (never before a checkpoint was written).
    assert list(recipe.within_budget(iter(range(10)), 0, args, time.monotonic())) == [0, 1]
    assert list(recipe.within_budget(iter(range(10)), 4, args, time.monotonic())) == [0, 1]
    args = argparse.Namespace(checkpoint_every=2, minutes=60.0, call_steps=4)
    assert list(recipe.within_budget(iter(range(10)), 1, args, time.monotonic())) == [0, 1, 2, 3, 4]
    # Time for more: the stream goes on until the data ends.
    args = argparse.Namespace(checkpoint_every=2, minutes=60.0, call_steps=0)
    assert list(recipe.within_budget(iter(range(5)), 0, args, time.monotonic())) == [0, 1, 2, 3, 4]


def test_adam_moments_shrink_to_fit_the_export(recipe):
    def state() -> dict:
        moments = {"step": torch.tensor(3.0), "exp_avg": torch.ones(1000), "exp_avg_sq": torch.ones(1000)}
        return {"optimizer": {"state": {0: dict(moments)}}}

    big = state()
    assert recipe._shrink_moments(big, 10_000, 1000) == "float32"
    assert big["optimizer"]["state"][0]["exp_avg"].dtype == torch.float32
    half = state()
    assert recipe._shrink_moments(half, 5_000, 1000) == "bfloat16"
    assert half["optimizer"]["state"][0]["exp_avg_sq"].dtype == torch.bfloat16
    none = state()
    assert recipe._shrink_moments(none, 2_000, 1000) == "dropped" and none["optimizer"]["state"] == {}


def test_the_default_text_leaves_out_the_evaluation_packages(recipe, tmp_path):
    for name in ("asyncio/base.py", "email/parser.py", "test/test_x.py", "json/decoder.py", "site-packages/p/m.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    assert recipe.text_files([str(tmp_path / "**" / "*.py")]) == [str(tmp_path / "json" / "decoder.py")]
    with pytest.raises(ValueError, match="--text-files: no file matches"):
        recipe.text_files([str(tmp_path / "nothing" / "*.py")])
