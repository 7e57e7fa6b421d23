"""The repeated timing of FAAST against one LoRA epoch (lab/experiments/lm_suite_timing.py): its runner on a tiny
model and a fake tree, and its report's ratios."""

from __future__ import annotations

import json

import pytest

from faast.hf.tokens import overlapping_windows, token_lists
from faast_lab.experiments import lm_suite_timing
from test_lm_suite import fake_manifest, fake_tree, loader
from tolerances import REORDER_REL

ARGS = ["--learn-tokens", "800", "--learn-window", "64", "--learn-batch-size", "4", "--train-window", "32"]


def test_each_round_times_both_sides_in_alternating_order_beside_the_reference_and_resumes(tmp_path):
    pytest.importorskip("peft")
    bases, sources = fake_tree(tmp_path / "tree")
    manifest = fake_manifest(bases, sources)
    out = tmp_path / "timing"
    argv = [*ARGS, "--repeats", "2", "--warmup", "1", "--domains", "code", "--out", str(out)]
    paths = lm_suite_timing.main(argv, load_model=loader, manifest=manifest, bases=bases)
    assert [p.name for p in paths] == ["code.json"] == [p.name for p in out.iterdir()]
    shard = json.loads(paths[0].read_text())
    assert shard["provenance"]["git_sha"] and shard["protocol"]["repeats"] == 2 and shard["protocol"]["warmup"] == 1
    assert shard["learned_tokens"] == 800 and shard["kind"] == "python"
    rounds = shard["rounds"]
    assert [r["order"] for r in rounds] == [["faast", "lora"], ["lora", "faast"]]
    for r in rounds:
        assert r["faast"]["seconds"] == pytest.approx(r["faast"]["pass_s"] + r["faast"]["solve_s"], rel=REORDER_REL)
        assert r["ratio"] == pytest.approx(r["faast"]["seconds"] / r["lora"]["seconds"], rel=REORDER_REL)
        assert r["lora"]["steps"] >= 1
        assert all(g > 0 for s in ("faast", "lora") for g in r[s]["reference_gflops"])
    before = paths[0].read_text()
    lm_suite_timing.main(argv, load_model=loader, manifest=manifest, bases=bases)  # resumes: nothing runs again
    assert paths[0].read_text() == before
    with pytest.raises(SystemExit, match="another protocol"):
        lm_suite_timing.main([*argv[:-4], "--repeats", "3", "--domains", "code", "--out", str(out)],
                             load_model=loader, manifest=manifest, bases=bases)  # fmt: skip


def test_with_base_each_round_also_times_the_base_forward_over_the_learning_windows_in_reversed_order(tmp_path):
    pytest.importorskip("peft")
    bases, sources = fake_tree(tmp_path / "tree")
    manifest = fake_manifest(bases, sources)
    out = tmp_path / "timing"
    argv = [*ARGS, "--repeats", "2", "--base", "--domains", "code", "--out", str(out)]
    (path,) = lm_suite_timing.main(argv, load_model=loader, manifest=manifest, bases=bases)
    shard = json.loads(path.read_text())
    assert shard["protocol"]["base"] is True
    rounds = shard["rounds"]
    assert [r["order"] for r in rounds] == [["faast", "lora", "base"], ["base", "lora", "faast"]]
    # the learned tokens in windows of 64 overlapping by one, as FAAST learns them
    texts = lm_suite_timing.suite.domain_texts("code", manifest, bases)[0]
    learn = token_lists(texts, loader("t")[1], 800)
    windows = [w for ids in learn for w in overlapping_windows(ids, 64)]
    assert sum(len(x) for x in learn) == 800 and rounds[0]["base"]["windows"] == len(windows) > 1
    for r in rounds:
        assert r["base"]["seconds"] > 0 and all(g > 0 for g in r["base"]["reference_gflops"])
        assert r["base_ratio"] == pytest.approx(r["base"]["seconds"] / r["lora"]["seconds"], rel=REORDER_REL)
        assert r["faast_over_base"] == pytest.approx(r["faast"]["pass_s"] / r["base"]["seconds"], rel=REORDER_REL)
    text = lm_suite_timing.report([path])
    assert "| base forward s | FAAST's pass / base forward | base forward / LoRA epoch |" in text
    assert "The base forward alone is" in text
    alone = text.split("The base forward alone is ")[1].split(" of LoRA's epoch")[0]
    assert " to " not in alone and alone.endswith("×")  # one domain: one value, not a span from it to itself
    # the folders timed without --base resume under the protocol they ran
    assert "base" not in lm_suite_timing.protocol(lm_suite_timing.parse_args([*ARGS, "--out", "x"]), "m")


def shard(domain: str, rounds: list[tuple[float, float, float, float]]) -> dict:
    """A shard of rounds (FAAST s, its reference GFLOP/s, LoRA s, its reference GFLOP/s)."""
    return {"domain": domain, "kind": "k", "provenance": {"cpu_model": "cpu", "cpu_flags": ["avx2"]},
            "rounds": [{"faast": {"seconds": f, "pass_s": f - 1, "solve_s": 1.0, "reference_gflops": [fg, fg]},
                        "lora": {"seconds": lo, "reference_gflops": [lg, lg]}, "ratio": f / lo}
                       for f, fg, lo, lg in rounds]}  # fmt: skip


def test_the_scaled_ratio_counts_a_side_at_the_speed_the_reference_saw_during_it():
    # FAAST ran while the machine was at half the speed LoRA saw: its 60 s are 30 s at LoRA's speed.
    row = shard("a", [(60.0, 50.0, 100.0, 100.0)])["rounds"][0]
    assert row["ratio"] == pytest.approx(0.6)
    assert lm_suite_timing.scaled_ratio(row) == pytest.approx(0.3)


def test_the_report_puts_the_worst_median_first_and_names_it(tmp_path):
    paths = []
    for name, rounds in {
        "fast": [(40.0, 1.0, 100.0, 1.0)] * 3,
        "slow": [(50.0, 1.0, 100.0, 1.0), (70.0, 1.0, 100.0, 1.0), (55.0, 1.0, 100.0, 1.0)],
    }.items():
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(shard(name, rounds)))
    text = lm_suite_timing.report(paths)
    table = [line for line in text.splitlines() if line.startswith("| ") and "domain" not in line]
    assert table[0].startswith("| slow |") and "**0.550**" in table[0]
    assert table[1].startswith("| fast |") and "**0.400**" in table[1]
    assert "Worst median ratio 0.550× (slow)" in text
    with pytest.raises(ValueError, match="expected shard records"):
        lm_suite_timing.report([])
