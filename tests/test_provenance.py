"""faast.provenance: the record every benchmark and experiment writes beside its numbers."""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import faast
from faast import hardware, provenance

ROOT = Path(__file__).resolve().parents[1]


def git(folder: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.org", "-c", "commit.gpgsign=false", *args],
        cwd=folder, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stdout.strip()


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """A one-commit git repository; FAAST_GIT_SHA unset so the repository itself is read."""
    monkeypatch.delenv("FAAST_GIT_SHA", raising=False)
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "bench.py").write_text("print(1)\n")
    git(repo, "add", "bench.py")
    git(repo, "commit", "-q", "-m", "one")
    return repo


def installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def test_each_field_of_the_record(checkout, monkeypatch):
    loads = iter([(1.234, 5.0, 6.0), (0.5, 0.25, 0.125)])
    monkeypatch.setattr(os, "getloadavg", lambda: next(loads))
    before = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    record = provenance.start(checkout, argv=[str(checkout / "bench.py"), "--quick"])
    after = dt.datetime.now(dt.timezone.utc)
    assert record["git_sha"] == git(checkout, "rev-parse", "HEAD") and len(record["git_sha"]) == 40
    assert record["git_dirty"] is False
    assert record["faast"] == faast.__version__ and record["torch"] == installed("torch")
    assert record["triton"] == installed("triton") and record["transformers"] == installed("transformers")
    assert record["python"] == ".".join(map(str, sys.version_info[:3]))
    expected_device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    assert record["device"] == expected_device and ("gpu" in record) == torch.cuda.is_available()
    assert isinstance(record["cpu_model"], str) and record["cpu_model"]
    assert 1 <= record["physical_cores"] <= record["logical_cores"] == os.cpu_count()
    assert record["torch_threads"] == torch.get_num_threads()
    assert record["cpu_native_bf16"] is hardware.cpu_has_bf16()
    assert record["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert record["loadavg_at_start"] == 1.23 and record["loadavg_at_end"] is None
    assert provenance.finish(record)["loadavg_at_end"] == 0.5
    date = dt.datetime.fromisoformat(record["date"])
    assert date.utcoffset() == dt.timedelta(0) and before <= date <= after
    assert record["command"] == f"{Path(sys.executable).name} bench.py --quick"
    json.dumps(record)  # every value is plain JSON


def test_a_changed_tracked_file_makes_the_tree_dirty_and_an_untracked_one_does_not(checkout):
    (checkout / "notes.txt").write_text("untracked\n")
    assert provenance.start(checkout, argv=[])["git_dirty"] is False
    (checkout / "bench.py").write_text("print(2)\n")
    record = provenance.start(checkout, argv=[])
    assert record["git_dirty"] is True and record["git_sha"] == git(checkout, "rev-parse", "HEAD")
    assert "(working tree differs from it)" in provenance.markdown(record)


def test_a_copy_without_git_is_told_its_sha_or_records_none(tmp_path, monkeypatch):
    monkeypatch.delenv("FAAST_GIT_SHA", raising=False)
    assert provenance.git_state(tmp_path) == (None, None)
    monkeypatch.setenv("FAAST_GIT_SHA", "0123abc+dirty")
    assert provenance.git_state(tmp_path) == ("0123abc", True)
    monkeypatch.setenv("FAAST_GIT_SHA", "0123abc")
    assert provenance.git_state(tmp_path) == ("0123abc", False)


def test_no_absolute_path_of_the_checkout_or_the_home_folder_appears(checkout):
    home = Path.home()
    argv = [
        str(checkout / "benchmarks" / "bench.py"), "--out", str(checkout / "results"), f"--data={checkout}/d.jsonl",
        "--root", str(checkout), "--model", str(home / "models" / "m"),
    ]  # fmt: skip
    record = provenance.start(checkout, argv=argv)
    assert record["command"].split(" ", 1)[1] == (
        "benchmarks/bench.py --out results --data=d.jsonl --root . --model ~/models/m"
    )
    text = json.dumps(record) + provenance.markdown(record)
    assert str(checkout) not in text and (str(home) == "/" or str(home) + "/" not in text)
    # This repository's own checkout, run as the benchmarks run it.
    own = provenance.start(ROOT, argv=[str(ROOT / "benchmarks" / "bench_learn.py"), "--out", str(ROOT / "x")])
    assert str(ROOT) not in json.dumps(own) and own["command"].endswith("benchmarks/bench_learn.py --out x")


def test_write_puts_the_record_in_the_json_and_the_header_in_the_markdown(checkout, tmp_path):
    record = provenance.start(checkout, argv=["bench.py"])
    payload = {"rows": [{"ppl": 3.5, "bad": math.nan}], "note": "é"}
    json_path, md_path = provenance.write(tmp_path / "out" / "r", record, payload, "A title", ["line one", "", "x"])
    data = json.loads(json_path.read_text(encoding="utf-8"))
    assert list(data) == ["provenance", "rows", "note"]
    assert data["provenance"]["git_sha"] == record["git_sha"] and data["provenance"]["loadavg_at_end"] is not None
    assert data["rows"] == [{"ppl": 3.5, "bad": None}] and data["note"] == "é"
    text = md_path.read_text(encoding="utf-8").splitlines()
    assert text[:2] == ["# A title", ""]
    header = provenance.markdown(data["provenance"]).splitlines()
    lines = 4 + bool(record["environment"])
    assert len(header) == lines and text[2 : 2 + lines] == header and text[2 + lines :] == ["", "line one", "", "x"]
    assert header[0].startswith("- run: ") and f"git {record['git_sha']}" in header[0] and "`python" in header[0]
    assert f"torch {record['torch']}" in header[1] and f"faast {faast.__version__}" in header[1]
    assert record["cpu_model"] in header[2] and "load average (1 min)" in header[3]
    bf16 = "multiplies bfloat16 natively" if record["cpu_native_bf16"] else "no native bfloat16"
    assert f"{bf16}, torch CPU kernels {record['cpu_capability']}" in header[2]
    older = {k: v for k, v in data["provenance"].items() if k != "cpu_native_bf16"}  # written before the field
    assert "bfloat16" not in provenance.markdown(older).splitlines()[2]


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="root: expected an existing folder"):
        provenance.start(tmp_path / "nope")
    record = provenance.start(tmp_path, argv=[])
    with pytest.raises(ValueError, match="payload: expected no key 'provenance'"):
        provenance.to_json({"provenance": 1}, record)
    with pytest.raises(ValueError, match="title: expected one non-empty line"):
        provenance.write(tmp_path / "r", record, {}, "two\nlines")


def test_the_variables_that_change_a_run_are_recorded_and_shown(checkout, monkeypatch):
    # A run with a forced backend or a limited instruction set must say so (an AVX2-limited run on AVX-512 cores
    # otherwise reads like one on the full instruction set).
    for name in [n for n in os.environ if n.startswith("FAAST_") or n in provenance.ENVIRONMENT]:
        monkeypatch.delenv(name)
    assert provenance.start(checkout, argv=["x"])["environment"] == {}
    record = provenance.start(checkout, argv=["x"])
    assert not any(line.startswith("- environment") for line in provenance.markdown(record).splitlines())
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    monkeypatch.setenv("FAAST_BACKEND", "eigh=torch")
    monkeypatch.setenv("FAAST_GIT_SHA", "abc")  # recorded as git_sha, not twice
    monkeypatch.setenv("UNRELATED_VARIABLE", "1")
    record = provenance.start(checkout, argv=["x"])
    assert record["environment"] == {"FAAST_BACKEND": "eigh=torch", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    last = provenance.markdown(record).splitlines()[-1]
    assert last == "- environment: FAAST_BACKEND=eigh=torch MKL_ENABLE_INSTRUCTIONS=AVX2"


def test_the_command_of_a_module_run_is_recorded_as_typed(checkout, monkeypatch):
    # `python -m pkg.mod` leaves the file path in sys.argv[0]; the record shows the -m form from sys.orig_argv.
    exe = Path(sys.executable).name
    monkeypatch.setattr(sys, "argv", [str(checkout / "pkg" / "mod.py"), "--out", str(checkout / "results")])
    monkeypatch.setattr(sys, "orig_argv", ["/opt/py/bin/python3", "-u", "-m", "pkg.mod", "--out", str(checkout / "r")])
    assert provenance.command_line() == ["-u", "-m", "pkg.mod", "--out", str(checkout / "r")]
    assert provenance.start(checkout)["command"] == f"{exe} -u -m pkg.mod --out r"
    monkeypatch.setattr(sys, "orig_argv", [])  # an embedded interpreter: sys.argv is all there is
    assert provenance.start(checkout)["command"] == f"{exe} pkg/mod.py --out results"
    # A real module run, in a fresh interpreter.
    (checkout / "pkg").mkdir()
    (checkout / "pkg" / "__init__.py").write_text("")
    code = "import sys\nfrom faast import provenance\nprint(provenance.start(sys.argv[1])['command'])\n"
    (checkout / "pkg" / "mod.py").write_text(code)
    done = subprocess.run([sys.executable, "-m", "pkg.mod", str(checkout), "--quick"], cwd=checkout,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == f"{exe} -m pkg.mod . --quick"
