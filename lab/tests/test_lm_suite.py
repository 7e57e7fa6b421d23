"""The domain suite (lab/experiments/suite.py), its leave-one-kind-out choice and heuristic rule (loko.py), its runner
(lm_suite.py) on a tiny model and a fake tree, and its report (lm_suite_report.py, scripts/results_formats.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

import pytest

from faast import provenance
from faast.hf.output import REMOVED_FIELDS
from faast.hf.output.diagnosis import document_shrink
from faast_lab.benchmarks import _harness as H
from faast_lab.experiments import lm_suite, lm_suite_report, loko, suite
from hf_models import CharTokenizer, tiny_model
from tolerances import REORDER_REL

# --------------------------------------------------------------------------------------------- leave one kind out


def planted_table() -> tuple[dict, dict]:
    """Three kinds. "own" is far the best on kind A's domains and poor elsewhere; "other" is the best on B and C."""
    table = {"a1": {"own": 0.30, "other": 0.05}, "a2": {"own": 0.25, "other": 0.04},
             "b1": {"own": 0.01, "other": 0.10}, "b2": {"own": 0.02, "other": 0.12},
             "c1": {"own": -0.01, "other": 0.08}}  # fmt: skip
    return table, {"a1": "A", "a2": "A", "b1": "B", "b2": "B", "c1": "C"}


def test_loko_never_lets_a_domains_kind_choose_its_settings():
    table, kinds = planted_table()
    report = loko.loko(table, kinds, lora={"a1": 0.10, "b1": 0.20})
    chosen = {c.domain: c for c in report.choices}
    # On a1 "own" is best on its own kind (and on itself), but a1's figure comes from the other kinds' choice.
    assert chosen["a1"].own_best == "own" and chosen["a1"].setting == "other"
    assert chosen["a1"].reduction == 0.05 and chosen["a1"].score == pytest.approx(0.10)  # median of b1, b2, c1
    # For B's domains the other kinds are A and C: "own" wins there (median of 0.30, 0.25, -0.01).
    assert chosen["b1"].setting == "own" and chosen["b1"].reduction == 0.01
    assert chosen["a1"].share == pytest.approx(0.5) and chosen["a2"].share is None  # no LoRA record for a2
    assert report.kinds["A"]["median"] == pytest.approx(0.045) and report.kinds["A"]["worst"] == 0.04
    # For c1 the other kinds are A and B: "own" (median 0.135 against 0.075), which costs c1 1%: the suite's worst.
    assert chosen["c1"].setting == "own" and report.worst == -0.01 and report.worst_domain == "c1"
    # Whatever the domains of a1's kind read (a1 itself included), a1's choice does not move.
    rng = random.Random(0)
    for _ in range(20):
        shaken = {d: {s: (rng.uniform(-1, 1) if kinds[d] == "A" else r) for s, r in row.items()}
                  for d, row in table.items()}  # fmt: skip
        assert loko.choose_setting(shaken, kinds, "a1") == ("other", pytest.approx(0.10))


def test_loko_ties_go_to_the_better_worst_then_the_order_given():
    kinds = {"a": "A", "b1": "B", "b2": "B", "b3": "B"}
    table = {"a": {"x": 0.0, "y": 0.0, "z": 0.0}, "b1": {"x": 0.1, "y": 0.1, "z": 0.1},
             "b2": {"x": 0.2, "y": 0.2, "z": 0.2}, "b3": {"x": 0.3, "y": 0.3, "z": 0.3}}  # fmt: skip
    assert loko.choose_setting(table, kinds, "a", ["y", "x", "z"])[0] == "y"  # all tie: the first given
    table["b1"]["x"] = 0.1 + loko.TIE / 2  # the same solve read in another run: still a tie
    table["b2"]["x"] = 0.2 + loko.TIE / 2
    assert loko.choose_setting(table, kinds, "a", ["y", "x", "z"])[0] == "y"
    table["b1"]["z"] = 0.15  # the same median, a better worst
    assert loko.choose_setting(table, kinds, "a", ["y", "x", "z"])[0] == "z"
    # The setting best on a domain itself: a tie within TIE names the one given first, a clear win the winner.
    assert loko.best_on_itself({"x": 0.2 + loko.TIE / 2, "y": 0.2}, ["y", "x"]) == "y"
    assert loko.best_on_itself({"x": 0.2 + 2 * loko.TIE, "y": 0.2}, ["y", "x"]) == "x"
    assert loko.best_on_itself({"x": 0.3}, ["y", "x"]) == "x"  # a setting not measured on the domain is passed by
    with pytest.raises(ValueError, match="at least two kinds"):
        loko.loko({"b1": table["b1"]}, {"b1": "B"})
    with pytest.raises(ValueError, match="missing \\['a'\\]"):
        loko.loko(table, {"b1": "B", "b2": "B", "b3": "B"})


def rule_table(on_gain: float, worst_gain: float = 0.0, low: float | None = None) -> tuple[dict, dict]:
    """Six domains of three kinds; "off" reduces 10% (12% on d0, 5% on d5, the worst); "on" adds on_gain to every
    domain and worst_gain to d5; low: "on"'s reduction on d3 instead."""
    kinds = {f"d{i}": "ABC"[i // 2] for i in range(6)}
    table = {}
    for i, d in enumerate(kinds):
        off = 0.12 if i == 0 else 0.05 if i == 5 else 0.10
        on = off + on_gain + (worst_gain if i == 5 else 0.0)
        table[d] = {"off": off, "on": low if (low is not None and d == "d3") else on}
    return table, kinds


def test_a_heuristic_pays_by_half_a_point_of_median_or_a_point_of_worst():
    table, kinds = rule_table(0.006)
    verdict = loko.heuristic_pays(table, kinds, on=["on"], off=["off"])
    assert verdict.pays and verdict.floor_ok and verdict.median_gain == pytest.approx(0.006)
    table, kinds = rule_table(0.002)
    verdict = loko.heuristic_pays(table, kinds, on=["on"], off=["off"])
    assert not verdict.pays and verdict.floor_ok and "gains too little" in verdict.reason
    table, kinds = rule_table(0.0, worst_gain=0.015)  # the median does not move; the worst domain gains 1.5 points
    verdict = loko.heuristic_pays(table, kinds, on=["on"], off=["off"])
    assert verdict.pays and verdict.worst_gain == pytest.approx(0.015) and verdict.median_gain == pytest.approx(0)


def test_a_heuristic_that_makes_a_domain_worse_than_zero_shot_plus_0_3_percent_does_not_pay():
    table, kinds = rule_table(0.02, low=-0.004)  # +2 points of median, but d3 0.4% worse than zero-shot
    verdict = loko.heuristic_pays(table, kinds, on=["on"], off=["off"])
    assert not verdict.pays and not verdict.floor_ok and verdict.worst_point == ("d3", -0.004)
    assert "breaks the floor" in verdict.reason
    table, kinds = rule_table(0.02, low=-0.002)  # 0.2% worse: inside the floor
    assert loko.heuristic_pays(table, kinds, on=["on"], off=["off"]).pays
    # ... unless a curve point of the chosen setting is below it.
    curve = {"d1": {"on": [-0.0035, 0.05, 0.11]}}
    verdict = loko.heuristic_pays(table, kinds, on=["on"], off=["off"], curve=curve)
    assert not verdict.pays and verdict.worst_point == ("d1", -0.0035)
    # A domain past the floor without the mechanism too is not its doing: the rule asks that it make none so.
    curve["d1"]["off"] = [-0.0034, 0.04, 0.10]
    verdict = loko.heuristic_pays(table, kinds, on=["on"], off=["off"], curve=curve)
    assert verdict.pays and verdict.floor_ok and verdict.worst_point == ("d1", -0.0035)
    curve["d1"]["off"] = [-0.0029, 0.04, 0.10]  # within the floor without it: now the mechanism made d1 break it
    assert not loko.heuristic_pays(table, kinds, on=["on"], off=["off"], curve=curve).floor_ok
    with pytest.raises(ValueError, match="disjoint"):
        loko.heuristic_pays(table, kinds, on=["on"], off=["on"])


# ---------------------------------------------------------------------------------------------------- the suite


def test_the_suite_has_at_least_24_domains_of_8_kinds_each_big_enough():
    assert len(suite.SOURCES) >= 24 and len({s.kind for s in suite.SOURCES}) >= 8
    manifest = suite.load_manifest()
    assert [(d["name"], d["kind"], d["root"]) for d in manifest["domains"]] == [
        (s.name, s.kind, s.root) for s in suite.SOURCES
    ]
    for d in manifest["domains"]:
        assert d["learn_tokens"] >= suite.MIN_LEARN_TOKENS and d["held_out_tokens"] >= suite.MIN_HELD_TOKENS, d["name"]
        assert len(suite.split(d["files"])[1]) >= 1 and d["held_out_chars"] > 0, d["name"]
        assert d["files"] == sorted(d["files"]) and len(set(d["files"])) == len(d["files"]), d["name"]


def fake_tree(root: Path, seed: int = 0) -> tuple[dict, tuple]:
    """Two domains of two kinds under root/<base>: made-up "code" files (a few words repeated, so a tiny model can
    learn them) and "prose" files, one an exact duplicate. Returns (bases, sources)."""
    words = random.Random(seed)

    def text(vocabulary: list[str], n: int) -> str:
        return " ".join(words.choice(vocabulary) for _ in range(n)) + "\n"

    for i in range(10):
        (root / "share" / "code").mkdir(parents=True, exist_ok=True)
        (root / "share" / "code" / f"m{i:02d}.py").write_text(text(["def f(x):", "return x", "= 1", "if x:"], 90))
        (root / "share" / "prose").mkdir(parents=True, exist_ok=True)
        (root / "share" / "prose" / f"p{i:02d}.txt").write_text(text(["the", "copy", "is", "free", "software"], 90))
    (root / "share" / "prose" / "p01b.txt").write_text((root / "share" / "prose" / "p01.txt").read_text())
    sources = (suite.Source("code", "python", "{share}/code", ("*.py",)),
               suite.Source("prose", "legal", "{share}/prose", ("*.txt",)))  # fmt: skip
    return {"share": root / "share"}, sources


def fake_manifest(bases: dict, sources: tuple, learn: int = 1200, held: int = 300) -> dict:
    count = len  # the character tokenizer: one token per character
    return {"domains": [suite.choose(s, count, bases, learn, held) for s in sources]}


def test_the_manifest_check_names_the_domain_whose_files_changed(tmp_path):
    bases, sources = fake_tree(tmp_path)
    manifest = fake_manifest(bases, sources)
    code = suite.entry("code", manifest)
    # Files in order until 1,200 characters are learned and 300 held out: every 4th held out.
    learn_files, held_files = suite.split(code["files"])
    assert code["files"][3] in held_files and code["files"][0] in learn_files and code["learn_chars"] >= 1200
    assert code["files"] == sorted(code["files"]) and len(code["files"]) < 10  # stops once both are met
    suite.check_suite(manifest, bases)
    learn, held, record = suite.domain_texts("code", manifest, bases)
    assert len(held) == len(held_files) and record["contents_sha256"] == code["contents_sha256"]
    # The prose domain's duplicate file was dropped.
    prose = suite.entry("prose", manifest)
    assert "p01.txt" in prose["files"] and "p01b.txt" not in prose["files"] and "p02.txt" in prose["files"]
    changed = tmp_path / "share" / "code" / code["files"][1]
    changed.write_text(changed.read_text() + "one line more\n")
    with pytest.raises(suite.SuiteChanged, match="suite domain 'code': the contents of its files"):
        suite.check_suite(manifest, bases)
    suite.check_suite(manifest, bases, names=["prose"])  # the other domain still matches
    with pytest.raises(suite.SuiteChanged, match="'code'"):
        suite.domain_texts("code", manifest, bases)
    (tmp_path / "share" / "prose" / prose["files"][2]).unlink()
    with pytest.raises(suite.SuiteChanged, match=f"suite domain 'prose': 1 of its files .*{prose['files'][2]}"):
        suite.check_domain(prose, bases)
    with pytest.raises(SystemExit, match="domain 'code'"):
        fake_manifest(bases, sources[:1], learn=10**6)  # the tree holds too little text
    assert suite.manifest_sha256(manifest) != suite.manifest_sha256({"domains": manifest["domains"][:1]})


# ---------------------------------------------------------------------------------------------------- the runner


def loader(name: str) -> tuple:
    """lm_suite.main's load_model: a tiny Llama with the character tokenizer, whatever is asked for."""
    return tiny_model("llama"), CharTokenizer(), "t"


# "same" changes only when the layer warns (the diagnosis), never what it reads.
SETTINGS = {"default": {}, "capped": {"policy": {"max_step": 0.02}}, "no_token_bias": {"token_bias": 0},
            "same": {"policy": {"part_step_ratio": 8.0}}}  # fmt: skip
ARGS = ["--learn-tokens", "800", "--score-tokens", "200", "--window", "64", "--curve", "384", "--learn-window", "64",
        "--learn-batch-size", "4", "--batch-size", "4"]  # fmt: skip


def test_settings_share_a_pass_only_when_they_differ_in_what_the_solve_reads():
    settings = {n: lm_suite.setting_from_dict(n, f) for n, f in SETTINGS.items()}
    assert lm_suite.groups(settings) == [list(SETTINGS)]  # the biases are read by the solve
    held = lm_suite.setting_from_dict("h", {"policy": {"held_out_share": 0.1}})  # read while learning
    assert lm_suite.groups({"default": settings["default"], "h": held}) == [["default"], ["h"]]
    assert settings["default"].head_dtype == "float32"  # the float32 path
    with pytest.raises(ValueError, match="setting 'bad'"):
        lm_suite.setting_from_dict("bad", {"policy": {"no_such_field": 1}})


def test_the_runner_writes_one_record_per_shard_resumes_and_records_hashes_and_provenance(tmp_path):
    pytest.importorskip("peft")
    bases, sources = fake_tree(tmp_path / "tree")
    manifest = fake_manifest(bases, sources)
    out = tmp_path / "shards"
    argv = [*ARGS, "--peers", "lora,lora_time", "--train-window", "32", "--settings", json.dumps(SETTINGS), "--out",
            str(out)]  # fmt: skip
    paths = lm_suite.main(argv, load_model=loader, manifest=manifest, bases=bases)
    assert sorted(p.name for p in out.iterdir()) == ["code.json", "prose.json"] == sorted(p.name for p in paths)
    shard = json.loads((out / "code.json").read_text())
    assert shard["suite_domain"]["contents_sha256"] == suite.entry("code", manifest)["contents_sha256"]
    assert shard["suite"]["manifest_sha256"] == suite.manifest_sha256(manifest)
    assert {"git_sha", "git_dirty", "cpu_model", "cpu_flags", "loadavg_at_start", "loadavg_at_end"} <= set(
        shard["provenance"]
    )
    # the command line of the process that ran the shard: here pytest's, however it was started
    assert shard["provenance"]["command"] == provenance.relative_command(provenance.command_line(), H.REPO)
    rows = shard["settings"]
    assert list(rows) == list(SETTINGS) and shard["learned_tokens"] == 800
    assert rows["default"]["shared_pass"] == rows["no_token_bias"]["shared_pass"] == list(SETTINGS)
    assert rows["no_token_bias"]["tuning"]["token_bias_step"] == 0 < rows["default"]["tuning"]["token_bias_step"]
    assert rows["default"]["curve"]["tokens"] == [384, 800] and len(rows["capped"]["curve"]["ppl"]) == 2
    assert rows["capped"]["tuning"]["step"] <= 0.02 < rows["default"]["tuning"]["step"]  # re-solved under its policy
    assert rows["capped"]["ppl"] != rows["default"]["ppl"]
    for row in rows.values():
        assert row["reduction"] == pytest.approx(1 - row["ppl"] / shard["zero_shot"]["ppl"])
    peers = {r["method"].split(" (")[0]: r for r in shard["peers"]}
    assert set(peers) == {"LoRA", "LoRA at FAAST's time"}
    assert peers["LoRA at FAAST's time"]["budget_s"] == rows["default"]["learn_s"]  # the first setting's time
    # A re-solved setting is what learning it alone gives.
    for name in ("capped", "no_token_bias"):
        alone = lm_suite.main([*ARGS, "--settings", json.dumps({name: SETTINGS[name]}), "--out",
                               str(tmp_path / name), "--domains", "code"], load_model=loader, manifest=manifest,
                              bases=bases)  # fmt: skip
        assert json.loads(alone[0].read_text())["settings"][name]["ppl"] == pytest.approx(rows[name]["ppl"],
                                                                                          rel=REORDER_REL)  # fmt: skip
    assert rows["no_token_bias"]["ppl"] != rows["default"]["ppl"]
    # A setting whose solve reads as one already scored is not scored again: its score is that one's, said so.
    assert (
        rows["same"]["score_reused_from"] == ["default", "default"] and rows["same"]["ppl"] == rows["default"]["ppl"]
    )
    assert "score_reused_from" not in rows["default"] and "score_reused_from" not in rows["no_token_bias"]
    # The cap acts only where the step is tuned: before, at the first point, "capped" may read as the default.
    assert rows["capped"].get("score_reused_from", []) in ([], ["default"])
    # Resumed: the shards that exist are kept as they are; a missing one runs again.
    before = (out / "code.json").read_text()
    (out / "prose.json").unlink()
    lm_suite.main(argv, load_model=loader, manifest=manifest, bases=bases)
    assert (out / "code.json").read_text() == before and (out / "prose.json").is_file()
    with pytest.raises(SystemExit, match="another protocol"):
        lm_suite.main([*argv[:-4], "--settings", '{"default": {}}', "--out", str(out)], load_model=loader,
                      manifest=manifest, bases=bases)  # fmt: skip
    # The report merges the shards: two kinds, each domain's setting chosen on the other.
    merged = lm_suite_report.merge(lm_suite_report.load_shards([out]))
    choices = {c["domain"]: c for c in merged["loko"]["choices"]}
    assert set(merged["lora"]) == {"code", "prose"}
    reductions = merged["reductions"]
    best_on_prose = max(SETTINGS, key=lambda s: (reductions["prose"][s], -list(SETTINGS).index(s)))
    assert choices["code"]["setting"] == best_on_prose
    assert choices["code"]["reduction"] == reductions["code"][best_on_prose]
    lines = lm_suite_report.report(merged)
    assert any(line.startswith("Suite: median") for line in lines)
    from results_formats import FORMATTERS

    table = FORMATTERS["lm_suite"]([("lab/experiments/results/x.json", merged)])
    assert table[0].startswith("| domain | kind |") and any("Suite of 2 domains" in x for x in table)
    assert not math.isnan(merged["loko"]["median"])


# ---------------------------------------------------------------------------------------------------- the report


def planted_shard(domain: str, kind: str, settings: dict, peers: tuple = (), zero: float = 10.0,
                  learn_tokens: int = 800, date: str = "d", fields: dict | None = None) -> dict:  # fmt: skip
    """A shard as lm_suite writes it: settings {name: (reduction, learn_s, curve reductions)}; peers (name, reduction,
    learn_s); fields: {name: the setting's fields} where not the planted {"policy": {"n": name}}."""
    rows = {n: {"reduction": r, "ppl": zero * (1 - r), "learn_s": s,
                "curve": {"tokens": [400, 800], "reduction": c, "ppl": [zero * (1 - x) for x in c]}}
            for n, (r, s, c) in settings.items()}  # fmt: skip
    defined = {n: (fields or {}).get(n, {"policy": {"n": n}}) for n in settings}
    return {"provenance": {"date": date, "git_sha": "abc", "git_dirty": False, "cpu_model": "cpu"},
            "suite": {"manifest_sha256": "m" * 64},
            "protocol": {"learn_tokens": learn_tokens, "settings": defined,
                         "peers": ["lora", "lora_time"] if peers else []},
            "domain": domain, "kind": kind, "suite_domain": {"name": domain}, "learned_tokens": learn_tokens,
            "scored_tokens": 200, "zero_shot": {"ppl": zero}, "settings": rows,
            "peers": [{"method": f"{m} (planted)", "reduction": r, "learn_s": s} for m, r, s in peers]}  # fmt: skip


def write_shards(folder: Path, shards: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for s in shards:
        (folder / f"{s['domain']}.json").write_text(json.dumps(s))
    return folder


PEERS = (("LoRA", 0.10, 100.0), ("LoRA at FAAST's time", 0.06, 40.0))


def test_the_report_joins_a_domains_shards_and_reads_its_peers_times_and_curve(tmp_path):
    main = write_shards(tmp_path / "main", [
        planted_shard("a", "A", {"default": (0.08, 40.0, [0.02, 0.08])}, PEERS),
        planted_shard("b", "B", {"default": (0.05, 30.0, [-0.001, 0.05])}, (("LoRA", 0.10, 50.0),)),
    ])  # fmt: skip
    more = write_shards(tmp_path / "more", [
        planted_shard("a", "A", {"off": (0.02, 9.0, [0.01, 0.02])}),
        planted_shard("b", "B", {"off": (0.09, 9.0, [0.03, 0.09])}),
    ])  # fmt: skip
    merged = lm_suite_report.merge(lm_suite_report.load_shards([main, more]))
    assert merged["reductions"] == {"a": {"default": 0.08, "off": 0.02}, "b": {"default": 0.05, "off": 0.09}}
    assert list(merged["protocol"]["settings"]) == ["default", "off"]
    # a's setting is chosen on b ("off"), b's on a ("default").
    choices = {c["domain"]: c for c in merged["loko"]["choices"]}
    assert choices["a"]["setting"] == "off" and choices["b"]["setting"] == "default"
    a, b = merged["domains"]["a"], merged["domains"]["b"]
    assert a["lowest_point"] == 0.01 and b["lowest_point"] == -0.001  # the chosen setting's curve
    # FAAST's time is the setting that ran beside the peers (the first of that shard), over one LoRA epoch's.
    assert a["timed_setting"] == "default" and a["time_ratio"] == pytest.approx(0.4) and b["time_ratio"] == 0.6
    assert a["peers"]["LoRA at FAAST's time"]["reduction"] == 0.06 and len(a["files"]) == 2
    g = merged["goals"]
    assert g["time_ratio_worst"] == 0.6 and g["met"]["time"] is False and g["met"]["floor"] is True
    assert choices["a"]["share"] == pytest.approx(0.2) and g["met"]["share"] is False
    lines = lm_suite_report.report(merged)
    assert any("0.60× at worst" in x and "(missed)" in x for x in lines)
    from results_formats import FORMATTERS

    text = "\n".join(FORMATTERS["lm_suite"]([("x.json", merged)]))
    assert "| a | A | off | −2.0% | −1.0% | −10.0% | 20% | −6.0% | 0.40× |" in text


def test_the_tuned_peers_join_from_their_own_run_and_their_times_compare_within_it(tmp_path):
    main = write_shards(tmp_path / "main", [
        planted_shard("a", "A", {"default": (0.08, 40.0, [0.02, 0.08])}, PEERS),
        planted_shard("b", "B", {"default": (0.05, 30.0, [0.01, 0.05])}, PEERS),
    ])  # fmt: skip
    # The tuned peers ran on a alone, beside the default (which read the same perplexities, in 50 s this time).
    tuned = planted_shard("a", "A", {"default": (0.08, 50.0, [0.02, 0.08])},
                          (("kNN-LM tuned", 0.05, 30.0), ("LoRA-best", 0.16, 200.0)))  # fmt: skip
    tuned["peers"][0].update(tuning_s=20.0, tuned={"lam": 0.25, "temperature": 30.0})
    tuned["peers"][1].update(tuning_s=800.0, tuned={"lr": 0.003, "epochs": 2})
    folder = write_shards(tmp_path / "tuned", [tuned])
    for order in ([main, folder], [folder, main]):
        merged = lm_suite_report.merge(lm_suite_report.load_shards(order))
        a = merged["domains"]["a"]
        assert set(a["peers"]) == {"LoRA", "LoRA at FAAST's time", "kNN-LM tuned", "LoRA-best"}
        # FAAST's time over one LoRA epoch's stays the LoRA run's (40 s / 100 s), whichever folder came first.
        assert a["time_ratio"] == pytest.approx(0.4) and a["faast_s"] == 40.0
        t = merged["tuned_peers"]
        assert list(t["domains"]) == ["a"]
        row = t["domains"]["a"]
        # Each tuned peer's time is its tuning plus final run over FAAST's in its own run (50 s).
        assert row["kNN-LM tuned"]["time_ratio"] == pytest.approx(1.0)
        assert row["LoRA-best"]["time_ratio"] == pytest.approx(20.0)
        assert row["share_of_lora_best"] == pytest.approx(0.5) and row["faast"] == 0.08
        m = t["medians"]["LoRA-best"]
        assert (m["domains"], m["kinds"], m["faast_better"], m["share"]) == (1, 1, 0, pytest.approx(0.5))
        assert t["medians"]["kNN-LM tuned"]["faast_better"] == 1 and t["medians"]["kNN-LM tuned"]["share"] is None
    lines = lm_suite_report.tuned_peer_lines(merged)
    assert "| a | A | −8.0% | −5.0% | λ 0.25, T 30 | 1.00× | −16.0% | lr 0.003, epochs 2 | 50% | 20.00× |" in lines
    assert "\n".join(lines) in "\n".join(lm_suite_report.report(merged))
    from results_formats import FORMATTERS

    assert "\n".join(lines) in "\n".join(FORMATTERS["lm_suite"]([("x.json", merged)]))
    # A peer that ran in two shards of a domain is refused: which run's row would count is not one answer.
    again = write_shards(tmp_path / "again", [planted_shard("a", "A", {"off": (0.02, 9.0, [0.01, 0.02])},
                                                            (("LoRA-best", 0.1, 9.0),))])  # fmt: skip
    with pytest.raises(ValueError, match=r"peers \['LoRA-best'\] also ran in another shard"):
        lm_suite_report.load_shards([main, folder, again])
    # Without tuned peers there is no such table.
    assert lm_suite_report.tuned_peer_lines(lm_suite_report.merge(lm_suite_report.load_shards([main]))) == []


def test_a_setting_measured_on_some_domains_only_is_never_chosen_for_the_suite(tmp_path):
    # One folder: a and b ran the default alone, c and d ran it beside "off", which is far better on both. No domain
    # may take "off": it is not measured on every domain of the other kinds.
    folder = write_shards(tmp_path / "s", [
        planted_shard("a", "A", {"default": (0.08, 40.0, [0.02, 0.08])}, PEERS),
        planted_shard("b", "B", {"default": (0.05, 30.0, [0.01, 0.05])}, PEERS),
        planted_shard("c", "C", {"default": (0.04, 30.0, [0.01, 0.04]), "off": (0.30, 9.0, [0.1, 0.30])}, PEERS),
        planted_shard("d", "D", {"default": (0.06, 30.0, [0.01, 0.06]), "off": (0.30, 9.0, [0.1, 0.30])}, PEERS),
    ])  # fmt: skip
    merged = lm_suite_report.merge(lm_suite_report.load_shards([folder]))
    choices = {c["domain"]: c for c in merged["loko"]["choices"]}
    assert {d: c["setting"] for d, c in choices.items()} == dict.fromkeys("abcd", "default")
    assert choices["c"]["own_best"] == "off" and merged["loko"]["median"] == pytest.approx(0.055)
    # Every setting's change is listed, '–' where it did not run; the medians are over c and d, which ran both.
    lines = lm_suite_report.setting_lines(merged)
    assert "| a | A | −8.0% | – |" in lines and "| median of those |  | −5.0% | −30.0% |" in lines
    assert any("(2 domains ran all of them)" in x for x in lines)
    assert "\n".join(lines) in "\n".join(lm_suite_report.report(merged))
    # The mechanism "off" switches off is judged on the two domains that measured it, of two kinds.
    spec = {"mechanisms": [{"name": "m", "on": "default", "off": "off", "constants": ["P.m"]}]}
    (m,) = lm_suite_report.heuristics(lm_suite_report.load_shards([folder]), spec)["mechanisms"]
    assert m["domains"] == ["c", "d"] and m["pays"] is False and m["reason"] == "gains too little"


def test_the_report_refuses_shards_that_are_not_one_run(tmp_path):
    def load(*shards: dict) -> list[dict]:
        folder = tmp_path / f"f{len(list(tmp_path.iterdir()))}"
        for i, s in enumerate(shards):
            write_shards(folder / str(i), [s])
        return lm_suite_report.load_shards(sorted(folder.iterdir()))

    a = planted_shard("a", "A", {"default": (0.08, 40.0, [0.02, 0.08])}, PEERS)
    # The default measured again beside an ablation joins when it read the same, and shows the runs do not compare
    # when it did not.
    (joined,) = load(a, planted_shard("a", "A", {"default": (0.08, 40.0, [0.02, 0.08]),
                                                  "off": (0.02, 9.0, [0.01, 0.02])}))  # fmt: skip
    assert list(joined["settings"]) == ["default", "off"] and joined["timed_setting"] == "default"
    with pytest.raises(ValueError, match="'default' measured .* the runs do not compare"):
        load(a, planted_shard("a", "A", {"default": (0.08, 40.0, [0.021, 0.08])}))
    with pytest.raises(ValueError, match="zero-shot perplexity"):
        load(a, planted_shard("a", "A", {"off": (0.02, 9.0, [0.01, 0.02])}, zero=11.0))
    with pytest.raises(ValueError, match="protocol differs"):
        load(a, planted_shard("b", "B", {"off": (0.02, 9.0, [0.01, 0.02])}, learn_tokens=900))
    with pytest.raises(ValueError, match=r"peers \['LoRA', \"LoRA at FAAST's time\"\] also ran in another shard"):
        load(a, planted_shard("a", "A", {"off": (0.02, 9.0, [0.01, 0.02])}, PEERS))
    other = planted_shard("b", "B", {"default": (0.02, 9.0, [0.01, 0.02])})
    other["protocol"]["settings"]["default"] = {"token_bias": 0}
    with pytest.raises(ValueError, match="setting 'default' differs .* at the same time"):
        load(a, other)


def test_a_newer_run_of_a_setting_supersedes_an_older_one_of_its_name_and_times_stay_from_one_run(tmp_path):
    # The default changed between runs: a ran it again (beside an ablation, without peers), b did not; c ran the new
    # one with its peers. The old "default" is left out everywhere, b with it; a's time ratio stays its peers' run's.
    old, new = {"default": {"policy": {"ramp": 3.5}}}, {"default": {"policy": {"ramp": 7}}}
    first = write_shards(tmp_path / "first", [
        planted_shard("a", "A", {"default": (0.08, 40.0, [-0.02, 0.08]), "off": (0.08, 9.0, [0.01, 0.08])}, PEERS,
                      date="2026-01-01", fields=old),
        planted_shard("b", "B", {"default": (0.05, 30.0, [0.01, 0.05])}, PEERS, date="2026-01-01", fields=old),
    ])  # fmt: skip
    again = write_shards(tmp_path / "again", [
        planted_shard("a", "A", {"default": (0.08, 41.0, [0.01, 0.08]), "off": (0.08, 9.0, [0.01, 0.08])},
                      date="2026-02-01", fields=new),
        planted_shard("c", "C", {"default": (0.06, 20.0, [0.01, 0.06]), "off": (0.03, 9.0, [0.01, 0.03])}, PEERS,
                      date="2026-02-02", fields=new),
    ])  # fmt: skip
    merged = lm_suite_report.merge(lm_suite_report.load_shards([first, again]))
    assert merged["left_out"] == ["b"] and set(merged["reductions"]) == {"a", "c"}
    # "off" (unchanged, so not superseded) comes first among a's settings now, yet the default keeps its tie on a:
    # c's figure is the default's.
    assert list(merged["protocol"]["settings"]) == ["default", "off"]
    assert {c["domain"]: c["setting"] for c in merged["loko"]["choices"]}["c"] == "default"
    assert merged["protocol"]["settings"]["default"] == lm_suite_report.today(new["default"])
    assert sorted((x["file"], x["setting"]) for x in merged["superseded"]) == [("a.json", "default"),
                                                                              ("b.json", "default")]  # fmt: skip
    a = merged["domains"]["a"]
    assert a["curve"] == [0.01, 0.08] and a["lowest_point"] == 0.01  # the new run's curve, not the old -2%
    # FAAST's time beside a's peers is the old run's (40 s over LoRA's 100 s), not the new run's 41 s.
    assert a["timed_setting"] == "default" and a["time_ratio"] == pytest.approx(0.4)
    # ... and the report says that a's time is the superseded setting's; c's is the current default's own.
    assert a["timed_superseded"] and not merged["domains"]["c"]["timed_superseded"]
    text = "\n".join(lm_suite_report.report(merged))
    assert (
        "Superseded" in text
        and "a.json: default; b.json: default" in text
        and "Left out, no setting left to choose from" in text
        and "since superseded, on 1 domain (a)" in text
    )
    # Two runs at one date that name different settings alike: no newer run says which one the name means.
    clash = write_shards(tmp_path / "clash", [planted_shard("d", "D", {"default": (0.01, 1.0, [0.0, 0.01])},
                                                            date="2026-01-01", fields=new)])  # fmt: skip
    with pytest.raises(ValueError, match="setting 'default' differs .* at the same time"):
        lm_suite_report.load_shards([first, clash])


def test_peers_run_again_by_a_newer_run_supersede_the_older_rows_and_faast_s_time_beside_them(tmp_path):
    # a's default ran beside LoRA twice; the newer run's rows and time ratio are kept, in either order of the folders.
    curve = [0.01, 0.08]
    first = write_shards(tmp_path / "first", [
        planted_shard("a", "A", {"default": (0.08, 40.0, curve)}, PEERS, date="2026-01-01"),
        planted_shard("b", "B", {"default": (0.05, 30.0, [0.01, 0.05])}, PEERS, date="2026-01-01"),
    ])  # fmt: skip
    again = write_shards(tmp_path / "again", [
        planted_shard("a", "A", {"default": (0.08, 25.0, curve)},
                      (("LoRA", 0.12, 100.0), ("LoRA at FAAST's time", 0.03, 25.0)), date="2026-02-01"),
    ])  # fmt: skip
    for order in ([first, again], [again, first]):
        merged = lm_suite_report.merge(lm_suite_report.load_shards(order))
        a = merged["domains"]["a"]
        assert a["time_ratio"] == pytest.approx(0.25) and not a["timed_superseded"]
        assert a["peers"]["LoRA"]["reduction"] == 0.12 and a["peers"]["LoRA at FAAST's time"]["reduction"] == 0.03
        assert merged["domains"]["b"]["time_ratio"] == pytest.approx(0.3)  # b's single run stays
        assert [(x["file"], x["peers"]) for x in merged["superseded_peers"]] == [
            ("a.json", ["LoRA", "LoRA at FAAST's time"])]  # fmt: skip
        text = "\n".join(lm_suite_report.report(merged))
        assert "Peers run again by a newer run" in text and "{a}.json: LoRA, LoRA at FAAST's time" in text
    # Two runs of a peer at one date: no newer run says which to keep.
    same = write_shards(tmp_path / "same", [planted_shard("a", "A", {"default": (0.08, 25.0, curve)}, PEERS,
                                                          date="2026-01-01")])  # fmt: skip
    with pytest.raises(ValueError, match="peers .* at the same time"):
        lm_suite_report.load_shards([first, same])


def test_a_removed_mechanisms_fields_leave_an_older_default_as_today_s_unless_it_acted_there(tmp_path):
    # Shards run before the folds were removed carry their fields in every setting. On a the folds never acted (the
    # default and "one_fit", which differ only in them, read alike): its default is today's. On b they acted: its
    # solves were another default's, so all of b's settings are left out and b with them.
    removed = sorted(REMOVED_FIELDS)[:1]
    assert removed and lm_suite_report.REMOVED_FIELDS is REMOVED_FIELDS
    then = {"default": {"policy": {"ramp": 7, removed[0]: 1.6}}, "one_fit": {"policy": {"ramp": 7, removed[0]: 9}}}
    now = {"default": {"policy": {"ramp": 7}}}
    old = write_shards(tmp_path / "old", [
        planted_shard("a", "A", {"default": (0.08, 40.0, [0.01, 0.08]), "one_fit": (0.08, 40.0, [0.01, 0.08])},
                      PEERS, date="2026-01-01", fields=then),
        planted_shard("b", "B", {"default": (0.05, 30.0, [0.01, 0.05]), "one_fit": (0.04, 30.0, [0.01, 0.04])},
                      PEERS, date="2026-01-01", fields=then),
    ])  # fmt: skip
    new = write_shards(tmp_path / "new", [planted_shard("c", "C", {"default": (0.06, 20.0, [0.01, 0.06])}, PEERS,
                                                        date="2026-02-01", fields=now)])  # fmt: skip
    assert lm_suite_report.acted_mechanisms(json.loads((old / "a.json").read_text())) == []
    assert lm_suite_report.acted_mechanisms(json.loads((old / "b.json").read_text())) == [REMOVED_FIELDS[removed[0]]]
    merged = lm_suite_report.merge(lm_suite_report.load_shards([old, new]))
    assert [(x["file"], x["setting"], x["by"]) for x in merged["superseded"]] == [
        ("b.json", "default", lm_suite_report.REMOVED_ACTED),
        ("b.json", "one_fit", lm_suite_report.REMOVED_ACTED),
    ]
    assert merged["left_out"] == ["b"] and set(merged["reductions"]) == {"a", "c"}
    assert set(merged["reductions"]["a"]) == {"default", "one_fit"}
    text = "\n".join(lm_suite_report.report(merged))
    assert (
        "Solved with a mechanism since removed, which changed their solves, left out: b.json: default, one_fit" in text
    )
    # b run again under today's default, with its peers: that run is b's figure, and the old run is only listed
    # (its peers do not clash with the new run's).
    write_shards(new, [planted_shard("b", "B", {"default": (0.045, 30.0, [0.01, 0.045])}, PEERS, date="2026-02-01",
                                     fields=now)])  # fmt: skip
    again = lm_suite_report.merge(lm_suite_report.load_shards([old, new]))
    assert again["left_out"] == [] and set(again["reductions"]["b"]) == {"default"}
    assert again["reductions"]["b"]["default"] == pytest.approx(0.045)
    assert {(x["file"], x["by"]) for x in again["superseded"]} == {("b.json", lm_suite_report.REMOVED_ACTED)}


def test_a_candidate_run_under_its_own_name_reads_as_the_default_once_its_fields_ship(tmp_path):
    # The default (threshold 6) ran with its peers; a candidate differing in a solve-time field (threshold 2) ran later
    # under its own name, on a alone beside its ablation, and on b beside the default in one pass.
    six, two = {"policy": {"n": "shipped", "P": 6}}, {"policy": {"n": "shipped", "P": 2}}
    main = write_shards(tmp_path / "main", [
        planted_shard(d, d.upper(), {"default": (0.05, 30.0, [0.01, 0.05])}, PEERS, date="2026-01-01",
                      fields={"default": six}) for d in "ab"
    ])  # fmt: skip
    cand = write_shards(tmp_path / "cand", [
        planted_shard("a", "A", {"p2": (0.07, 31.0, [0.01, 0.07]), "no_bias_p2": (0.06, 31.0, [0.0, 0.06])},
                      date="2026-01-02", fields={"p2": two, "no_bias_p2": {"bias": 0, **two}}),
        planted_shard("b", "B", {"default": (0.05, 30.0, [0.01, 0.05]), "p2": (0.04, 30.0, [0.02, 0.04])},
                      date="2026-01-02", fields={"default": six, "p2": two}),
    ])  # fmt: skip
    # While the threshold 6 ships, each name means what it ran.
    before = lm_suite_report.merge(lm_suite_report.load_shards([main, cand], shipped=six))
    assert before["reductions"]["a"] == {"default": 0.05, "p2": 0.07, "no_bias_p2": 0.06}
    assert before["reductions"]["b"] == {"default": 0.05, "p2": 0.04} and before["superseded"] == []
    # Once 2 ships, the candidate's runs are the default's, and every run of the earlier default is superseded by
    # them; the peers and FAAST's time beside them stay the peers' run's, said superseded.
    after = lm_suite_report.merge(lm_suite_report.load_shards([main, cand], shipped=two))
    assert after["reductions"]["a"] == {"default": 0.07, "no_bias_p2": 0.06}
    assert after["reductions"]["b"] == {"default": 0.04}
    assert sorted((x["file"], x["setting"], x["by"]) for x in after["superseded"]) == [
        ("a.json", "default", "b.json"), ("b.json", "default", "b.json"), ("b.json", "default", "b.json")
    ]  # fmt: skip
    a = after["domains"]["a"]
    assert a["peers"]["LoRA"]["reduction"] == 0.10 and a["faast_s"] == 30.0 and a["timed_superseded"]
    assert after["protocol"]["settings"]["default"] == lm_suite_report.today(two)
    # A run of the default's name made after the candidate's, under other fields, is what the name means.
    later = write_shards(tmp_path / "later", [planted_shard("c", "C", {"default": (0.03, 9.0, [0.0, 0.03])},
                                                            date="2026-01-03", fields={"default": six})])  # fmt: skip
    again = lm_suite_report.merge(lm_suite_report.load_shards([main, cand, later], shipped=two))
    assert again["reductions"]["a"] == {"default": 0.05, "p2": 0.07, "no_bias_p2": 0.06}


def test_where_a_removed_mechanism_acted_its_off_setting_is_read_as_today_s_default_with_the_runs_peers(tmp_path):
    # Shards run before the token bias's ramp was removed: its off setting (token_bias_full 1) and the default differ
    # only in it. On a it acted (they read differently): only the off setting was solved as today's default is, so it
    # is a's default now, with a's peers and FAAST's time from its own solve of the same pass; the settings solved with
    # the ramp (the old default, no_bias) are left out. On b it never acted: b's settings stay as they are.
    assert lm_suite_report.REMOVED_OFF["token_bias_full"] == 1 and "token_bias_full" in REMOVED_FIELDS
    # every removed mechanism names a field whose value says it was off
    assert all(set(f) & set(lm_suite_report.REMOVED_OFF) for f in lm_suite_report.removed_mechanisms().values())
    then = {"default": {"policy": {"ramp": 7, "token_bias_full": 32768}},
            "no_token_bias_ramp": {"policy": {"ramp": 7, "token_bias_full": 1}},
            "no_bias": {"bias": 0, "policy": {"ramp": 7, "token_bias_full": 32768}}}  # fmt: skip
    now = {"default": {"policy": {"ramp": 7}}, "no_bias": {"bias": 0, "policy": {"ramp": 7}}}
    old = write_shards(tmp_path / "old", [
        planted_shard("a", "A", {"default": (0.08, 40.0, [0.01, 0.08]),
                                 "no_token_bias_ramp": (0.07, 41.0, [0.0, 0.07]),
                                 "no_bias": (0.06, 40.5, [0.01, 0.06])}, PEERS, date="2026-01-01", fields=then),
        planted_shard("b", "B", {"default": (0.05, 30.0, [0.01, 0.05]),
                                 "no_token_bias_ramp": (0.05, 30.0, [0.01, 0.05]),
                                 "no_bias": (0.04, 30.0, [0.01, 0.04])}, PEERS, date="2026-01-01", fields=then),
    ])  # fmt: skip
    assert lm_suite_report.acted_mechanisms(json.loads((old / "a.json").read_text())) == [
        REMOVED_FIELDS["token_bias_full"]
    ]
    assert lm_suite_report.acted_mechanisms(json.loads((old / "b.json").read_text())) == []
    # d ran earlier still, under another default (ramp 3.5): its off setting is not today's default either, so no
    # setting of d's is left, yet its peers and FAAST's time (its timed setting's) stay, joined to d's new run.
    earlier = {n: {**x, "policy": {**x["policy"], "ramp": 3.5}} for n, x in then.items()}
    write_shards(old, [planted_shard("d", "D", {"default": (0.03, 30.0, [0.01, 0.03]),
                                                "no_token_bias_ramp": (0.02, 30.5, [0.0, 0.02])},
                                     PEERS, date="2025-12-01", fields=earlier)])  # fmt: skip
    # a's ablations run again today without peers, and c today with its peers
    new = write_shards(tmp_path / "new", [
        planted_shard("a", "A", {"default": (0.07, 9.0, [0.0, 0.07]), "no_bias": (0.065, 9.0, [0.0, 0.065])},
                      date="2026-02-01", fields=now),
        planted_shard("c", "C", {"default": (0.06, 20.0, [0.01, 0.06]), "no_bias": (0.05, 20.0, [0.01, 0.05])}, PEERS,
                      date="2026-02-01", fields=now),
        planted_shard("d", "D", {"default": (0.04, 9.0, [0.01, 0.04])}, date="2026-02-01", fields=now),
    ])  # fmt: skip
    merged = lm_suite_report.merge(lm_suite_report.load_shards([old, new]))
    assert merged["left_out"] == []
    d = merged["domains"]["d"]
    assert merged["reductions"]["d"] == {"default": pytest.approx(0.04)} and d["peers"]["LoRA"]["reduction"] == 0.10
    assert d["faast_s"] == 30.0 and d["time_ratio"] == pytest.approx(0.3)
    assert merged["reductions"]["a"] == {"default": pytest.approx(0.07), "no_bias": pytest.approx(0.065)}
    assert set(merged["reductions"]["b"]) == {"default", "no_token_bias_ramp", "no_bias"}
    a = merged["domains"]["a"]
    assert a["timed_setting"] == "default" and a["faast_s"] == 41.0 and a["time_ratio"] == pytest.approx(0.41)
    assert a["peers"]["LoRA"]["reduction"] == 0.10 and a["curve"] == [0.0, 0.07]
    assert sorted((x["file"], x["setting"], x["by"]) for x in merged["superseded"]) == [
        ("a.json", "default", lm_suite_report.REMOVED_ACTED),
        ("a.json", "no_bias", lm_suite_report.REMOVED_ACTED),
        ("d.json", "default", lm_suite_report.REMOVED_ACTED),
        ("d.json", "no_token_bias_ramp", "a.json"),
    ]
    # The record shows what each setting means today: no removed field.
    # (and each field added since at the value it had before)
    assert merged["protocol"]["settings"]["default"] == {
        "policy": {**lm_suite_report.ADDED_FIELDS, **now["default"]["policy"]}
    }
    # d's tuned peers ran later, beside today's default: d keeps the spent run's LoRA rows and time, and gains them.
    tuned = write_shards(tmp_path / "tuned", [planted_shard("d", "D", {"default": (0.04, 12.0, [0.01, 0.04])},
                                                            (("kNN-LM tuned", 0.05, 6.0),), date="2026-02-02",
                                                            fields=now)])  # fmt: skip
    d = lm_suite_report.merge(lm_suite_report.load_shards([old, new, tuned]))["domains"]["d"]
    assert set(d["peers"]) == {"LoRA", "LoRA at FAAST's time", "kNN-LM tuned"}
    assert d["time_ratio"] == pytest.approx(0.3) and d["peers"]["kNN-LM tuned"]["faast_s"] == 12.0
    # The old off setting must read as today's default does where both ran: else the runs do not compare.
    write_shards(new, [planted_shard("a", "A", {"default": (0.071, 9.0, [0.0, 0.071])}, date="2026-02-01",
                                     fields=now)])  # fmt: skip
    with pytest.raises(ValueError, match="setting 'default' measured"):
        lm_suite_report.load_shards([old, new])


def test_a_mechanism_stays_only_where_it_pays_at_a_curve_point_and_keeps_the_floor(tmp_path):
    """Three kinds; 'ramp' matters at the first point only (+2 points there), 'noise' never by more than 0.1 point,
    'harm' gains 3 points at the end but with it on, one domain is 0.5% worse than zero-shot at the first point."""

    def shard(d: str, kind: str, worse: float) -> dict:
        return planted_shard(d, kind, {"default": (0.10, 40.0, [worse, 0.10]), "no_ramp": (0.10, 9.0, [0.0, 0.10]),
                                       "no_noise": (0.099, 9.0, [0.03, 0.099]),
                                       "no_harm": (0.07, 9.0, [0.03, 0.07])})  # fmt: skip

    three = write_shards(tmp_path / "three", [shard("a", "A", 0.02), shard("b", "B", 0.02), shard("c", "C", 0.02)])
    fourth = write_shards(tmp_path / "fourth", [shard("d", "C", -0.005)])
    shards = lm_suite_report.load_shards([three, fourth])
    spec = {"mechanisms": [{"name": n, "on": "default", "off": f"no_{n}", "constants": [f"P.{n}"]}
                           for n in ("ramp", "noise", "harm")]}  # fmt: skip
    spec["mechanisms"].append({"name": "unmeasured", "on": "default", "off": "no_such",
                               "constants": ["P.ramp", "P.other"]})  # fmt: skip
    judged = {m["name"]: m for m in lm_suite_report.heuristics(shards, spec)["mechanisms"]}
    assert [p["tokens"] for p in judged["ramp"]["points"]] == [400, 800]
    # With d's first point at −0.5%, every mechanism that is on in the default breaks the floor there...
    assert judged["harm"]["pays"] is False and judged["harm"]["reason"] == "breaks the floor"
    assert judged["unmeasured"]["pays"] is None and "0 kind" in judged["unmeasured"]["reason"]
    # ... and without d: the ramp pays by its first point, the noise does not pay anywhere, the harm pays.
    shards = lm_suite_report.load_shards([three])
    judged_all = lm_suite_report.heuristics(shards, spec)
    judged = {m["name"]: m for m in judged_all["mechanisms"]}
    assert judged["ramp"]["pays"] and judged["ramp"]["points"][0]["median_gain"] == pytest.approx(0.02)
    assert judged["ramp"]["points"][1]["median_gain"] == pytest.approx(0.0)
    assert judged["noise"]["pays"] is False and judged["noise"]["reason"] == "gains too little"
    assert judged["harm"]["pays"] is True
    # P.ramp is kept (its mechanism pays; the unmeasured one is not judged); P.noise goes.
    assert judged_all["constants_to_remove"] == ["P.noise"]
    assert "P.other" in judged_all["constants_judged"] and "P.other" not in judged_all["constants_to_remove"]
    merged = lm_suite_report.merge(shards)
    merged["heuristics"] = judged_all
    assert any("Tuned constants judged: 4; removed: 0; to remove: 1 (P.noise)." in x
               for x in lm_suite_report.report(merged))  # fmt: skip
    # A mechanism already removed is judged the same, its constants counted as removed rather than to remove.
    spent = {"mechanisms": [{**m, "removed": m["name"] == "noise"} for m in spec["mechanisms"]]}
    judged_spent = lm_suite_report.heuristics(shards, spent)
    assert judged_spent["constants_removed"] == ["P.noise"] and judged_spent["constants_to_remove"] == []
    assert {m["name"]: m for m in judged_spent["mechanisms"]}["noise"]["pays"] is False
    merged["heuristics"] = judged_spent
    text = "\n".join(lm_suite_report.report(merged))
    assert "noise (removed)" in text and "removed: 1 (P.noise); to remove: 0." in text
    # A mechanism that guards the floor on a stream outside the suite (a test) stays, however little it gains here.
    guarded = {
        "mechanisms": [{**m, "floor_guard": "a test"} if m["name"] == "noise" else m for m in spec["mechanisms"]]
    }
    judged_guarded = lm_suite_report.heuristics(shards, guarded)
    noise = {m["name"]: m for m in judged_guarded["mechanisms"]}["noise"]
    assert noise["pays"] is True and noise["reason"] == "keeps the floor outside the suite (a test)"
    assert judged_guarded["constants_to_remove"] == []
    # A part of a mechanism goes with it: the ramp, within the noise, goes though it pays on its own.
    spec["mechanisms"][0] = {**spec["mechanisms"][0], "within": "noise"}
    parted = lm_suite_report.heuristics(shards, spec)
    ramp = {m["name"]: m for m in parted["mechanisms"]}["ramp"]
    assert ramp["pays"] is False and ramp["reason"] == "goes with noise"
    assert parted["constants_to_remove"] == ["P.noise"]  # P.ramp stays: the unmeasured mechanism also holds it
    path = lm_suite_report.ROOT / "lab/experiments/suite_heuristics.json"
    committed = lm_suite_report.load_heuristics(path)
    # The runner takes the spec as its settings, the default first (the one the report checks the runs against).
    assert lm_suite.parse_args(["--settings", str(path), "--out", str(tmp_path)]).settings == committed["settings"]
    assert next(iter(committed["settings"])) == "default"
    # Any spec file is read for its settings, with or without mechanisms.
    untuned = lm_suite_report.ROOT / "lab/experiments/suite_untuned_step.json"
    parsed = lm_suite.parse_args(["--settings", str(untuned), "--out", str(tmp_path)]).settings
    assert parsed == json.loads(untuned.read_text(encoding="utf-8"))["settings"] and next(iter(parsed)) == "default"
    for m in committed["mechanisms"]:  # every off setting is defined and shares the default's learning pass
        off = lm_suite.setting_from_dict(m["off"], committed["settings"][m["off"]])
        assert lm_suite.learn_key(off) == lm_suite.learn_key(lm_suite.setting_from_dict("default", {})), m["name"]
    # The removed mechanisms' settings are read by the report and refused by the runner, naming the fields.
    gone = lm_suite_report.load_heuristics(path, lm_suite_report.ROOT / "lab/experiments/suite_removed.json")
    removed = [m for m in gone["mechanisms"] if m.get("removed")]
    assert removed and not any(m.get("removed") for m in committed["mechanisms"])
    for m in removed:
        with pytest.raises(ValueError, match=f"setting '{m['off']}': .* belong to a mechanism faast no longer has"):
            lm_suite.setting_from_dict(m["off"], gone["settings"][m["off"]])
    # Several specs judge together; the keys' settings are learned, so each learns its own pass.
    capacity = lm_suite_report.ROOT / "lab/experiments/suite_capacity.json"
    both = lm_suite_report.load_heuristics(path, capacity)
    assert [m["name"] for m in both["mechanisms"]][-1] == "the keys' early block"
    assert len(both["mechanisms"]) == len(committed["mechanisms"]) + 1
    keys = lm_suite.parse_args(["--settings", str(capacity), "--out", str(tmp_path)]).settings
    assert [len(g) for g in lm_suite.groups({n: lm_suite.setting_from_dict(n, f) for n, f in keys.items()})] == [1] * 3
    # The document folds are read while learning. Today's default keeps them (as a gate), so the candidate that tunes
    # the step on them differs from it in a solve-time field only, and shares its pass.
    folds = lm_suite_report.ROOT / "lab/experiments/suite_document_folds.json"
    candidate = lm_suite.parse_args(["--settings", str(folds), "--out", str(tmp_path)]).settings
    assert lm_suite.groups({n: lm_suite.setting_from_dict(n, f) for n, f in candidate.items()}) == [
        ["default", "document_folds"]
    ]
    assert lm_suite_report.load_heuristics(path, capacity, folds)["mechanisms"][-1]["on"] == "document_folds"
    # The folds' gate is read by the solve alone: the earlier gate's setting became the default (at the shrink's
    # threshold of then, which both specs pin), and shares its pass.
    gate = lm_suite_report.ROOT / "lab/experiments/suite_folds_gate.json"
    gated = {**candidate, **lm_suite.parse_args(["--settings", str(gate), "--out", str(tmp_path)]).settings}
    assert lm_suite.groups({n: lm_suite.setting_from_dict(n, f) for n, f in gated.items()}) == [
        ["default", "document_folds", "folds_gate"],
    ]
    assert lm_suite.setting_from_dict("g", gated["folds_gate"]) == lm_suite.setting_from_dict("d", gated["default"])
    # Around today's default: every ablation of the earlier spec shares its pass; the folds off (no gate) and h̃ alone
    # as the keys learn their own. The spec holds the earlier one's settings as they are: its runs are today's.
    today = lm_suite_report.ROOT / "lab/experiments/suite_gated.json"
    around = lm_suite.parse_args(["--settings", str(today), "--out", str(tmp_path)]).settings
    assert lm_suite.groups({n: lm_suite.setting_from_dict(n, f) for n, f in around.items()}) == [
        ["default", "no_bias", "no_token_bias", "no_step_ramp", "no_document_shrink", "no_gain_gate"],
        ["no_folds_gate"],
        ["keys_h_alone"],
    ]
    assert {n: around[n] for n in committed["settings"]} == committed["settings"]
    judged_today = lm_suite_report.load_heuristics(today)["mechanisms"]
    assert [m["off"] for m in judged_today] == [
        "no_bias",
        "no_folds_gate",
        *[m["off"] for m in committed["mechanisms"][1:]],
        "keys_h_alone",
    ]
    # The keys' early block is judged around today's default as suite_capacity.json judged it around the earlier one.
    earlier = lm_suite_report.load_heuristics(capacity)
    assert (
        judged_today[-1] == earlier["mechanisms"][0] and around["keys_h_alone"] == earlier["settings"]["keys_h_alone"]
    )
    assert lm_suite_report.load_heuristics(path, folds, gate)["mechanisms"][-1]["on"] == "folds_gate"
    with pytest.raises(ValueError, match="already in an earlier spec"):
        lm_suite_report.load_heuristics(path, path)
    orphan = tmp_path / "orphan.json"
    orphan.write_text(json.dumps({"mechanisms": [{"name": "r", "on": "default", "off": "x", "within": "no such",
                                                  "constants": []}]}))  # fmt: skip
    with pytest.raises(ValueError, match="'within' names 'no such'"):
        lm_suite_report.load_heuristics(path, orphan)


def test_the_shipped_shrink_threshold_was_judged_beside_the_earlier_default_in_its_pass_changing_that_constant_alone(
    tmp_path,
):
    path = lm_suite_report.ROOT / "lab/experiments/suite_shrink_threshold.json"
    settings = lm_suite.parse_args(["--settings", str(path), "--out", str(tmp_path)]).settings
    built = {n: lm_suite.setting_from_dict(n, f) for n, f in settings.items()}
    assert lm_suite.groups(built) == [["default", "positions_per_dim_2"]]  # read by the solve alone: one pass
    earlier, candidate = built["default"], built["positions_per_dim_2"]
    assert candidate.policy.document_positions_per_dim == 2 != earlier.policy.document_positions_per_dim == 6
    same = dataclasses.replace(candidate.policy, document_positions_per_dim=earlier.policy.document_positions_per_dim)
    assert dataclasses.replace(candidate, policy=same) == earlier
    # the candidate is what faast ships: the report reads its runs as the default's
    assert lm_suite_report.today(lm_suite_report.shipped_setting()) == lm_suite_report.today(
        lm_suite.setting_to_dict(candidate)
    )
    # One learned file of 8K: the tail's gap leaves 3,277 fitted positions; P = 6 did not shrink, P = 2 does.
    assert document_shrink(3277, 1, 576, earlier.policy) == 1.0
    assert document_shrink(3277, 1, 576, candidate.policy) == pytest.approx((2 * 576 / 3277) ** 0.5)
    judged = lm_suite_report.load_heuristics(lm_suite_report.ROOT / "lab/experiments/suite_gated.json", path)
    assert (judged["mechanisms"][-1]["on"], judged["mechanisms"][-1]["off"]) == ("positions_per_dim_2", "default")


def test_the_threshold_comparison_regenerates_as_it_read_with_the_earlier_default_named(tmp_path, capsys):
    # Once P = 2 ships, the report run with no --default reads the candidate as the default; --default gives the
    # earlier default its name back, and the committed record comes back as it is.
    results = lm_suite_report.ROOT / "lab/experiments/results"
    folders = ["lm_suite_cpu", "lm_suite_cpu_gated", "lm_suite_cpu_gate_off", "lm_suite_cpu_gated_peers",
               "lm_suite_cpu_knn", "lm_suite_cpu_lora_best", "lm_suite_cpu_ablations_gated", "lm_suite_cpu_keys_gated",
               "lm_suite_cpu_shrink_gated"]  # fmt: skip
    specs = lm_suite_report.ROOT / "lab/experiments"
    argv = [*(str(results / f) for f in folders), "--settings", "default", "no_bias", "no_folds_gate", "no_token_bias",
            "no_step_ramp", "no_document_shrink", "no_gain_gate", "keys_h_alone", "positions_per_dim_2",
            "--heuristics", str(specs / "suite_gated.json"), str(specs / "suite_shrink_threshold.json")]  # fmt: skip
    six = '{"policy": {"document_positions_per_dim": 6}}'
    lm_suite_report.main([*argv, "--default", six, "--out", str(tmp_path / "again")])
    again = (tmp_path / "again.json").read_text(encoding="utf-8")
    assert again == (results / "lm_suite_cpu_shrink.json").read_text(encoding="utf-8")
    with pytest.raises(ValueError, match="settings: expected settings the shards measured"):
        lm_suite_report.main([*argv, "--out", str(tmp_path / "today")])  # P = 6 has no runs under today's meaning
    with pytest.raises(SystemExit):
        lm_suite_report.main([*argv, "--default", "[6]", "--out", str(tmp_path / "bad")])
    assert "--default: expected a JSON object of setting fields" in capsys.readouterr().err


def test_the_default_s_ablations_are_the_earlier_ones_at_the_shipped_threshold_and_judge_every_mechanism(tmp_path):
    root = lm_suite_report.ROOT / "lab/experiments"
    solve, passes = root / "suite_gated_p2.json", root / "suite_gated_p2_passes.json"
    around = {**json.loads(solve.read_text(encoding="utf-8"))["settings"],
              **json.loads(passes.read_text(encoding="utf-8"))["settings"]}  # fmt: skip
    earlier = lm_suite_report.load_heuristics(root / "suite_gated.json")
    two = {"document_positions_per_dim": 2}
    for name, fields in around.items():  # each is the earlier ablation of that name with the threshold at 2, no more
        base = dict(earlier["settings"]["default" if name == "positions_per_dim_2" else name.removesuffix("_p2")])
        assert fields == {**base, "policy": {**base.get("policy", {}), **two}}, name
    built = {n: lm_suite.setting_from_dict(n, f) for n, f in around.items()}
    assert built["positions_per_dim_2"] == lm_suite.setting_from_dict("default", {})  # what ships
    # the solve-time ones share the default's pass; the folds' gate and h̃ alone each learn their own
    assert lm_suite.groups(built) == [
        ["positions_per_dim_2", "no_bias_p2", "no_token_bias_p2", "no_step_ramp_p2", "no_gain_gate_p2"],
        ["no_folds_gate_p2"],
        ["keys_h_alone_p2"],
    ]
    spec = lm_suite_report.load_heuristics(solve, passes)

    # every mechanism the earlier default was judged on, judged around today's; the shrink's own ablation (power 0
    # never reads the threshold) is the earlier run's
    def key(ms: list[dict]) -> list[tuple]:
        return sorted((m["name"], tuple(m["constants"]), m.get("floor_guard")) for m in ms)

    assert key(spec["mechanisms"]) == key(earlier["mechanisms"])
    assert all(m["on"] == "default" for m in spec["mechanisms"])
    offs = {m["off"] for m in spec["mechanisms"]}
    assert offs == {*around} - {"positions_per_dim_2"} | {"no_document_shrink"}
    shrink_off = lm_suite.setting_from_dict("x", earlier["settings"]["no_document_shrink"]).policy
    assert dataclasses.replace(shrink_off, document_positions_per_dim=2) != shrink_off
    assert (
        document_shrink(100_000, 1, 576, shrink_off)
        == 1.0
        == document_shrink(100_000, 1, 576, dataclasses.replace(shrink_off, document_positions_per_dim=2))
    )


def test_a_mechanism_that_keeps_a_domain_inside_the_floor_stays_though_it_gains_too_little(tmp_path):
    def shard(d: str, kind: str) -> dict:
        low = -0.004 if d == "c" else 0.001  # without it, c is 0.4% worse than zero-shot at the first point
        return planted_shard(d, kind, {"default": (0.05, 40.0, [0.001, 0.05]), "no_guard": (0.05, 9.0, [low, 0.05])})

    shards = lm_suite_report.load_shards([write_shards(tmp_path / "s", [shard(d, d.upper()) for d in "abc"])])
    spec = {"mechanisms": [{"name": "guard", "on": "default", "off": "no_guard", "constants": ["P.guard"]}]}
    judged = lm_suite_report.heuristics(shards, spec)
    (guard,) = judged["mechanisms"]
    first = guard["points"][0]
    assert first["median_gain"] < loko.MEDIAN_GAIN and first["worst_gain"] < loko.WORST_GAIN  # no gain by the rule
    assert (
        guard["pays"] is True and guard["reason"].startswith("keeps the floor") and judged["constants_to_remove"] == []
    )


def test_a_candidate_outside_the_default_is_judged_by_the_rule_and_its_constants_are_not_the_defaults(tmp_path):
    def shard(d: str, kind: str) -> dict:
        worst = -0.10 if d == "c" else 0.02  # the default leaves c 10% above zero-shot; the candidate keeps it at 0
        return planted_shard(d, kind, {"default": (0.05, 40.0, [0.01, worst]), "cand": (0.05, 41.0, [0.01, 0.0])})

    shards = lm_suite_report.load_shards([write_shards(tmp_path / "s", [shard(d, d.upper()) for d in "abc"])])
    spec = {"mechanisms": [{"name": "cand", "on": "cand", "off": "default", "constants": ["P.cand"]},
                           {"name": "lean", "on": "default", "off": "cand", "constants": ["P.lean"]}]}  # fmt: skip
    judged = lm_suite_report.heuristics(shards, spec)
    cand, lean = judged["mechanisms"]
    assert cand["candidate"] and not lean["candidate"]
    assert cand["pays"] is True and cand["points"][-1]["worst_gain"] == pytest.approx(0.10)
    assert judged["candidates_that_pay"] == ["cand"] and judged["constants_judged"] == ["P.lean"]
    assert "Candidates outside the default that pay: cand." in lm_suite_report.heuristic_lines(judged)[-1]


def test_a_policy_field_added_since_reads_as_off_in_the_shards_that_did_not_record_it(tmp_path):
    # The peer runs recorded the default before OutputPolicy had document_folds; a newer run records it as 0 beside a
    # setting that turns it on. Both defaults mean one setting: the older one is not superseded and keeps its peers.
    assert lm_suite_report.today({"policy": {"n": 1}})["policy"] == {**lm_suite_report.ADDED_FIELDS, "n": 1}
    before = {"default": {"policy": {"n": "default"}}}
    after = {"default": {"policy": {"n": "default", "document_folds": 0}},
             "folds": {"policy": {"n": "default", "document_folds": 4}}}  # fmt: skip
    old = write_shards(tmp_path / "old", [planted_shard(d, d.upper(), {"default": (0.05, 40.0, [0.01, 0.05])}, PEERS,
                                                        date="1", fields=before) for d in "ab"])  # fmt: skip
    new = write_shards(tmp_path / "new", [planted_shard(d, d.upper(), {"default": (0.05, 40.0, [0.01, 0.05]),
                                                                       "folds": (0.07, 41.0, [0.01, 0.07])},
                                                        date="2", fields=after) for d in "ab"])  # fmt: skip
    merged = lm_suite_report.merge(lm_suite_report.load_shards([old, new]))
    assert merged["superseded"] == [] and set(merged["reductions"]["a"]) == {"default", "folds"}
    assert merged["lora"]["a"] == pytest.approx(0.10)
    # Recorded at another value, the field is another setting: the older run of the name is superseded.
    later = write_shards(tmp_path / "later", [planted_shard(d, d.upper(), {"default": (0.07, 41.0, [0.01, 0.07])},
                                                            date="3", fields={"default": after["folds"]})
                                              for d in "ab"])  # fmt: skip
    moved = lm_suite_report.merge(lm_suite_report.load_shards([old, new, later]))
    assert {x["setting"] for x in moved["superseded"]} == {"default"}


def test_the_settings_chosen_among_may_be_named_and_the_rest_are_set_aside_and_said(tmp_path):
    # "old" is an earlier default's ablation that wins every median; named out, it is set aside and never chosen, and
    # the peers and FAAST's time beside them stay.
    shards = lm_suite_report.load_shards([write_shards(tmp_path / "s", [
        planted_shard(d, d.upper(), {"default": (0.05, 40.0, [0.01, 0.05]), "off": (0.04, 9.0, [0.01, 0.04]),
                                     "old": (0.09, 9.0, [0.01, 0.09])}, PEERS) for d in "abc"])])  # fmt: skip
    assert {c["setting"] for c in lm_suite_report.merge(shards)["loko"]["choices"]} == {"old"}
    merged = lm_suite_report.merge(lm_suite_report.only(shards, ["default", "off"]))
    assert {c["setting"] for c in merged["loko"]["choices"]} == {"default"}
    assert list(merged["protocol"]["settings"]) == ["default", "off"] and merged["set_aside"] == ["old"]
    assert merged["domains"]["a"]["time_ratio"] == pytest.approx(0.4) and merged["lora"]["a"] == pytest.approx(0.10)
    assert "Set aside (not among the settings chosen from): old." in "\n".join(lm_suite_report.report(merged))
    with pytest.raises(ValueError, match=r"settings: expected settings the shards measured .* got \['nope'\]"):
        lm_suite_report.only(shards, ["default", "nope"])
