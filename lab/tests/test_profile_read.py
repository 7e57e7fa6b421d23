"""lab/benchmarks/profile_read.py, the profile a lent GPU runs after gpu_check: its smoke mode end to end on a tiny
Llama, the counts it reports, and its argument checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = "faast_lab.benchmarks.profile_read"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("FAAST_BACKEND", "PYTHONPATH")}
    return subprocess.run([sys.executable, "-m", SCRIPT, *args], env=env, capture_output=True, text=True, timeout=600)


def test_the_smoke_profile_reports_every_case_and_the_operators_the_read_adds(tmp_path):
    pytest.importorskip("transformers")
    proc = _run("--model", "tiny", "--smoke", "--out-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads((tmp_path / "profile_read_tiny_smoke.json").read_text())
    assert "git_sha" in data["provenance"]
    cases = data["cases"]
    assert list(cases) == ["base", "probability", "probability, torch mixture", "probability, fused mixture", "logit"]
    assert cases["probability, torch mixture"]["backend"] == "mix_probabilities=torch"
    assert cases["probability, fused mixture"]["backend"] == "mix_probabilities=triton"
    assert "backend" not in cases["probability"]
    assert data["auto_mixture"] == {}  # a CPU's read does not dispatch the mixture, so auto timed nothing
    assert cases["base"]["vs_base"] == 1.0
    for name, case in cases.items():
        assert len(case["wall_s"]) == data["reps"] == 2, name
        assert case["median_s"] == pytest.approx(sorted(case["wall_s"])[0] / 2 + sorted(case["wall_s"])[1] / 2)
        assert case["kernels"] == 0  # no CUDA device here
        assert case["top_host"] and all(r["name"].startswith("aten::") for r in case["top_host"])
    # The memory is on (tuned or forced), so both reads run operators the base pass does not.
    assert data["step"] > 0 and data["weight"] > 0
    assert cases["probability"]["aten_ops"] > cases["base"]["aten_ops"]
    assert cases["logit"]["aten_ops"] > cases["base"]["aten_ops"]
    # The probability-space mixture (faast/hf/mixture.py) is the only logaddexp of the three passes.
    assert cases["probability"]["op_counts"].get("aten::logaddexp", 0) >= 1
    assert "aten::logaddexp" not in cases["logit"]["op_counts"] and "aten::logaddexp" not in cases["base"]["op_counts"]
    assert sum(cases["base"]["op_counts"].values()) == cases["base"]["aten_ops"]
    mixture = data["mixture"]  # the interpreter runs the kernel here (conftest's TRITON_INTERPRET=1 is inherited)
    assert mixture["rows"] == 2 * 64 and mixture["vocab"] == 512
    assert mixture["torch_ms"] > 0 and mixture["triton_ms"] > 0
    assert mixture["torch_over_triton"] == pytest.approx(mixture["torch_ms"] / mixture["triton_ms"])
    assert mixture["max_abs_diff"] < 1e-4
    md = (tmp_path / "profile_read_tiny_smoke.md").read_text()
    assert "| probability |" in md and "| logit |" in md


@pytest.mark.parametrize("flag", ["--reps", "--batch", "--seq", "--learn-batches"])
def test_a_non_positive_size_is_refused_naming_the_argument(flag, tmp_path):
    proc = _run("--model", "tiny", flag, "0", "--out-dir", str(tmp_path))
    assert proc.returncode == 2
    assert f"{flag}: expected a positive integer, got 0" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_auto_choices_for_the_mixture_are_read_from_the_runs_cache_and_the_backend_is_restored(tmp_path, monkeypatch):
    from faast.ops import backends
    from faast_lab.benchmarks import profile_read

    cache = tmp_path / "autotune.json"
    mix = {"choice": "triton", "seconds": {"torch": 0.0018, "triton": 0.0004}}
    key = "mix_probabilities rows1024 V49152 torch.bfloat16/torch.bfloat16"
    entries = {"GPU | torch x": {key: mix, "eigh B64 d1600": {"choice": "cuda", "seconds": {"cuda": 0.4}}}}
    backends.write_measured_choices(entries, cache)
    monkeypatch.setenv("FAAST_AUTOTUNE_CACHE", str(cache))
    assert profile_read._auto_mixture_choices() == {key: mix}
    monkeypatch.setenv("FAAST_AUTOTUNE_CACHE", str(tmp_path / "none.json"))
    assert profile_read._auto_mixture_choices() == {}
    monkeypatch.setenv("FAAST_BACKEND", "eigh=torch")
    with profile_read._backend("mix_probabilities=triton"):
        assert os.environ["FAAST_BACKEND"] == "mix_probabilities=triton"
    assert os.environ["FAAST_BACKEND"] == "eigh=torch"
    monkeypatch.delenv("FAAST_BACKEND")
    with profile_read._backend("mix_probabilities=torch"):
        assert os.environ["FAAST_BACKEND"] == "mix_probabilities=torch"
    assert "FAAST_BACKEND" not in os.environ
