"""lab/experiments/lm_step_rule_fit.py: the document shrink's refit on step-probe curves."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import pytest

from faast.hf import OutputPolicy
from faast.hf.output.diagnosis import document_shrink

STEPS = tuple(2 ** (k / 4) for k in range(-8, 9))  # the probe's curve: the tuned step times these


def load_fit():  # noqa: ANN202 - the experiment module
    return importlib.import_module("faast_lab.experiments.lm_step_rule_fit")


def test_the_fits_shrink_at_the_shipped_constants_is_the_layers():
    fit = load_fit()
    shipped = OutputPolicy()
    threshold = shipped.document_positions_per_dim * fit.HIDDEN
    for fitted, docs in [(1000, 1), (3456, 1), (3457, 1), (26620, 4), (26614, 10), (21927, 1), (5000, 0)]:
        assert fit.shrink(fitted, docs, threshold, shipped.document_shrink_power) == pytest.approx(
            document_shrink(fitted, docs, fit.HIDDEN), rel=1e-12
        )


def test_the_perplexity_is_read_off_the_curve_log_linearly_and_clamped_at_its_ends():
    fit = load_fit()
    curve = [[0.1 * s, 10.0 + (math.log(s) ** 2)] for s in STEPS]
    for eta, ppl in curve:
        assert fit.ppl_at(curve, eta) == (pytest.approx(ppl, rel=1e-12), True)
    a, b = curve[5], curve[6]
    mid = math.sqrt(a[0] * b[0])
    assert fit.ppl_at(curve, mid)[0] == pytest.approx(math.sqrt(a[1] * b[1]), rel=1e-12)
    assert fit.ppl_at(curve, curve[0][0] / 3) == (curve[0][1], False)
    assert fit.ppl_at(curve, curve[-1][0] * 3) == (curve[-1][1], False)


def _probe_file(path: Path, points: list[tuple[int, int, float, float]], shipped: bool) -> None:
    """A probe JSON whose held-out perplexity is least at a known step: points (fitted, documents, tail step, best
    step); its tuned step is the tail's shrunk as the probes' layer did (shipped) or the tail's itself."""
    fit = load_fit()
    rows = []
    for fitted, docs, tail, best in points:
        tuned = tail * (fit.shrink(fitted, docs, fit.PROBED_THRESHOLD, fit.PROBED_POWER) if shipped else 1.0)
        curve = [[tuned * s, 8.0 * math.exp(0.05 * math.log(tuned * s / best) ** 2)] for s in STEPS]
        # gap 0 tunes the best step; a gap whose fit chose other keys (width 1152) is left out of the gap table
        gap_steps = {"0": {"step": best, "key_width": 576}, "2": {"step": tuned, "key_width": 576}}
        if fitted == 8000:
            gap_steps["1"] = {"step": best, "key_width": 1152}
        rows.append({"domain": "email", "tokens": 32768, "tuned": True, "tuned_step": tuned, "fitted_tokens": fitted,
                     "held_out_documents": docs, "ppl_base": 9.0, "oracle_step": best, "oracle_ppl": 8.0,
                     "key_width": 576, "gap_steps": gap_steps, "curve": curve})  # fmt: skip
    rows.append({"domain": "email", "tokens": 2048, "tuned": False, "tuned_step": 0.03, "curve": []})
    path.write_text(json.dumps({"provenance": {"git_sha": "0" * 40}, "rows": rows}))


def test_the_fit_chooses_the_rule_that_gives_every_point_its_best_step(tmp_path):
    """Points whose best step is the tail's times (5000 / L)^1 beyond 5000 positions per text: that grid rule wins,
    from files with the shipped shrink applied and from files without it alike; untuned points are skipped."""
    fit = load_fit()
    points = [(fitted, docs, tail, tail * min(1.0, 5000 / (fitted / docs)))
              for fitted, docs, tail in [(26000, 2, 0.1), (20000, 1, 0.08), (8000, 2, 0.12), (26000, 10, 0.15),
                                         (12000, 2, 0.09), (30000, 3, 0.2)]]  # fmt: skip
    _probe_file(tmp_path / "shipped.json", points[:3], shipped=True)
    _probe_file(tmp_path / "tail.json", points[3:], shipped=False)
    payload = fit.main([str(tmp_path / "shipped.json"), "--tail-steps", str(tmp_path / "tail.json"),
                        "--results-dir", str(tmp_path), "--out", "fit"])  # fmt: skip
    assert (payload["best"]["threshold"], payload["best"]["power"]) == (5000, 1.0)
    # every point at its best step, up to reading a quadratic off a log-linear interpolation
    assert payload["best"]["mean"] == pytest.approx(8.0 / 9.0 - 1, abs=3e-4)
    assert payload["no_shrink"]["mean"] > payload["shipped"]["mean"] > payload["best"]["mean"]
    assert len(payload["points"]) == len(points)
    # every point is given its best step by that rule, so leaving any one out leaves it the best, ahead of the shipped
    assert [(r["threshold"], r["power"]) for r in payload["leave_one_out"]] == [(5000, 1.0)] * len(points)
    assert all(r["margin"] < 0 for r in payload["leave_one_out"])
    gaps = payload["gaps"]  # every point but the one whose gap 1 changed the key width
    assert len(gaps) == len(points) - 1 and all(set(v) == {"0", "2"} for v in gaps.values())
    assert all(v["0"] == pytest.approx(8.0 / 9.0 - 1, abs=3e-4) and v["0"] <= v["2"] for v in gaps.values())
    assert [p["tail_step"] for p in payload["points"]] == pytest.approx([p[2] for p in points], rel=1e-12)
    assert (tmp_path / "fit.md").exists() and json.loads((tmp_path / "fit.json").read_text())["provenance"]


def test_the_fit_refuses_files_without_a_tuned_point(tmp_path):
    fit = load_fit()
    (tmp_path / "p.json").write_text(json.dumps({"provenance": {}, "rows": [{"domain": "email", "tuned": False}]}))
    with pytest.raises(SystemExit, match="no tuned point"):
        fit.main([str(tmp_path / "p.json"), "--results-dir", str(tmp_path)])


def test_the_fold_rule_takes_the_two_fold_step_only_where_it_is_r_times_the_one_fits(tmp_path):
    """Points whose two-fold step is the best one where it is twice the one fit's, and too large where it is 1.1×
    (so it only hurts there): every R between them beats both always (R = 1) and never (R = inf, the shipped)."""
    fit = load_fit()
    rows = []
    for one, best, two in [(0.1, 0.2, 0.2), (0.1, 0.1, 0.11), (0.05, 0.1, 0.1), (0.08, 0.08, 0.088)]:
        curve = [[one * s, 8.0 * math.exp(0.05 * math.log(one * s / best) ** 2)] for s in STEPS]
        rows.append({"domain": "licenses", "tokens": 32768, "tuned": True, "tuned_step": one, "fitted_tokens": 2000,
                     "held_out_documents": 4, "ppl_base": 9.0, "oracle_step": best, "oracle_ppl": 8.0,
                     "curve": curve, "fold_steps": {"1": {"step": one}, "2": {"step": two}}})  # fmt: skip
    (tmp_path / "p.json").write_text(json.dumps({"provenance": {}, "rows": rows}))
    folds = fit.main([str(tmp_path / "p.json"), "--results-dir", str(tmp_path), "--out", "f"])["folds"]
    assert set(folds) == {str(r) for r in fit.FOLD_RATIOS}
    between = [r for r in fit.FOLD_RATIOS if 1.1 < r <= 2.0]
    assert between and all(folds[str(r)]["mean"] < min(folds["1.0"]["mean"], folds["inf"]["mean"]) for r in between)
    assert all(c == pytest.approx(8.0 / 9.0 - 1, abs=3e-4) for c in folds[str(between[0])]["changes"])
    assert "## Two folds where their step is at least R times" in (tmp_path / "f.md").read_text(encoding="utf-8")
