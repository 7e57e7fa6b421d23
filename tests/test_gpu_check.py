"""The one-command GPU check (scripts/gpu_check.sh -> benchmarks/gpu_check.py) in its --smoke mode: every step runs end
to end on this CPU at tiny sizes (Triton interpreter), so the script a GPU session depends on cannot rot."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("build", "tests", "fidelity", "kernels", "eigh", "learn", "hf")


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    pytest.importorskip("triton")
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("gpu_check")
    env = {k: v for k, v in os.environ.items() if k not in ("FAAST_BACKEND", "FAAST_TRITON_AUTOTUNE")}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out), "--smoke"],
        env={**env, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    return out, proc


def test_every_step_runs_and_the_outdir_holds_at_most_eight_files(smoke_run):
    out, proc = smoke_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8, files
    assert {"gpu_check.json", "gpu_check.md"} <= set(files)
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["smoke"] is True
    assert [s["step"] for s in report["steps"]] == list(STEPS)
    for step in report["steps"]:
        assert step["status"] in ("ok", "skipped"), step
        if step["status"] == "skipped":
            assert step["reason"], step
    # The build needs CUDA; without it the step says why instead of failing.
    build = report["steps"][0]
    assert build["status"] == "skipped" and "CUDA" in build["reason"]


def test_each_benchmark_left_a_json_with_the_machine_header_and_the_goals_are_not_judged(smoke_run):
    out, _ = smoke_run
    for prefix in ("kernels_", "eigh_", "learn_stack_", "triton_fidelity_", "hf_overhead_"):
        found = list(out.glob(f"{prefix}*.json"))
        assert len(found) == 1, (prefix, sorted(p.name for p in out.iterdir()))
        data = json.loads(found[0].read_text())
        machine = data["provenance"]  # faast.provenance's record
        for key in ("git_sha", "torch", "command", "loadavg_at_start", "cpu_model"):
            assert key in machine, (prefix, key)
    report = json.loads((out / "gpu_check.json").read_text())
    for key in ("git_sha", "torch", "command", "loadavg_at_start", "loadavg_at_end", "cpu_model"):
        assert key in report["provenance"], key
    assert report["goals"], "the goals table is empty"
    assert all(g["met"] is None for g in report["goals"])  # tiny CPU sizes prove nothing about the goals
    text = (out / "gpu_check.md").read_text()
    assert "## Goals" in text and "## kernels_smoke" in text


def test_a_failing_step_is_recorded_and_the_next_one_still_runs(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), str(tmp_path), "--smoke", "--steps", "eigh,nope"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0 and "--steps: unknown ['nope']" in proc.stderr
    # The script as a user runs it: the tests step's pytest gets an option it does not know (exit code 4, a usage
    # error), then the eigh step must still run, and both are recorded.
    env = {k: v for k, v in os.environ.items() if k not in ("FAAST_BACKEND", "FAAST_TRITON_AUTOTUNE")}
    env["PYTEST_ADDOPTS"] = "--no-such-option-boom"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), str(tmp_path), "--smoke", "--steps", "tests,eigh"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = {s["step"]: s for s in json.loads((tmp_path / "gpu_check.json").read_text())["steps"]}
    assert list(steps) == ["tests", "eigh"]
    record = steps["eigh"]
    assert record["status"] == "ok"
    # A step whose command fails: recorded as failed with the tail of its output, not raised.
    failed = steps["tests"]
    assert failed["status"] == "failed" and failed["exit_codes"] == [4] and "boom" in failed["tail"]


def test_the_tests_step_names_only_files_that_exist(tmp_path):
    """The GPU run's test step passes its files to pytest by name: each must exist (a stale name fails the step)."""
    check = runpy.run_path(str(ROOT / "benchmarks" / "gpu_check.py"), run_name="gpu_check")  # defines, no main()
    for smoke in (False, True):
        commands = check["commands"]("tests", tmp_path, smoke)
        named = [arg for command in commands for arg in command if arg.startswith("tests/")]
        assert named, commands
        for name in named:
            assert (ROOT / name).exists(), name
        if not smoke:
            assert "tests/test_triton_kernels.py" in named and "tests/test_native.py" in named
