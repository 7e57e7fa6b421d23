"""The learn-while-reading benchmark (lab/experiments/lm_stream.py, issue 35) on tiny models: every method scores the
windows of faast.hf.reading.chunk_windows, prequentially, zero-shot as a plain forward pass; dynamic evaluation gives
the model back bit for bit; the neural cache against a float64 computation; the kNN-LM's datastore growing chunk by
chunk; the settings grids against the methods they stand for; and the script end to end."""

from __future__ import annotations

import importlib
import json
import math

import pytest
import torch

from faast.hf import FaastConfig, apply_faast

# The streaming baselines are experiment code (lab/experiments/lm_baselines), imported as the experiment scripts do.
from faast_lab.experiments.lm_baselines import stream
from hf_models import VOCAB, save_tiny_checkpoint, tiny_model

CHUNK = 32
N = 100  # chunks of 31 (the first), 32, 32 and 4 predicted tokens


def stream_ids(seed: int, n: int = N) -> torch.Tensor:
    """A stream that repeats a random cycle of 24 tokens, so every learning method has something to learn."""
    generator = torch.Generator().manual_seed(seed)
    cycle = torch.randperm(VOCAB - 3, generator=generator)[:24] + 3
    return cycle.repeat(n // 24 + 1)[:n]


def noise(seed: int, n: int = N) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def faast_model(seed: int = 0):  # noqa: ANN201 - a FaastModel
    return apply_faast(tiny_model("llama", seed), FaastConfig())


def make(name: str, model):  # noqa: ANN001, ANN201 - a StreamMethod
    """Each baseline with settings that change the scores visibly on a tiny model."""
    return {
        "zero-shot": lambda: stream.ZeroShot(model),
        "dynamic-eval-lora": lambda: stream.DynamicEvalLora(model, lr=1e-2, steps=2, rank=4),
        "dynamic-eval-blocks": lambda: stream.DynamicEvalBlocks(model, lr=1e-2, steps=2, blocks=2),
        "cache": lambda: stream.NeuralCache(model, theta=5.0, lam=0.3),
        "knn": lambda: stream.KnnStream(model, k=8, temperature=1.0, lam=0.3),
    }[name]()


BASELINES = ["zero-shot", "dynamic-eval-lora", "dynamic-eval-blocks", "cache", "knn"]


def run(name: str, model, ids: torch.Tensor) -> dict:  # noqa: ANN001
    if name == "faast":
        return stream.run_faast(model, ids, CHUNK)
    method = make(name, model)
    try:
        return stream.run_stream(method, ids, CHUNK)
    finally:
        method.close()


def plain_nll(model, ids: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """Every predicted token's NLL from plain forward passes over the chunk windows, in float64."""
    out = []
    for start, end in [(0, 32), (31, 64), (63, 96), (95, 100)]:
        with torch.no_grad():
            logits = model(input_ids=ids[None, start:end]).logits[0, :-1].double()
        out.append(-torch.log_softmax(logits, -1).gather(-1, ids[start + 1 : end, None]).squeeze(-1))
    return torch.cat(out)


def test_every_method_scores_the_same_windows_and_zero_shot_is_a_plain_forward_pass():
    pytest.importorskip("peft")
    base = tiny_model("llama")
    ids = stream_ids(0)
    reference = plain_nll(base, ids)
    model = apply_faast(base, FaastConfig())
    results = {name: run(name, model, ids) for name in [*BASELINES, "faast"]}
    for name, r in results.items():
        assert r["tokens"] == [31, 32, 32, 4], name
        assert r["token_nll"].dtype == torch.float64 and r["token_nll"].shape == (N - 1,), name
        assert len(r["nll"]) == len(r["update_s"]) == len(r["read_s"]) == 4
        assert r["nll"][1] == pytest.approx(float(r["token_nll"][31:63].mean()), rel=1e-12)
        assert r["ppl"] == pytest.approx(math.exp(float(r["token_nll"][31:].mean())), rel=1e-12)
        assert r["total_s"] == pytest.approx(sum(r["update_s"]) + sum(r["read_s"]))
        # Chunk 0 is read before anything is learned: every method scores it as the base model does.
        torch.testing.assert_close(r["token_nll"][:31], reference[:31], rtol=1e-5, atol=1e-5, msg=name)
        if name != "zero-shot":  # and every method's learning changes the later chunks' scores
            assert not torch.allclose(r["token_nll"][31:], reference[31:], rtol=1e-4, atol=1e-4), name
    torch.testing.assert_close(results["zero-shot"]["token_nll"], reference, rtol=1e-6, atol=1e-6)
    assert results["zero-shot"]["update_s"] == [0.0] * 4
    assert [stream.prequential_ppl(r["token_nll"], r["tokens"]) for r in results.values()] == [
        r["ppl"] for r in results.values()
    ]


@pytest.mark.parametrize("name", [*BASELINES, "faast"])
def test_each_method_is_prequential_later_chunks_do_not_change_earlier_scores(name):
    if name.startswith("dynamic"):
        pytest.importorskip("peft")
    model = faast_model()
    ids = stream_ids(1)
    changed = ids.clone()
    changed[64:] = noise(2)[64:]  # chunks 2 and 3 (window 2 starts at token 63, which stays)
    a, b = run(name, model, ids), run(name, model, changed)
    assert torch.equal(a["token_nll"][:63], b["token_nll"][:63])
    assert not torch.equal(a["token_nll"][63:], b["token_nll"][63:])
    # Changing chunk 1 changes what chunk 2 is scored with (except for the model that learns nothing).
    earlier = ids.clone()
    earlier[40:60] = noise(3)[40:60]
    c = run(name, model, earlier)
    assert torch.equal(a["token_nll"][:31], c["token_nll"][:31])
    assert torch.equal(a["token_nll"][64:], c["token_nll"][64:]) == (name == "zero-shot")


@pytest.mark.parametrize("form", ["dynamic-eval-lora", "dynamic-eval-blocks"])
def test_dynamic_evaluation_learns_and_gives_the_model_back_bit_for_bit(form):
    pytest.importorskip("peft")
    model = faast_model()
    net = model.base_model
    saved = {k: v.clone() for k, v in net.state_dict().items()}
    flags = {k: p.requires_grad for k, p in net.named_parameters()}
    modules = [type(m) for m in net.modules()]
    ids = stream_ids(4)
    with torch.no_grad():
        before = net(input_ids=ids[None]).logits
    method = make(form, model)
    for start, end in [(0, 32), (31, 64)]:
        method.score(ids[None, start:end])
        assert method.update(ids[None, start:end]) > 0
    # While learning, what it trains has moved: LoRA's B (zero at the start), the blocks' weights.
    trained = [p for n, p in method.module.named_parameters() if "lora_B" in n] if form.endswith("lora") else [
        p for n, p in method.trained.named_parameters()]  # fmt: skip
    if form.endswith("lora"):
        assert trained and all(p.abs().sum() > 0 for p in trained)
    else:
        assert all(not torch.equal(p, saved[k]) for k, p in net.named_parameters() if p.requires_grad)
    learned, _ = method.score(ids[None, 63:96])
    method.close()
    assert not torch.allclose(learned, plain_nll(net, ids)[63:95])
    assert [type(m) for m in net.modules()] == modules  # LoRA layers unloaded
    assert net.state_dict().keys() == saved.keys()
    assert all(torch.equal(v, saved[k]) for k, v in net.state_dict().items())
    assert {k: p.requires_grad for k, p in net.named_parameters()} == flags
    assert all(p.grad is None for p in net.parameters())
    with torch.no_grad():
        assert torch.equal(net(input_ids=ids[None]).logits, before)


def test_the_neural_cache_is_the_model_when_empty_and_its_mixture_equals_a_float64_computation():
    model = tiny_model("llama")
    ids = stream_ids(5)
    theta, lam = 4.0, 0.25
    cache = stream.NeuralCache(model, theta=theta, lam=lam, query_chunk=5)
    first, _ = cache.score(ids[None, 0:32])
    assert torch.equal(first, stream.ZeroShot(model).score(ids[None, 0:32])[0])
    cache.update(ids[None, 0:32])
    assert cache.size == 31
    got, _ = cache.score(ids[None, 31:64])
    # The reference: the model's softmax and the cache's weights over the 31 stored states, in float64.
    seen = {}
    head = model.get_output_embeddings()
    handle = head.register_forward_pre_hook(lambda m, args: seen.setdefault("h", []).append(args[0][0, :-1].double()))
    with torch.no_grad():
        model(input_ids=ids[None, 0:32])
        logits = model(input_ids=ids[None, 31:64]).logits[0, :-1].double()
    handle.remove()
    keys, query = [torch.nn.functional.normalize(h, dim=-1) for h in seen["h"]]
    p_model = torch.softmax(logits, -1)
    weights = torch.softmax(theta * query @ keys.T, -1)  # [32, 31]
    p_cache = torch.zeros(32, VOCAB, dtype=torch.float64).index_add_(1, ids[1:32], weights)
    p = (1 - lam) * p_model + lam * p_cache
    want = -torch.log(p.gather(-1, ids[32:64, None]).squeeze(-1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (got < -torch.log(p_model.gather(-1, ids[32:64, None]).squeeze(-1))).any()
    # A window not just scored gets its states from a forward pass of its own.
    cache.update(ids[None, 63:96])
    states = stream.stream_states(model, ids, CHUNK)
    assert cache.size == 63 and torch.equal(cache.keys[1], torch.nn.functional.normalize(states.hidden[2], dim=-1))


def test_the_knn_datastore_grows_by_each_chunks_predicted_positions():
    model = tiny_model("llama")
    ids = stream_ids(6)
    knn = stream.KnnStream(model, k=8, temperature=2.0, lam=0.4)
    sizes = []
    for start, end in [(0, 32), (31, 64), (63, 96), (95, 100)]:
        before = knn.size
        nll, _ = knn.score(ids[None, start:end])
        if before == 0:
            assert torch.equal(nll, stream.ZeroShot(model).score(ids[None, start:end])[0])
        knn.update(ids[None, start:end])
        sizes.append(knn.size)
    assert sizes == [31, 63, 95, 99]
    assert torch.equal(torch.cat(knn.knn.values), ids[1:])
    # The stored keys are the LM head's inputs: the same as lm_baselines.KNNLM.add stores for the same windows.
    direct = stream.KNNLM(model)
    direct.add([ids[0:32].tolist()], window=32)
    torch.testing.assert_close(knn.knn.keys[0], direct.keys[0], rtol=1e-5, atol=1e-5)


def test_the_cache_and_knn_grids_score_what_the_methods_score():
    model = tiny_model("llama")
    ids = stream_ids(7)
    states = stream.stream_states(model, ids, CHUNK)
    assert states.tokens == [31, 32, 32, 4]
    grid = stream.cache_grid(states, thetas=[1.0, 8.0], lams=[0.1, 0.4])
    knns = stream.knn_grid(states, ks=[4, 16], temperatures=[1.0, 5.0], lams=[0.2])
    assert len(grid) == 4 and len(knns) == 4
    for (theta, lam), nll in grid.items():
        direct = stream.run_stream(stream.NeuralCache(model, theta, lam), ids, CHUNK)["token_nll"]
        torch.testing.assert_close(nll, direct, rtol=1e-6, atol=1e-6)
    for (k, temp, lam), nll in knns.items():
        direct = stream.run_stream(stream.KnnStream(model, k, temp, lam), ids, CHUNK)["token_nll"]
        torch.testing.assert_close(nll, direct, rtol=1e-6, atol=1e-6)
    assert len({round(float(n[31:].mean()), 6) for n in [*grid.values(), *knns.values()]}) == 8


def load_script(name: str):  # noqa: ANN201 - the experiment module
    """The experiment script `name` (lab/experiments/<name>.py), imported as faast_lab.experiments.<name>."""
    return importlib.import_module(f"faast_lab.experiments.{name}")


ROW_FIELDS = {"stream", "method", "ppl", "relative_reduction", "update_s", "total_s", "tokens"}


def test_the_stream_experiment_runs_end_to_end(tmp_path):
    pytest.importorskip("peft")
    checkpoint = save_tiny_checkpoint("llama", tmp_path / "tiny")
    (tmp_path / "a.txt").write_text("def f(x):\n    return x + 1\n" * 3)
    (tmp_path / "b.txt").write_text("class A:\n    pass\n" * 4)
    (tmp_path / "c.txt").write_text("")  # empty: skipped
    module = load_script("lm_stream")
    common = ["--model", checkpoint, "--text-files", str(tmp_path / "a.txt"), str(tmp_path / "*.txt"),
              "--limit", "96", "--chunk", "32", "--results-dir", str(tmp_path)]  # fmt: skip
    payload = module.main([*common, "--validation-streams", "email", "--validation-limit", "64", "--out", "r",
                           "--lora-lrs", "1e-3", "--block-lrs", "1e-4,1e-3", "--dynamic-steps", "1",
                           "--knn-ks", "4,16"])  # fmt: skip
    methods = ["zero-shot", "faast", "dynamic-eval-lora", "dynamic-eval-blocks", "cache", "knn"]
    assert [(r["stream"], r["method"]) for r in payload["rows"]] == [(s, m) for s in ("text-files", "mean")
                                                                     for m in methods]  # fmt: skip
    # a.txt then the glob's a.txt (a duplicate, skipped), b.txt, c.txt (empty, skipped): two files read.
    stream = payload["streams"]["text-files"]
    assert {k: stream[k] for k in ("tokens", "files")} == {"tokens": 96, "files": 2}
    assert stream["measured_by"]["git_sha"] == json.loads((tmp_path / "r.json").read_text())["provenance"]["git_sha"]
    for r in payload["rows"]:
        assert ROW_FIELDS <= set(r) and r["tokens"] == 95 and math.isfinite(r["ppl"])
    faast = payload["rows"][1]
    assert {"update_max_s", "update_mean_s", "update_per_chunk_s"} <= set(faast)
    assert len(faast["update_per_chunk_s"]) == 3 and payload["rows"][0]["relative_reduction"] == 0.0
    chunks = payload["chunks"]["text-files"]
    assert set(chunks) == set(methods) and all(len(c["nll"]) == 3 for c in chunks.values())
    # The grids: 1 x 1 LoRA points, 2 x 1 block points, 5 x 5 cache points, 2 x 4 x 4 kNN points.
    points = payload["validation"]["points"]
    assert [len(points[m]) for m in methods[2:]] == [1, 2, 25, 32]
    assert all(set(p["ppl"]) == {"email"} for ps in points.values() for p in ps)
    chosen = payload["chosen_settings"]
    assert chosen["knn"]["validation_ppl"] == min(p["mean_ppl"] for p in points["knn"])
    assert set(chosen) == set(methods[2:]) and chosen["dynamic-eval-lora"]["at_grid_edge"] == []
    assert chosen["dynamic-eval-blocks"]["at_grid_edge"] == ["lr"]  # 2 learning rates: either is an end
    written = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    assert written["provenance"]["git_sha"] and written["rows"] == json.loads(json.dumps(payload["rows"]))
    md = (tmp_path / "r.md").read_text(encoding="utf-8")
    assert md.count("Goals:") == 1 and all(f"({i})" in md for i in range(1, 5))
    judged = [line for line in md.splitlines() if line.startswith("- (")]
    assert len(judged) == 4 and all("**met**" in line or "**NOT met**" in line for line in judged)
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "r.png").stat().st_size > 1000
    # With the chosen settings given, nothing is searched; an earlier result is accepted as the settings file.
    again = module.main([*common, "--settings", str(tmp_path / "r.json"), "--methods", "cache,knn", "--out", "s"])
    assert [r["method"] for r in again["rows"]] == ["zero-shot", "cache", "knn"] * 2
    assert again["validation"]["streams"] == {} and again["chosen_settings"]["cache"] == chosen["cache"]
    assert [r["ppl"] for r in again["rows"]] == [r["ppl"] for r in payload["rows"] if r["method"] in again["methods"]]
    lines = (tmp_path / "s.md").read_text(encoding="utf-8").splitlines()
    assert sum("**not run**" in line for line in lines) == 4


def test_a_resumed_stream_run_keeps_the_finished_streams_and_their_machine_and_runs_the_rest(tmp_path):
    """--resume: a stream the JSON holds with every method is kept as measured (its rows, chunks and machine), its
    settings are the run's, a stream cut short or missing is run; a resume that would measure something else stops."""
    checkpoint = save_tiny_checkpoint("llama", tmp_path / "tiny")
    module = load_script("lm_stream")
    settings = tmp_path / "settings.json"
    settings.write_text(json.dumps({"cache": {"theta": 3.0, "lam": 0.1}}), encoding="utf-8")
    common = ["--model", checkpoint, "--limit", "96", "--chunk", "32", "--methods", "cache", "--results-dir",
              str(tmp_path), "--out", "r"]  # fmt: skip
    module.main([*common, "--streams", "stdlib", "--settings", str(settings)])
    earlier = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    # Marks that only a kept stream can carry: another machine, and a perplexity no run would measure.
    earlier["provenance"].update(date="d0", git_sha="abcdef0123", cpu_model="AMD EPYC", cpu_native_bf16=False)
    del earlier["streams"]["stdlib"]["measured_by"]  # a result written before streams recorded their machine
    kept = next(r for r in earlier["rows"] if r["stream"] == "stdlib" and r["method"] == "cache")
    kept["ppl"] = 123.0
    (tmp_path / "r.json").write_text(json.dumps(earlier), encoding="utf-8")
    payload = module.main([*common, "--streams", "longfile,stdlib", "--resume"])
    assert list(payload["streams"]) == ["longfile", "stdlib"]  # --streams order, not the order run
    rows = {(r["stream"], r["method"]): r for r in payload["rows"]}
    assert rows["stdlib", "cache"]["ppl"] == 123.0 and ("longfile", "cache") in rows
    assert payload["chosen_settings"]["cache"] == {"theta": 3.0, "lam": 0.1}
    stdlib, longfile = payload["streams"]["stdlib"]["measured_by"], payload["streams"]["longfile"]["measured_by"]
    assert stdlib["cpu_model"] == "AMD EPYC" and stdlib["git_sha"] == "abcdef0123" and stdlib["date"] == "d0"
    assert longfile["git_sha"] == json.loads((tmp_path / "r.json").read_text())["provenance"]["git_sha"]
    assert payload["earlier_runs"][-1]["date"] == "d0" and payload["chunks"]["stdlib"] == earlier["chunks"]["stdlib"]
    md = (tmp_path / "r.md").read_text(encoding="utf-8")
    assert "- stdlib: the run of d0 at abcdef0 on AMD EPYC (no native bfloat16)" in md
    # A stream cut short (a method missing) is run again whole, with the kept settings.
    cut = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    cut["rows"] = [r for r in cut["rows"] if (r["stream"], r["method"]) != ("longfile", "cache")]
    (tmp_path / "r.json").write_text(json.dumps(cut), encoding="utf-8")
    again = module.main([*common, "--streams", "longfile,stdlib", "--resume"])
    assert {(r["stream"], r["method"]) for r in again["rows"]} >= {("longfile", "cache"), ("longfile", "zero-shot")}
    assert again["streams"]["longfile"]["measured_by"]["date"] != "d0"
    for flag, value in (("--chunk", "48"), ("--limit", "128")):
        with pytest.raises(SystemExit, match=flag.strip("-")):
            module.main([*[c if c != common[common.index(flag) + 1] else value for c in common], "--streams", "stdlib",
                         "--resume"])  # fmt: skip
    other = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    (tmp_path / "r.json").write_text(json.dumps({**other, "model": "another model"}), encoding="utf-8")
    with pytest.raises(SystemExit, match="measured 'another model'"):
        module.main([*common, "--streams", "stdlib", "--resume"])
    with pytest.raises(SystemExit, match="drop --settings"):
        module.main([*common, "--streams", "stdlib", "--resume", "--settings", str(settings)])
