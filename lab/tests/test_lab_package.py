"""The lab as a package (lab/pyproject.toml): faast_lab is lab/ itself (an editable install, so results land beside
the scripts), its version is faast's, and scripts/lab.sh runs a lab module where neither is installed (the lent GPU
machine)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import faast
import faast_lab
from faast_lab.benchmarks import _harness
from faast_lab.experiments import _common
from test_gpu_check import _python_without_faast

ROOT = Path(__file__).resolve().parents[2]


def test_faast_lab_is_the_checkouts_lab_folder():
    assert Path(faast_lab.__file__).resolve() == ROOT / "lab" / "__init__.py"
    assert _common.ROOT == _harness.REPO == ROOT
    assert _common.RESULTS == ROOT / "lab" / "experiments" / "results" and _common.RESULTS.is_dir()
    assert _harness.RESULTS == ROOT / "lab" / "benchmarks" / "results" and _harness.RESULTS.is_dir()
    assert (_common.DATA / "reviews.jsonl").is_file()


def test_the_labs_version_and_dependency_are_faasts():
    text = (ROOT / "lab" / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'^version = "([^"]+)"$', text, re.M).group(1) == faast.__version__
    assert f'dependencies = ["faast=={faast.__version__}"]' in text


def test_lab_sh_runs_a_module_with_an_interpreter_that_has_neither_faast_nor_the_lab(tmp_path):
    python = _python_without_faast(tmp_path / "venv")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHON": python}
    alone = subprocess.run([python, "-c", "import faast_lab"], capture_output=True, text=True, env=env, cwd="/")
    assert "No module named 'faast_lab'" in alone.stderr
    script = str(ROOT / "scripts" / "lab.sh")
    done = subprocess.run(["bash", script, "benchmarks.gpu_check", "--help"], capture_output=True, text=True,
                          env=env, cwd="/", timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout and "--smoke" in done.stdout
    bare = subprocess.run(["bash", script], capture_output=True, text=True, env=env, timeout=60)
    assert bare.returncode == 2 and bare.stderr.startswith("usage: bash scripts/lab.sh MODULE")


def test_the_lab_runs_from_any_folder():
    done = subprocess.run([sys.executable, "-m", "faast_lab.benchmarks.gpu_check", "--help"], capture_output=True,
                          text=True, cwd="/", timeout=300)  # fmt: skip
    assert done.returncode == 0 and "--smoke" in done.stdout, done.stderr[-2000:]
