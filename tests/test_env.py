"""python -m faast.env: the environment report a user pastes into a bug report."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from faast import env
from faast.ops import _dispatch


def test_report_names_versions_and_the_backend_auto_picks():
    info = env.report()
    assert info["torch"] == torch.__version__ and info["cuda_available"] == torch.cuda.is_available()
    chain = info["backends"]["accumulate_gram on cpu"]
    chosen = next(c["backend"] for c in chain if c["skipped_because"] is None)
    assert chosen == _dispatch.resolve("accumulate_gram", torch.device("cpu"))[0]
    assert "faast._C" in info["native_extension"]


def test_command_line_json_and_text():
    done = subprocess.run([sys.executable, "-m", "faast.env", "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert {"faast", "torch", "triton_installed", "backends"} <= set(info)
    text = subprocess.run([sys.executable, "-m", "faast.env"], capture_output=True, text=True, timeout=120)
    assert text.returncode == 0 and "eigh on cpu" in text.stdout


def test_a_report_can_be_written_as_a_result_record_with_its_provenance(tmp_path, capsys):
    from faast import env

    info = env.main(["--out", str(tmp_path / "report")]) or json.loads((tmp_path / "report.json").read_text())
    record = json.loads((tmp_path / "report.json").read_text())
    assert "-m faast.env --out" in record["provenance"]["command"] and "backends" in record
    assert "eigh on cpu" in (tmp_path / "report.md").read_text() and "eigh on cpu" in capsys.readouterr().out
    assert info["faast"] == record["faast"]
