"""lab/benchmarks/bench_serve.py end to end on a tiny checkpoint: a real `faast serve` process learns its 8 memories
over HTTP, every load runs through the openai client, and the record holds what the results table and the goal read,
with its provenance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the serve extra")
pytest.importorskip("openai", reason="the serve extra")


def test_bench_serve_writes_a_record_of_every_load(tmp_path: Path) -> None:
    from faast_lab.benchmarks import bench_serve
    from hf_models import save_tiny_checkpoint

    ckpt = tmp_path / "tiny"
    save_tiny_checkpoint("llama", ckpt)  # printable ASCII: the packages' Python source reads without [UNK]
    out = tmp_path / "serve"
    argv = ["--base", str(ckpt), "--chars", "300", "--clients", "1", "3", "--requests", "2", "--max-tokens", "2",
            "--repeats", "1", "--threads", "1", "--out", str(out)]  # fmt: skip
    payload = bench_serve.main(argv)

    record = json.loads(out.with_suffix(".json").read_text())
    assert record["provenance"]["command"] and "git_sha" in record["provenance"]
    assert set(record["learned"]) == set(bench_serve.PACKAGES)
    assert all(m["seconds"] > 0 for m in record["learned"].values()), record["learned"]
    assert set(record["results"]) == {"1", "3"}
    for clients, modes in record["runs"].items():
        for mode in ("memories", "base"):
            (load,) = modes[mode]
            assert load["errors"] == [], (clients, mode)
            assert len(load["latencies_s"]) == int(clients) * 2  # every request of every client answered
    ratios = record["p50_ratio"]
    assert ratios == pytest.approx(
        {c: r["memories"]["p50_s"] / r["base"]["p50_s"] for c, r in record["results"].items()}, rel=1e-12
    )
    assert record["goal_met"] == all(r <= bench_serve.GOAL for r in ratios.values())
    # the server batched them: every request went through a batch, none held more than the clients of one load
    health = record["health"]
    assert 1 <= health["batches"] <= sum(int(c) * 2 * 2 for c in record["results"])
    assert 1 <= health["largest_batch"] <= 3
    assert payload["results"] == record["results"]
