"""The developer scripts, CI's wiring and the test run's policy: scripts/_env.sh skips `pip install -e` when its stamp
records the same install and reinstalls on any change; CI (.ci/run) refuses to run the tests without Triton instead
of skipping the kernel tests; a faast warning that a test does not expect is an error.

The stamp tests run the real faast_env in bash against a copy of the script in a temporary root, with a fake venv
whose `pip` is a stub that logs its arguments, whose `python` is this interpreter, and whose `torch`, `faast` and
`faast_lab` (the lab, lab/ under the name its pyproject.toml maps it to) are empty packages (so nothing is downloaded
or installed and the torch installer is never reached).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "_env.sh"


class FakeCheckout:
    def __init__(self, tmp: Path):
        self.root = tmp / "root"
        self.venv = tmp / "venv"
        self.log = tmp / "pip.log"
        (self.root / "scripts").mkdir(parents=True)
        shutil.copy(SCRIPT, self.root / "scripts" / "_env.sh")
        (self.root / "setup.py").write_text("# setup v1\n")
        (self.root / "pyproject.toml").write_text("# pyproject v1\n")
        for package in ("faast", "torch"):
            (self.root / "python" / package).mkdir(parents=True)
            (self.root / "python" / package / "__init__.py").write_text("")
        (self.root / "python" / "faast" / "_version.py").write_text('__version__ = "1"\n')
        (self.root / "lab").mkdir()
        (self.root / "lab" / "__init__.py").write_text("")
        (self.root / "lab" / "pyproject.toml").write_text("# lab v1\n")
        # What the lab's editable install gives: the package faast_lab, whose files are lab/'s.
        self.lab_site = tmp / "lab_site"
        self.lab_site.mkdir()
        (self.lab_site / "faast_lab").symlink_to(self.root / "lab", target_is_directory=True)
        bin_dir = self.venv / "bin"
        bin_dir.mkdir(parents=True)
        path = f"{self.root / 'python'}:{self.lab_site}"
        self._script(bin_dir / "python", f'PYTHONPATH="{path}" exec "{sys.executable}" "$@"')
        self._script(bin_dir / "pip", f'echo "$*" >> "{self.log}"\nexit "${{FAKE_PIP_RC:-0}}"')
        (bin_dir / "activate").write_text(f'PATH="{bin_dir}:$PATH"\nexport PATH\n')

    @staticmethod
    def _script(path: Path, body: str) -> None:
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)

    def faast_env(self, extras: str, **env: str) -> int:
        """Run faast_env EXTRAS as scripts/test.sh does; returns how many editable installs pip was asked for."""
        before = self.installs()
        command = f'set -euo pipefail; . "{self.root}/scripts/_env.sh"; faast_env "$1"'
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("FAAST_")}
        full_env.update(FAAST_VENV=str(self.venv), **env)
        subprocess.run(["bash", "-c", command, "bash", extras], env=full_env, check=True, capture_output=True)
        return self.installs() - before

    def installs(self) -> int:
        if not self.log.exists():
            return 0
        return sum(line.startswith("install --quiet -e ") for line in self.log.read_text().splitlines())

    def lab_installs(self) -> int:
        if not self.log.exists():
            return 0
        return self.log.read_text().splitlines().count(f"install --quiet --no-deps -e {self.root}/lab")


@pytest.fixture
def checkout(tmp_path):
    if shutil.which("bash") is None:
        pytest.skip("the scripts are bash")
    return FakeCheckout(tmp_path)


def test_second_run_with_nothing_changed_skips_pip(checkout):
    assert checkout.faast_env("test") == 1
    assert checkout.log.read_text().splitlines() == [
        f"install --quiet -e {checkout.root}[test]",
        f"install --quiet --no-deps -e {checkout.root}/lab",  # the test extra brings the lab's tests
    ]
    assert checkout.faast_env("test") == 0
    assert checkout.faast_env("test") == 0


def test_other_extras_install_once_and_both_stay_recorded(checkout):
    assert checkout.faast_env("test") == 1
    assert checkout.faast_env("demo,experiments") == 1
    assert checkout.faast_env("test") == 0
    assert checkout.faast_env("experiments,demo") == 0  # the order of the extras does not matter


@pytest.mark.parametrize("name", ["setup.py", "pyproject.toml", "python/faast/_version.py", "lab/pyproject.toml"])
def test_a_packaging_change_reinstalls_every_extras_set(checkout, name):
    assert checkout.faast_env("test") == 1
    assert checkout.faast_env("demo") == 1
    (checkout.root / name).write_text("# changed\n")
    assert checkout.faast_env("test") == 1
    assert checkout.faast_env("test") == 0
    assert checkout.faast_env("demo") == 1


def test_a_new_torch_spec_reinstalls(checkout):
    assert checkout.faast_env("test") == 1
    assert checkout.faast_env("test", FAAST_TORCH_SPEC="torch==9.9.9") == 1
    assert checkout.faast_env("test", FAAST_TORCH_SPEC="torch==9.9.9") == 0


def test_a_failed_install_is_not_recorded(checkout):
    with pytest.raises(subprocess.CalledProcessError):
        checkout.faast_env("test", FAKE_PIP_RC="1")
    assert checkout.installs() == 1
    assert checkout.faast_env("test") == 1
    assert checkout.faast_env("test") == 0


def test_the_lab_comes_with_the_test_and_experiments_extras_only(checkout):
    assert checkout.faast_env("demo") == 1 and checkout.lab_installs() == 0
    assert checkout.faast_env("demo,experiments") == 1 and checkout.lab_installs() == 1
    assert checkout.faast_env("test") == 1 and checkout.lab_installs() == 2


def test_a_venv_that_lost_the_lab_reinstalls(checkout):
    assert checkout.faast_env("test") == 1
    (checkout.lab_site / "faast_lab").unlink()  # `faast_lab` no longer imports from this checkout's lab/
    assert checkout.faast_env("test") == 1 and checkout.lab_installs() == 2
    assert checkout.faast_env("demo") == 1  # the demo does not need the lab
    assert checkout.faast_env("demo") == 0


def test_a_venv_that_lost_faast_reinstalls(checkout):
    assert checkout.faast_env("test") == 1
    # No __init__.py: `faast` no longer imports from this checkout (the stamp itself is unchanged).
    (checkout.root / "python" / "faast" / "__init__.py").unlink()
    assert checkout.faast_env("test") == 1


# ---------------------------------------------------------------------------------------------------- Triton in CI


def _collect_kernel_tests(tmp_path, **env):
    """`pytest --collect-only` of the kernel tests in a subprocess where `import triton` fails."""
    blocked = tmp_path / "blocked" / "triton"
    blocked.mkdir(parents=True, exist_ok=True)
    (blocked / "__init__.py").write_text('raise ModuleNotFoundError("triton blocked by the test", name="triton")\n')
    path = os.pathsep.join([str(blocked.parent), *(p for p in sys.path if p)])
    full_env = {k: v for k, v in os.environ.items() if k != "FAAST_REQUIRE_TRITON"}
    full_env.update(PYTHONPATH=path, **env)
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
               "tests/test_triton_kernels.py", "tests/test_triton_backend.py"]  # fmt: skip
    return subprocess.run(command, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=300)


def test_without_triton_ci_stops_and_a_developer_machine_skips_the_kernel_tests(tmp_path):
    ci = _collect_kernel_tests(tmp_path, FAAST_REQUIRE_TRITON="1")
    assert ci.returncode == pytest.ExitCode.USAGE_ERROR, ci.stdout + ci.stderr
    assert "FAAST_REQUIRE_TRITON is set" in ci.stderr and "triton blocked by the test" in ci.stderr
    developer = _collect_kernel_tests(tmp_path)
    assert developer.returncode in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED), developer.stderr
    assert developer.stdout.count("SKIPPED") == 2 and "could not import 'triton'" in developer.stdout


def test_ci_requires_triton_on_linux_and_the_test_extra_installs_it():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "export FAAST_REQUIRE_TRITON=1" in ci and "bash scripts/test.sh" in ci
    setup = (ROOT / "setup.py").read_text()
    assert "\"triton==3.9.*; platform_system == 'Linux'\"" in setup


def test_ci_lints_before_the_tests_with_the_tools_pinned_in_the_test_extra():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "bash scripts/test.sh" in ci  # the README's test command, which lints first when run without arguments
    test = (ROOT / "scripts" / "test.sh").read_text()
    assert test.index('bash "$ROOT/scripts/lint.sh"') < test.index('python -m pytest "$@"')
    assert 'if [ $# -eq 0 ]; then\n  bash "$ROOT/scripts/lint.sh"' in test
    lint = (ROOT / "scripts" / "lint.sh").read_text()
    assert "set -euo pipefail" in lint and "faast_env test" in lint
    for check in ('ruff check "${PATHS[@]}"', 'ruff format --check "${PATHS[@]}"', "\nmypy\n"):
        assert check in lint, check
    setup = (ROOT / "setup.py").read_text()
    test_extra = setup[setup.index('"test": [') : setup.index('"demo": HF')]
    assert re.search(r'"ruff==[\d.]+"', test_extra) and re.search(r'"mypy==[\d.]+"', test_extra)


# ---------------------------------------------------------------------------------------------------- warnings


def test_a_faast_warning_a_test_does_not_expect_is_an_error():
    import warnings

    from faast import FastWeights

    memory = FastWeights(4, 2).update(torch.randn(10, 4), torch.randn(10, 2))
    with pytest.raises(UserWarning, match="one-off solve"):
        memory.solve(alpha=0.5)  # warns (once per memory): pyproject.toml's "error::Warning:faast" makes it raise
    other = FastWeights(4, 2).update(torch.randn(10, 4), torch.randn(10, 2))
    with pytest.warns(UserWarning, match="one-off solve") as caught:
        other.solve(alpha=0.5)  # expected: recorded, not raised, and still shown at the caller's line
    assert caught[0].filename == __file__
    with pytest.warns(UserWarning, match="not from faast"):
        warnings.warn("not from faast", UserWarning, stacklevel=1)  # other code's warnings keep their filters
