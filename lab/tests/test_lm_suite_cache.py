"""The exact cache beside FAAST (lab/experiments/lm_suite_cache.py) on a tiny model, against float64 brute force, and
as lm_suite settings (a cached setting shares its pass and solve, and mixes its own FAAST scores with the cache)."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from faast.hf.evaluate import perplexity, token_log_probs
from faast.hf.tokens import token_lists
from faast_lab.experiments import lm_suite, lm_suite_cache, lm_suite_report, suite
from hf_models import VOCAB, CharTokenizer, tiny_model
from test_lm_suite import ARGS, fake_manifest, fake_tree, loader
from tolerances import CACHE_MIX_REL


def texts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def brute_pairs(lengths: list[int], tokens: int) -> int:
    """Pairs (t, t + 1) of one text with both positions among the stream's first `tokens` tokens, one by one."""
    count, start = 0, 0
    for n in lengths:
        count += sum(1 for t in range(n - 1) if start + t + 1 < tokens)
        start += n
    return count


def test_the_cache_holds_the_first_tokens_pairs_in_stream_order_and_mixes_as_float64_brute_force():
    base = tiny_model("llama")
    learn, windows = texts(0, (50, 7, 1, 90)), texts(1, (40, 17, 40))
    states = lm_suite_cache.build(base, learn, windows, window=32, batch_size=2)
    # The pairs in stream order: the values are each text's next tokens, one text after another.
    assert torch.equal(states.values, torch.tensor([t for ids in learn for t in ids[1:]]))
    lengths = [len(x) for x in learn]
    for n in (0, 1, 2, 50, 51, 57, 58, 59, 100, 148, 10**6):
        assert states.pairs(n) == brute_pairs(lengths, n), n
    # Per token, what perplexity() sums, in the order of the cache's queries.
    kept = token_log_probs(base, windows, batch_size=2, progress=False)
    logp, targets, result = kept.log_probs, kept.targets, kept.total
    ref = perplexity(base, windows, batch_size=2, progress=False)
    assert (result.nll, result.tokens) == (ref.nll, ref.tokens) and targets.numel() == ref.tokens
    assert torch.equal(targets, states.targets) and torch.equal(targets, torch.tensor([t for w in windows
                                                                                      for t in w[1:]]))  # fmt: skip
    for k in (16, 10**6):  # some of the pairs, then all of them
        spec = lm_suite_cache.CacheSpec(lam=0.3, temperature=5.0, k=k)
        got, cost = lm_suite_cache.read(states, logp, targets, 100, spec)
        n = states.pairs(100)
        dist = torch.cdist(states.queries.double(), states.keys[:n].double()).square()
        near = torch.topk(-dist, min(k, n), dim=-1)
        weight = torch.softmax(near.values / spec.temperature, dim=-1)
        hit = states.values[:n][near.indices] == targets.unsqueeze(-1)
        p = (1 - spec.lam) * logp.double().exp() + spec.lam * (weight * hit).sum(-1)
        assert got.nll == pytest.approx(-float(p.log().sum()), rel=CACHE_MIX_REL)
        assert got.tokens == ref.tokens and got.nll != pytest.approx(ref.nll, rel=1e-3)  # the cache changed it
        assert cost["pairs"] == n and cost["bytes"] == n * (base.config.hidden_size * 4 + 8) and cost["search_s"] > 0
        # One search per point serves every λ and T.
        again, cost = lm_suite_cache.read(states, logp, targets, 100, lm_suite_cache.CacheSpec(0.1, 30.0, k))
        assert cost["search_s"] == 0.0 and again.nll != got.nll
    with pytest.raises(ValueError, match="targets: the scored tokens differ"):
        lm_suite_cache.read(states, logp, targets.flip(0), 100, spec)
    with pytest.raises(ValueError, match="at least one cached pair"):
        lm_suite_cache.read(states, logp, targets, 1, spec)


@pytest.mark.parametrize(
    ("cache", "match"),
    [
        ({"lam": 1.0, "temperature": 1}, "cache lam"),
        ({"lam": 0.1, "temperature": 0}, "cache temperature"),
        ({"lam": 0.1, "temperature": 1, "k": 0}, "cache k"),
        ({"lam": 0.1}, "lam and temperature"),
        ({"lam": 0.1, "temperature": 1, "size": 3}, "lam and temperature"),
        (0.1, "lam and temperature"),
    ],
)
def test_a_bad_cache_is_refused_naming_the_setting(cache, match):
    with pytest.raises(ValueError, match=match):
        lm_suite_cache.split_cache("bad", {"cache": cache})
    with pytest.raises(ValueError, match="setting 'bad'"):
        lm_suite_cache.split_cache("bad", {"cache": cache})
    assert lm_suite_cache.split_cache("ok", {"bias": 0}) == ({"bias": 0}, None)


def test_a_cached_setting_shares_its_pass_and_solve_and_mixes_its_own_faast_scores(tmp_path):
    bases, sources = fake_tree(tmp_path / "tree")
    manifest = fake_manifest(bases, sources)
    settings = {"default": {}, "cached": {"cache": {"lam": 0.25, "temperature": 10, "k": 64}},
                "barely": {"cache": {"lam": 1e-9, "temperature": 10}},
                "no_bias_cached": {"bias": 0, "cache": {"lam": 0.25, "temperature": 10, "k": 64}}}  # fmt: skip
    out = tmp_path / "shards"
    lm_suite.main([*ARGS, "--settings", json.dumps(settings), "--out", str(out)], load_model=loader,
                  manifest=manifest, bases=bases)  # fmt: skip
    alone = tmp_path / "alone"
    lm_suite.main([*ARGS, "--settings", '{"default": {}, "no_bias": {"bias": 0}}', "--out", str(alone), "--domains",
                   "code"], load_model=loader, manifest=manifest, bases=bases)  # fmt: skip
    shard = json.loads((out / "code.json").read_text())
    rows, defined = shard["settings"], shard["protocol"]["settings"]
    assert rows["cached"]["shared_pass"] == list(settings)  # the cache is read only when scoring
    assert defined["cached"]["cache"] == {"lam": 0.25, "temperature": 10, "k": 64}
    assert "cache" not in defined["default"]
    assert defined["barely"]["cache"]["k"] == 1024
    # FAAST's scores in a cached group are perplexity()'s: the default reads as it does in a run without a cache.
    plain = json.loads((alone / "code.json").read_text())["settings"]
    assert rows["default"]["curve"]["ppl"] == plain["default"]["curve"]["ppl"]
    # λ near 0 reads as the FAAST setting it is added to; the cache's mix is its own score, not the default's.
    assert rows["barely"]["curve"]["ppl"] == pytest.approx(rows["default"]["curve"]["ppl"], rel=1e-6)
    assert all(a != b for a, b in zip(rows["cached"]["curve"]["ppl"], rows["default"]["curve"]["ppl"], strict=True))
    assert "score_reused_from" not in rows["cached"]
    # A cached setting adds no solve: its ResidualOutput's was solved already at each point.
    assert rows["cached"]["solve_shared_with"] == rows["barely"]["solve_shared_with"] == ["default", "default"]
    assert rows["cached"]["tuning"] == rows["default"]["tuning"] and "solve_shared_with" not in rows["no_bias_cached"]
    # Each cached setting mixes the scores of its own solve: without the bias, as the no-bias run reads them.
    learn, _, _ = suite.domain_texts("code", manifest, bases)
    lengths = [len(x) for x in token_lists(learn, CharTokenizer(), 800)]
    tokens = rows["cached"]["curve"]["tokens"]
    assert rows["cached"]["cache_curve"]["pairs"] == [lm_suite_cache.pairs_within(lengths, t) for t in tokens]
    assert rows["no_bias_cached"]["cache_curve"]["pairs"] == rows["cached"]["cache_curve"]["pairs"]
    assert rows["no_bias_cached"]["tuning"]["bias_step"] == plain["no_bias"]["tuning"]["bias_step"] == 0
    assert rows["no_bias_cached"]["ppl"] != rows["cached"]["ppl"]
    # Its time counts the pass that gathered the pairs; its memory the pairs' bytes.
    cache = rows["cached"]["cache"]
    assert cache["build_s"] > 0 and cache["query_s"] > 0
    assert rows["cached"]["learn_s"] == pytest.approx(rows["cached"]["pass_learn_s"] + rows["cached"]["solve_s"]
                                                      + cache["build_s"])  # fmt: skip
    d = tiny_model("llama").config.hidden_size
    pairs = rows["cached"]["cache_curve"]["pairs"][-1]
    assert rows["cached"]["memory_bytes"] - rows["default"]["memory_bytes"] == pairs * (4 * d + 8)
    # The report reads the cached settings as settings: leave-one-kind-out may choose them.
    merged = lm_suite_report.merge(lm_suite_report.load_shards([out]))
    assert set(merged["reductions"]["code"]) == set(settings)
    assert not math.isnan(merged["loko"]["median"])
    with pytest.raises(ValueError, match="setting 'bad'"):
        lm_suite.main([*ARGS, "--settings", '{"bad": {"cache": {"lam": 2, "temperature": 1}}}', "--out",
                       str(tmp_path / "bad")], load_model=loader, manifest=manifest, bases=bases)  # fmt: skip
    assert not (tmp_path / "bad").exists() or not list((tmp_path / "bad").iterdir())


def test_a_domain_that_chose_a_cached_setting_counts_the_pairs_pass_in_faast_s_time(tmp_path):
    from test_lm_suite import PEERS, planted_shard, write_shards

    cache = {"lam": 0.1, "temperature": 30.0, "k": 1024}
    shards = []
    # The cache pays on kinds A and B and costs on C: a1 and b1 choose the default (C's loss outweighs), c1 the cache.
    for domain, kind, cached in (("a1", "A", 0.20), ("b1", "B", 0.20), ("c1", "C", -0.20)):
        rows = {"default": (0.10, 40.0, [0.05, 0.10]), "cached": (cached, 50.0, [0.1, cached])}
        s = planted_shard(domain, kind, rows, peers=PEERS)
        s["protocol"]["settings"]["cached"] = {"policy": {"n": "cached"}, "cache": cache}
        s["settings"]["cached"].update(cache={**cache, "build_s": 10.0, "query_s": 1.0}, memory_bytes=3 * 2**20,
                                       cache_curve={"pairs": [399, 799], "search_s": [0.1, 0.0]})  # fmt: skip
        shards.append(s)
    merged = lm_suite_report.merge(lm_suite_report.load_shards([write_shards(tmp_path / "x", shards)]))
    chosen = {c["domain"]: c["setting"] for c in merged["loko"]["choices"]}
    assert chosen == {"a1": "default", "b1": "default", "c1": "cached"}
    facts = merged["domains"]
    assert facts["a1"]["cache"] is None and facts["a1"]["time_ratio"] == pytest.approx(40.0 / 100.0)
    # learn + solve 50 s with the pairs' 10 s pass, 40 s without: FAAST's 40 s beside the peers reads as 50 s.
    assert facts["c1"]["cache"] == {**cache, "tuned": False, "pairs": 799, "memory_bytes": 3 * 2**20, "build_s": 10.0,
                                    "time_factor": pytest.approx(50.0 / 40.0)}  # fmt: skip
    assert facts["c1"]["time_ratio"] == pytest.approx(50.0 / 100.0)
    assert merged["goals"]["time_ratio_worst"] == pytest.approx(0.5)
    lines = lm_suite_report.cache_lines(merged)
    assert [x for x in lines if x.startswith("| c1 ")] == ["| c1 | C | λ 0.1, T 30 | 799 | 3.0 | 1.25× |"]
    assert not [x for x in lines if x.startswith(("| a1 ", "| b1 "))]
    from results_formats import FORMATTERS

    assert lines[-1] in FORMATTERS["lm_suite"]([("lab/experiments/results/x.json", merged)])
    plain = [
        planted_shard(d, k, {"default": (0.1, 40.0, [0.0, 0.1])}, peers=PEERS) for d, k in (("a", "A"), ("b", "B"))
    ]
    assert lm_suite_report.cache_lines(lm_suite_report.merge(lm_suite_report.load_shards([write_shards(
        tmp_path / "y", plain)]))) == []  # fmt: skip


# ---------------------------------------------------------------------------------- the cache tuned on the tail


def test_search_apart_finds_the_nearest_pairs_of_other_documents_only():
    g = torch.Generator().manual_seed(3)
    keys, values = torch.randn(40, 8, generator=g), torch.randint(0, 5, (40,), generator=g)
    key_docs = torch.tensor([0] * 10 + [1] * 25 + [2] * 5)
    queries, targets = torch.randn(7, 8, generator=g), torch.randint(0, 5, (7,), generator=g)
    docs = torch.tensor([0, 1, 2, 1, 0, 2, 1])
    for k in (3, 30, 100):  # 30: more than document 1's others hold (15), so some neighbours are missing
        neg, hit = lm_suite_cache.search_apart(queries, targets, docs, keys, values, key_docs, k, query_chunk=3)
        for i in range(7):
            other = (key_docs != docs[i]).nonzero()[:, 0]
            dist = (queries[i].double() - keys[other].double()).square().sum(-1)
            order = dist.argsort()[: min(k, 40)]
            n = min(k, 40, other.numel())
            torch.testing.assert_close(-neg[i, :n].double(), dist[order[:n]], rtol=1e-5, atol=1e-5)
            assert torch.equal(hit[i, :n], values[other[order[:n]]] == targets[i])
            assert (neg[i, n:] == lm_suite_cache.FAR).all() and not hit[i, n:].any()  # missing: far, and no hit


def synthetic(helpful: bool) -> tuple:
    """A cache of three documents and a tail of 12 positions in documents 0 and 1: each tail query sits next to
    pairs of the other documents whose next token is the target (helpful) or another token (not)."""
    g = torch.Generator().manual_seed(5)
    d, per_doc = 6, 20
    centers, targets = torch.randn(12, d, generator=g) * 10, torch.randint(0, 50, (12,), generator=g)
    keys, values = [], []
    for doc in range(3):
        for j in range(per_doc):
            i = (doc * per_doc + j) % 12
            keys.append(centers[i] + 0.01 * torch.randn(d, generator=g))
            values.append(int(targets[i]) if helpful else (int(targets[i]) + 1) % 50)
    states = lm_suite_cache.CacheStates(keys=torch.stack(keys), values=torch.tensor(values), queries=torch.zeros(0, d),
                                        targets=torch.zeros(0, dtype=torch.int64), lengths=[per_doc + 1] * 3,
                                        build_s=0.0, query_s=0.0)  # fmt: skip
    tail = lm_suite_cache.Tail(rows=[], queries=centers, targets=targets, seconds=0.0,
                               documents=torch.tensor([0] * 6 + [1] * 6))  # fmt: skip
    faast = torch.full((12,), math.log(0.05))
    return states, tail, faast


@pytest.mark.parametrize("helpful", [True, False])
def test_the_tuned_cache_takes_the_grid_s_best_on_the_tail_and_none_where_it_only_costs(helpful):
    states, tail, faast = synthetic(helpful)
    spec = lm_suite_cache.TunedCacheSpec(k=8)
    chosen, record = lm_suite_cache.tune(states, tail, faast, 10**6, spec)
    grid = record["grid"]
    assert len(grid) == 1 + len(spec.lams) * len(spec.temperatures) and record["tail_positions"] == 12
    # Each grid point against float64 brute force over the other documents' pairs.
    docs = lm_suite_cache.pair_documents(states.lengths, 10**6)
    for point in grid[1:]:
        p = []
        for i in range(12):
            other = (docs != tail.documents[i]).nonzero()[:, 0]
            dist = (tail.queries[i].double() - states.keys[other].double()).square().sum(-1)
            near = dist.argsort()[:8]
            w = torch.softmax(-dist[near] / point["temperature"], 0)
            cache = float((w * (states.values[other[near]] == tail.targets[i])).sum())
            p.append((1 - point["lam"]) * 0.05 + point["lam"] * cache)
        assert point["nll"] == pytest.approx(-float(torch.tensor(p).double().log().mean()), rel=CACHE_MIX_REL)
    best = min(grid, key=lambda x: x["nll"])
    if helpful:
        assert chosen == lm_suite_cache.CacheSpec(best["lam"], best["temperature"], 8) and chosen.lam == max(spec.lams)
    else:  # every λ > 0 only moves mass away from the target: off
        assert chosen is None and best["lam"] == 0.0


def test_a_tuned_cache_reads_as_faast_where_no_tail_or_no_gain_and_counts_its_tuning(tmp_path):
    bases, sources = fake_tree(tmp_path / "tree")
    manifest = fake_manifest(bases, sources)
    out = tmp_path / "tuned"
    settings = {"default": {}, "tuned": {"cache": {"tune": True, "k": 64}}}
    lm_suite.main([*ARGS, "--curve", "100", "--settings", json.dumps(settings), "--out", str(out), "--domains",
                   "code"], load_model=loader, manifest=manifest, bases=bases)  # fmt: skip
    shard = json.loads((out / "code.json").read_text())
    rows = shard["settings"]
    grids = {"lams": list(lm_suite_cache.LAMS), "temperatures": list(lm_suite_cache.TEMPERATURES)}
    assert shard["protocol"]["settings"]["tuned"]["cache"] == {"tune": True, "k": 64, **grids}
    curve, tuned = rows["tuned"]["cache_curve"], rows["tuned"]["curve"]["ppl"]
    # 100 tokens hold no tail out (too little to fit on): the cache is off and untuned there.
    assert curve["lam"][0] == 0.0 and curve["temperature"][0] is None and curve["tune_s"][0] == 0.0
    assert curve["tune_s"][1] > 0  # 800 tokens hold a tail out
    for i, lam in enumerate(curve["lam"]):
        if lam == 0.0:  # off: FAAST's own perplexity, to the bit
            assert tuned[i] == rows["default"]["curve"]["ppl"][i] and curve["search_s"][i] == 0.0
    # Its last point reads as a fixed cache of the λ and T it chose there (off: as the default).
    cache = rows["tuned"]["cache"]
    assert (cache["lam"], cache["temperature"]) == (curve["lam"][-1], curve["temperature"][-1])
    if cache["lam"] > 0:
        fixed = tmp_path / "fixed"
        again = {
            "default": {},
            "fixed": {"cache": {"lam": cache["lam"], "temperature": cache["temperature"], "k": 64}},
        }
        lm_suite.main([*ARGS, "--curve", "100", "--settings", json.dumps(again), "--out", str(fixed), "--domains",
                       "code"], load_model=loader, manifest=manifest, bases=bases)  # fmt: skip
        read = json.loads((fixed / "code.json").read_text())["settings"]["fixed"]["ppl"]
        assert rows["tuned"]["ppl"] == pytest.approx(read, rel=1e-6)
    # Its time counts the pairs' pass and the last point's tuning (the tail's base pass, FAAST's scores, the grid).
    assert rows["tuned"]["learn_s"] == pytest.approx(rows["tuned"]["pass_learn_s"] + rows["tuned"]["solve_s"]
                                                     + cache["build_s"] + cache["tune_s"])  # fmt: skip
    facts = lm_suite_report.cache_facts(rows["tuned"])
    assert facts["tuned"] and facts["time_factor"] > 1


@pytest.mark.parametrize(
    ("cache", "match"),
    [({"tune": True, "k": 0}, "cache k"), ({"tune": True, "lams": [1.5]}, "cache lam"),
     ({"tune": True, "temperatures": []}, "non-empty"), ({"tune": True, "lam": 0.1}, "takes k, lams")],
)  # fmt: skip
def test_a_bad_tuned_cache_is_refused_naming_the_setting(cache, match):
    with pytest.raises(ValueError, match=match):
        lm_suite_cache.split_cache("bad", {"cache": cache})
    with pytest.raises(ValueError, match="setting 'bad'"):
        lm_suite_cache.split_cache("bad", {"cache": cache})


def test_the_tuned_cache_spec_file_is_the_default_beside_the_default_with_the_tuned_cache():
    args = lm_suite.parse_args(
        ["--out", "x", "--settings", str(lm_suite.ROOT / "lab/experiments/suite_cache_tuned.json")]
    )
    assert list(args.settings) == ["default", "default_cache_tuned"]
    fields, cache = lm_suite_cache.split_cache("default_cache_tuned", args.settings["default_cache_tuned"])
    # the default of its runs (the shrink's threshold of then, which the spec pins) with the tuned cache, no more
    assert fields == args.settings["default"] and cache == lm_suite_cache.TunedCacheSpec()
    spec = json.loads((lm_suite.ROOT / "lab/experiments/suite_cache_tuned.json").read_text())
    assert spec["mechanisms"][0]["on"] == ["default_cache_tuned"] and spec["mechanisms"][0]["off"] == "default"
