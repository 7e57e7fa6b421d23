"""lab/experiments/lm_curve_peers.py's pieces: the cut stream, LoRA's epoch schedule, the oracle cell and the curve's
'falls', each against a hand computation."""

from __future__ import annotations

import pytest

from faast_lab.experiments.lm_curve_peers import best_cell, cut_texts, falls, lora_epochs


def test_cut_texts_ends_each_text_before_the_first_marker_and_drops_what_ends_empty():
    texts = ["intro\nLICENCE one\nLICENCE two", "no marker here", "LICENCE at the start", "  \nLICENCE"]
    out, cut = cut_texts(texts, "LICENCE")
    assert out == ["intro\n", "no marker here"]
    assert cut == 3  # the last two were cut to nothing (blank) and dropped, but were cut
    assert cut_texts(["a", "b"], "zzz") == (["a", "b"], 0)
    with pytest.raises(ValueError, match="marker"):
        cut_texts(["a"], "")


def test_lora_epochs_give_a_short_prefix_the_last_points_tokens():
    # 2K of 8K: 3 epochs of 8K are 12 epochs of 2K, scored at 1, 2, 3, 4, 6, 8 and 12.
    assert lora_epochs(2048, 8192) == [1, 2, 3, 4, 6, 8, 12]
    assert lora_epochs(8192, 8192) == [1, 2, 3]  # the last point itself: LORA_TOKENS_EPOCHS
    assert lora_epochs(1000, 8192) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 25]  # ceil(3 · 8192 / 1000) = 25
    assert lora_epochs(4096, 8192) == [1, 2, 3, 4, 6]
    for bad in (0, 8193):
        with pytest.raises(ValueError, match="tokens"):
            lora_epochs(bad, 8192)


def test_best_cell_is_the_lowest_perplexity_with_ties_to_the_first_lr_then_fewest_epochs():
    grid = {"0.0003": {1: 9.0, 2: 8.5}, "0.001": {1: 8.2, 2: 8.4}, "0.003": {1: 8.3}}
    assert best_cell(grid) == (0.001, 1, 8.2)
    tied = {"0.001": {3: 7.0, 1: 7.0}, "0.003": {1: 7.0}}
    assert best_cell(tied) == (0.001, 1, 7.0)
    with pytest.raises(ValueError, match="grid"):
        best_cell({"0.001": {}})


def test_falls_only_when_every_point_is_below_the_one_before():
    assert falls([11.1, 10.9, 10.8]) == "yes"
    assert falls([11.1, 11.3, 10.8]) == "no"  # info's shape: a rise at the middle point
    assert falls([11.1, 11.1]) == "no"  # level is not a fall
    assert falls([11.1]) == "yes"
