"""lab/experiments/lm_step_search.py's reference search (the one before the shipped step search) on the synthetic
held-out logits of tests/test_step_search.py: it reads every row and reaches the shipped search's minimum."""

from faast_lab.experiments.lm_step_search import previous_search
from test_step_search import counting, held_out_logits, tuning
from tolerances import STEP_SEARCH_REL


def test_the_experiments_previous_search_reads_every_row_and_finds_the_same_minimum(monkeypatch):
    # The experiment measures the shipped search against the one before it: that reference must be the old algorithm
    # (all rows, bisection fallback) and reach the same minimum.
    logits, log_base = held_out_logits(1100)
    passes = counting(monkeypatch)
    eta_previous, _, rows = previous_search(tuning, logits, 0.5, log_base, 0.0)
    previous_passes = list(passes)
    passes.clear()
    eta_shipped, _, _ = tuning.tune_step_rows(logits, 0.5, log_base, 0.0)
    assert set(previous_passes) == {1100} and rows.eta == eta_previous
    assert sum(passes) < sum(previous_passes)
    assert abs(eta_previous - eta_shipped) <= STEP_SEARCH_REL * eta_shipped
