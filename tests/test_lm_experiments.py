"""The LM experiment pieces on tiny models: the kNN-LM baseline against hand computations, and the perplexity
experiment end to end (experiments/lm_ppl.py) on a tiny checkpoint and local text."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from faast.hf.evaluate import perplexity
from faast.hf.knnlm import KNNLM, KNNConfig
from hf_models import VOCAB, save_tiny_checkpoint, tiny_model

ROOT = Path(__file__).resolve().parents[1]


def texts(n, length, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (length,), generator=g).tolist() for _ in range(n)]


def test_knn_probabilities_equal_a_brute_force_computation():
    knn = KNNLM(tiny_model("llama"), KNNConfig(k=5, temperature=2.0, query_chunk=3))
    assert knn.add(texts(3, 12, 0), window=8, batch_size=2) == 3 * 11
    keys, values = torch.cat(knn.keys).double(), torch.cat(knn.values)
    queries = torch.randn(7, 32)
    targets = values[torch.tensor([0, 5, 9, 1, 2, 30, 17])]
    got = knn.knn_log_probs(queries, targets)
    for i in range(7):
        dist = ((queries[i].double() - keys) ** 2).sum(-1)
        near = torch.argsort(dist)[:5]
        w = torch.softmax(-dist[near] / 2.0, 0)
        p = float(w[values[near] == targets[i]].sum())
        assert (math.log(p) if p > 0 else -math.inf) == pytest.approx(float(got[i]), rel=1e-4, abs=1e-5)


def test_lambda_zero_is_the_language_model_and_lambda_mixes():
    model = tiny_model("gpt2")
    windows = texts(3, 10, 1)
    plain = perplexity(model, windows)
    off = KNNLM(model, KNNConfig(k=4, lam=0.0))
    off.add(texts(2, 20, 2), window=16)
    assert off.perplexity(windows).ppl == pytest.approx(plain.ppl, rel=1e-5)
    # Storing the very texts that are scored: their next tokens are in the datastore, so the mix must help.
    on = KNNLM(model, KNNConfig(k=1, lam=0.5))
    on.add(windows, window=16)
    assert on.perplexity(windows).ppl < plain.ppl
    assert on.nbytes() == sum(len(w) - 1 for w in windows) * (32 * 4 + 8)
    with pytest.raises(ValueError, match="datastore is empty"):
        KNNLM(model).perplexity(windows)


def test_the_perplexity_experiment_runs_end_to_end(tmp_path):
    checkpoint = save_tiny_checkpoint("llama", tmp_path / "tiny")
    (tmp_path / "learn.txt").write_text("def f(x):\n    return x + 1\n" * 40)
    (tmp_path / "score.txt").write_text("def g(y):\n    return y + 1\n" * 10)
    spec = importlib.util.spec_from_file_location("lm_ppl", ROOT / "experiments" / "lm_ppl.py")
    lm_ppl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lm_ppl)
    payload = lm_ppl.main([
        "--model", checkpoint, "--text-files", str(tmp_path / "learn.txt"),
        "--score-files", str(tmp_path / "score.txt"),
        "--limit", "600", "--score-limit", "200", "--window", "64", "--knn-k", "16", "--results-dir", str(tmp_path),
        "--out", "r",
    ])  # fmt: skip
    methods = [r["method"] for r in payload["rows"]]
    assert methods[0] == "zero-shot" and methods[1] == "FAAST" and methods[2].startswith("kNN-LM")
    assert payload["learn_tokens"] == 600 and payload["scored_tokens"] == 200 - 200 // 64 - (200 % 64 > 0)
    faast, knn = payload["rows"][1], payload["rows"][2]
    assert 0 < faast["memory_bytes"] and knn["memory_bytes"] == 599 * (32 * 4 + 8)
    assert all(math.isfinite(r["ppl"]) for r in payload["rows"])
    assert (tmp_path / "r.md").read_text().count("|") > 20
