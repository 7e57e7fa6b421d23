"""lab/benchmarks/bench_auto_choice.py, which times every candidate of auto's measured choices against the one auto
picks: its smoke run reports a choice, with every candidate's time, for each op."""

import json
import os
import subprocess
import sys

from faast.ops import backends


def test_bench_auto_choice_smoke_reports_a_choice_for_every_op(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != backends.BACKEND_ENV_VAR}
    done = subprocess.run(
        [sys.executable, "-m", "faast_lab.benchmarks.bench_auto_choice", "--out", str(tmp_path), "--smoke",
         "--no-wait-quiet"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "auto_choice_cpu.json").read_text())
    rows = data["payload"]["rows"] if "payload" in data else data["rows"]
    assert {r["op"] for r in rows} == {"accumulate_gram", "eigh", "residual_project"}
    for row in rows:
        assert row["auto"] in row["full_seconds"] and isinstance(row["full_seconds"][row["auto"]], float)
        assert row["auto_is_fastest"] is (row["fastest"] == row["auto"])
