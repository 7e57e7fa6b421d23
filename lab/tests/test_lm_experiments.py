"""The LM experiment pieces on tiny models: the kNN-LM baseline against hand computations, and the perplexity
experiment end to end (lab/experiments/lm_ppl.py) on a tiny checkpoint and local text."""

from __future__ import annotations

import importlib
import json
import math
import random
import sys
from pathlib import Path

import pytest
import torch

from faast.hf.evaluate import perplexity, wilson_interval

# The kNN-LM is experiment code (lab/experiments/lm_baselines), imported as the experiment scripts do.
from faast_lab.experiments.lm_baselines import KNNLM, KNNConfig, held_out_neighbours, tune_knn, tuning_split
from hf_models import PROSE, VOCAB, CharTokenizer, save_tiny_checkpoint, tiny_model, transformers

# A minimal ChatML-like template (the tiny tokenizers have no chat template of their own).
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)

ROOT = Path(__file__).resolve().parents[2]


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


def successor_text(length: int, seed: int, start: int = 0) -> list[int]:
    """Tokens that follow a fixed random cycle through the vocabulary: each token's next one is always the same."""
    cycle = (torch.randperm(VOCAB - 3, generator=torch.Generator().manual_seed(seed)) + 3).tolist()
    return [cycle[(start + i) % len(cycle)] for i in range(length)]


def test_tuned_knn_trusts_a_datastore_that_predicts_the_tail_and_not_one_that_cannot():
    model = tiny_model("llama")
    grid = {"lams": (0.05, 0.25, 0.6), "temperatures": (1.0, 10.0), "k": 8, "window": 64, "batch_size": 4}
    # The held-out tails continue the very cycle the fit prefixes hold: their next tokens are in the datastore.
    repeated = tuning_split([successor_text(300, 0, 7 * i) for i in range(3)], tune_tokens=128, min_fit=256)
    choice = tune_knn(model, repeated, **grid)
    assert choice.lam == 0.6 and choice.nll < choice.base_nll - 1.0
    assert len(choice.grid) == 6 and choice.nll == min(g["nll"] for g in choice.grid)
    assert choice.held_tokens == repeated.held_tokens and choice.fit_tokens == repeated.fit_tokens
    # Random tokens: the datastore knows nothing of the tail, and mixing it in only costs.
    random_text = tuning_split(texts(3, 300, 5), tune_tokens=128, min_fit=256)
    choice = tune_knn(model, random_text, **grid)
    assert choice.lam == 0.05 and choice.nll > choice.base_nll


def test_the_knn_grid_from_cached_neighbours_equals_knnlm_perplexity_at_each_setting():
    model = tiny_model("gpt2")
    docs = [successor_text(200, 1, 5)[:120] + t for t in texts(3, 180, 9)]
    split = tuning_split(docs, tune_tokens=128, min_fit=256)
    choice = tune_knn(model, split, lams=(0.1, 0.5), temperatures=(0.5, 20.0), k=6, window=48, batch_size=3)
    rows = split.held_rows(48)
    for g in choice.grid:
        direct = KNNLM(model, KNNConfig(k=6, lam=g["lam"], temperature=g["temperature"], query_chunk=7))
        direct.add(split.fit_texts(), window=48, batch_size=2)
        scored = direct.perplexity([r for r, _ in rows], batch_size=2, scored=[n for _, n in rows])
        assert scored.tokens == split.held_tokens
        assert g["nll"] == pytest.approx(scored.nll / scored.tokens, rel=1e-5)
    # The settings differ enough that the grid is not flat, and λ = 0 is the LM alone.
    assert len({round(g["nll"], 4) for g in choice.grid}) == 4
    lm, neg, hit = held_out_neighbours(direct, split, 48, 3)
    assert torch.equal(KNNLM.mix(lm, neg, hit, 0.0, 1.0), lm)
    assert choice.base_nll == pytest.approx(float(-lm.double().mean()), rel=1e-6)
    with pytest.raises(ValueError, match="scored: row 0 has 48 tokens"):
        direct.perplexity([r for r, _ in rows], scored=[48] * len(rows))


def load_script(name: str):  # noqa: ANN201 - the experiment module
    """The experiment script `name` (lab/experiments/<name>.py), imported as faast_lab.experiments.<name>."""
    return importlib.import_module(f"faast_lab.experiments.{name}")


def tiny_loader(base=None):  # noqa: ANN001, ANN201 - a load_model for the scripts' main
    """What the experiments' main takes as load_model: `base` (else a fresh tiny Llama) with the character tokenizer,
    described as "t", whatever model is asked for."""
    return lambda name: (tiny_model("llama") if base is None else base, CharTokenizer(), "t")


def test_the_perplexity_experiment_runs_end_to_end(tmp_path):
    pytest.importorskip("peft")
    checkpoint = save_tiny_checkpoint("llama", tmp_path / "tiny")
    (tmp_path / "learn.txt").write_text("def f(x):\n    return x + 1\n" * 40)
    (tmp_path / "score.txt").write_text("def g(y):\n    return y + 1\n" * 10)
    payload = load_script("lm_ppl").main([
        "--model", checkpoint, "--text-files", str(tmp_path / "learn.txt"),
        "--score-files", str(tmp_path / "score.txt"), "--limit", "600", "--score-limit", "200", "--window", "64",
        "--knn-k", "16", "--curve-points", "3", "--train-window", "32", "--results-dir", str(tmp_path), "--out", "r",
    ])  # fmt: skip
    methods = [r["method"] for r in payload["rows"]]
    assert methods[:2] == ["zero-shot", "FAAST"] and methods[2].startswith("kNN-LM")
    assert (
        methods[3].startswith("linear projection") and methods[4].startswith("LoRA") and methods[5].startswith("ICL")
    )
    assert payload["learn_tokens"] == 600 and payload["scored_tokens"] == 200 - 200 // 64 - (200 % 64 > 0)
    rows = {m.split(" ")[0]: r for m, r in zip(methods, payload["rows"], strict=True)}
    assert 0 < rows["FAAST"]["memory_bytes"] and rows["kNN-LM"]["memory_bytes"] == 599 * (32 * 4 + 8)
    # Linear: 2 layers (the default rule on 4 blocks) x 32 x 32 float32; LoRA's rank matches that budget.
    assert rows["linear"]["params"] == len(payload["baseline_layers"]) * 32 * 32 == rows["linear"]["memory_bytes"] // 4
    assert abs(rows["LoRA"]["params"] - rows["linear"]["params"]) <= 4 * 112 // 2
    # ICL fills the tiny model's 128 positions: 64 context tokens before each 64-token window.
    assert rows["ICL"]["context_tokens"] == 64
    assert all(math.isfinite(r["ppl"]) for r in payload["rows"])
    curve = payload["curve"]
    assert curve["tokens"] == [150, 300, 600] and len(curve["faast"]) == len(curve["knn"]) == 3
    assert curve["faast"][-1] == rows["FAAST"]["ppl"] and curve["knn"][-1] == rows["kNN-LM"]["ppl"]
    # FAAST's learn time holds its last solve; the earlier points' solves are recorded apart, not as scoring time.
    assert len(curve["faast_solve_s"]) == 3 and rows["FAAST"]["learn_s"] >= curve["faast_solve_s"][-1] > 0
    assert rows["FAAST"]["curve_solve_s"] == sum(curve["faast_solve_s"][:2])
    assert (tmp_path / "r.md").read_text().count("|") > 40
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "r.png").stat().st_size > 1000


def write_reviews(path: Path) -> None:
    rows = [("a good film", "positive"), ("a bad film", "negative"), ("good fun", "positive"), ("dull", "negative"),
            ("a great cast", "positive"), ("a poor plot", "negative")]  # fmt: skip
    lines = [json.dumps({"text": t, "label": y, "split": "train"}) for t, y in rows]
    lines += [json.dumps({"text": f"query {c}", "label": "positive" if i % 2 else 0, "split": "test"})
              for i, c in enumerate("abcde")]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")


def test_the_sentiment_experiment_scores_each_query_once(tmp_path):
    pytest.importorskip("datasets")  # the local JSONL file is read through the datasets library
    checkpoint = save_tiny_checkpoint("gpt2", tmp_path / "tiny", PROSE)
    write_reviews(tmp_path / "reviews.jsonl")
    module = load_script("lm_sentiment")
    payload = module.main([
        "--model", checkpoint, "--data-file", str(tmp_path / "reviews.jsonl"), "--shots", "1,2,full",
        "--limit", "1000", "--results-dir", str(tmp_path), "--out", "s",
    ])  # fmt: skip
    # 5 distinct queries: never repeated to reach --limit, and the interval is over those 5.
    assert payload["queries"] == 5 and payload["support"] == 6
    got = [(r["method"], r["shots"]) for r in payload["rows"]]
    # In the tiny model's 128 positions, 1 demonstration per label fits; 2 per label and the full set do not, and
    # are reported as such instead of being cut.
    assert got == [("zero-shot", 0), ("FAAST", 1), ("ICL", 1), ("FAAST", 2), ("FAAST", "full")]
    assert [n.split(":")[0] for n in payload["notes"]] == ["ICL 2", "ICL full"]
    for r in payload["rows"]:
        correct = round(r["accuracy"] * 5)
        assert r["ci95"] == list(wilson_interval(correct, 5)) and r["queries"] == 5
    with pytest.raises(ValueError, match="4 per label needs 4"):
        module.main(["--model", checkpoint, "--data-file", str(tmp_path / "reviews.jsonl"), "--shots", "4",
                     "--results-dir", str(tmp_path)])  # fmt: skip
    # The result files carry faast.provenance's record: JSON under "provenance", Markdown as the header block.
    written = json.loads((tmp_path / "s.json").read_text(encoding="utf-8"))
    assert written["provenance"]["git_sha"] and written["provenance"]["loadavg_at_end"] is not None
    assert written["rows"] == payload["rows"] and str(ROOT) not in json.dumps(written["provenance"])
    md = (tmp_path / "s.md").read_text(encoding="utf-8").splitlines()
    assert md[0].startswith("# Few-shot sentiment classification: ") and md[2].startswith("- run: ")


def test_sentiment_prompts_and_balanced_draws():
    module = load_script("lm_sentiment")
    prompts = module.Prompts(CharTokenizer(), max_words=3)
    assert prompts.example("one two three four", "positive") == "Review: one two three\nSentiment: positive\n"
    support = [(f"p{i}", "positive") for i in range(5)] + [(f"n{i}", "negative") for i in range(5)]
    draw = module.balanced_sample(support, 2, random.Random("0/1/2"))
    assert sorted(y for _, y in draw) == ["negative"] * 2 + ["positive"] * 2
    assert draw == module.balanced_sample(support, 2, random.Random("0/1/2"))
    with pytest.raises(ValueError, match="label"):
        module._label("neutral")


@pytest.mark.parametrize("chat", [False, True])
def test_the_translation_experiment_runs_end_to_end(tmp_path, chat):
    pytest.importorskip("sacrebleu")
    pytest.importorskip("datasets")
    checkpoint = save_tiny_checkpoint("qwen2", tmp_path / "tiny", PROSE)
    if chat:
        tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save_pretrained(checkpoint)
    pairs = [{"en": f"the cat {w}", "de": f"die katze {w}", "split": "train" if i < 4 else "test"}
             for i, w in enumerate(["sits", "runs", "eats", "naps", "sings", "reads", "jumps"])]  # fmt: skip
    (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps(p) for p in pairs))
    payload = load_script("lm_translation").main([
        "--model", checkpoint, "--data-file", str(tmp_path / "pairs.jsonl"), "--pairs", "en-de,de-en",
        "--max-new-tokens", "6", "--bootstrap", "50", "--results-dir", str(tmp_path), "--out", "t",
    ])  # fmt: skip
    got = [(r["pair"], r["method"], r["shots"]) for r in payload["rows"]]
    assert got == [(p, m, s) for p in ("en-de", "de-en") for m, s in
                   (("zero-shot", "0"), ("FAAST", "1"), ("ICL", "1"), ("FAAST", "full"))]  # fmt: skip
    assert all(r["queries"] == 3 and 0 <= r["bleu"] <= 100 for r in payload["rows"])
    assert payload["examples"]["de-en"]["references"][0].startswith("the cat")


def test_translation_prompts_follow_the_chat_template_or_the_plain_format(tmp_path):
    module = load_script("lm_translation")
    plain = module.Prompts(CharTokenizer(), "en", "de")
    assert not plain.chat
    text = "Please translate English text into German.\n\nEnglish: hi\nGerman:"
    assert plain.prompt_ids("hi") == CharTokenizer()(text)["input_ids"]
    assert plain.example_ids("hi", "hallo") == CharTokenizer()(text + " hallo\n")["input_ids"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(save_tiny_checkpoint("llama", tmp_path / "t", PROSE))
    tokenizer.chat_template = CHAT_TEMPLATE
    chat = module.Prompts(tokenizer, "en", "de")
    decoded = tokenizer.decode(chat.example_ids("hi", "hallo"))
    assert decoded.startswith("<s>system\nYou are a helpful assistant.") and decoded.endswith("assistant\nhallo\n")
    icl = tokenizer.decode(chat.prompt_ids("bye", [("hi", "hallo")]))
    assert icl.count("Please translate") == 2 and icl.endswith("assistant\n")
    pytest.importorskip("sacrebleu")  # BLEU itself needs the experiments extra
    assert module.bleu(["die katze sitzt hier"], ["die katze sitzt hier"], 0)["bleu"] == pytest.approx(100)
    assert module.bleu(["der hund"], ["die katze sitzt hier"], 0)["bleu"] < 1


def test_the_shipped_evaluation_data_is_balanced_and_split():
    reviews = [json.loads(x) for x in (ROOT / "lab/experiments/data/reviews.jsonl").read_text().splitlines()]
    counts = {(r["split"], r["label"]) for r in reviews}
    assert len(reviews) == 200 and len({r["text"] for r in reviews}) == 200 and len(counts) == 4
    assert all(sum(1 for r in reviews if (r["split"], r["label"]) == c) == 50 for c in counts)
    pairs = [json.loads(x) for x in (ROOT / "lab/experiments/data/parallel_en_de_fr.jsonl").read_text().splitlines()]
    assert len(pairs) == 120 and sum(p["split"] == "test" for p in pairs) == 40
    assert all(p["en"] and p["de"] and p["fr"] for p in pairs)


# Whether the tiny model's memory ends up off after 12 rows (and says so) differs between a float32 and a bfloat16
# learning pass (learn_dtype='auto' follows the CPU): this test is about reading the data.
@pytest.mark.filterwarnings("ignore::faast.hf.MemoryOffWarning")
def test_the_experiments_read_datasets_through_the_datasets_library(tmp_path):
    """The --dataset path (hub names such as wikitext, sst2, imdb, iwslt2017) on a local folder of JSON splits."""
    pytest.importorskip("datasets")
    pytest.importorskip("sacrebleu")  # the translation run scores BLEU
    checkpoint = save_tiny_checkpoint("llama", tmp_path / "tiny", PROSE)
    folders = {name: tmp_path / name for name in ("text", "reviews", "pairs")}
    for folder in folders.values():
        folder.mkdir()
    rows = {
        "text": (lambda i: {"text": f" = heading {i} =\n" if i % 3 == 0 else f" a short line number {i} .\n"}),
        "reviews": (lambda i: {"text": f"review {i}", "label": i % 2}),
        "pairs": (lambda i: {"translation": {"en": f"the cat {i}", "fr": f"le chat {i}"}}),
    }
    for name, make in rows.items():
        for split, count in (("train", 12), ("test", 4)):
            lines = [json.dumps(make(i)) for i in range(count)]
            (folders[name] / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    ppl = load_script("lm_ppl").main([
        "--model", checkpoint, "--dataset", str(folders["text"]), "--window", "64", "--methods", "zero-shot,faast",
        "--limit", "10000", "--curve-points", "1", "--results-dir", str(tmp_path),
    ])  # fmt: skip
    # Rows are joined by blank lines into one stream: 12 rows of text make one learned text.
    texts = [make(i)["text"] for make in [rows["text"]] for i in range(12)]
    assert ppl["learn_tokens"] == len("\n\n".join(texts))
    sentiment = load_script("lm_sentiment").main([
        "--model", checkpoint, "--dataset", str(folders["reviews"]), "--shots", "1", "--methods", "faast",
        "--results-dir", str(tmp_path),
    ])  # fmt: skip
    assert sentiment["queries"] == 4 and sentiment["support"] == 12
    translation = load_script("lm_translation").main([
        "--model", checkpoint, "--dataset", str(folders["pairs"]), "--pairs", "fr-en", "--shots", "full",
        "--methods", "faast", "--max-new-tokens", "4", "--results-dir", str(tmp_path),
    ])  # fmt: skip
    assert [r["queries"] for r in translation["rows"]] == [4, 4]
    assert translation["examples"]["fr-en"]["references"][0].startswith("the cat")


def test_local_data_files_name_the_bad_line(tmp_path):
    pytest.importorskip("datasets")
    from faast_lab.experiments import _common

    load_script("lm_sentiment")
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "ok", "label": 1, "split": "train"}) + "\n" + json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected non-empty \['label'\] and split"):
        _common.read_split_jsonl(path, ("text", "label"))


class RecordedLoads:
    """datasets.load_dataset, recording each call's builder and data files."""

    def __init__(self, load_dataset):  # noqa: ANN001
        self.load_dataset, self.calls = load_dataset, []

    def __call__(self, builder, **kwargs):  # noqa: ANN001, ANN003, ANN204
        self.calls.append((builder, list(kwargs["data_files"])))
        return self.load_dataset(builder, **kwargs)


def test_local_files_are_read_through_datasets_load_dataset(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    recorded = RecordedLoads(datasets.load_dataset)
    monkeypatch.setattr(datasets, "load_dataset", recorded)
    load_script("lm_sentiment")
    from faast_lab.experiments import _common

    rows = [{"text": "a [good] film", "label": "positive", "split": "train"},
            {"text": "query", "label": 0, "split": "test", "extra": 1.5},
            {"text": "dull", "label": "negative", "split": "train"}]  # fmt: skip
    path = tmp_path / "rows[1].jsonl"  # glob characters in the name: still this one file
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (tmp_path / "rows1.jsonl").write_text(json.dumps({"text": "other", "label": 1, "split": "train"}) + "\n")
    train, test = _common.read_split_jsonl(path, ("text", "label"))
    assert recorded.calls == [("json", [str(path).replace("[", "[[]")])]
    # Columns are the union over rows (a row without one reads None), so compare the fields each row wrote.
    assert [{k: r[k] for k in rows[0]} for r in train] == [rows[0], rows[2]]
    assert [{k: r[k] for k in rows[1]} for r in test] == [rows[1]] and train[0]["extra"] is None
    # lm_ppl's default data (a stdlib package's source files) goes through the text builder, one row per file, and
    # gives each file's text exactly.
    from faast.hf.demo import domain_files
    from faast.hf.tokens import token_lists

    module = load_script("lm_ppl")
    args = module.parse_args(["--stdlib-package", "json", "--limit", "100000", "--score-limit", "100000"])
    recorded.calls.clear()
    learn, score, _ = module.load_data(args, CharTokenizer())
    learn_files, score_files = domain_files("json")
    assert [(b, len(files)) for b, files in recorded.calls] == [("text", len(learn_files)), ("text", len(score_files))]
    assert learn == token_lists((f.read_text(encoding="utf-8") for f in learn_files), CharTokenizer(), 100000)
    assert score == token_lists((f.read_text(encoding="utf-8") for f in score_files), CharTokenizer(), 100000)


def test_the_experiment_script_prints_its_usage_without_arguments_and_names_an_unknown_experiment():
    import subprocess

    script = ROOT / "scripts" / "experiment.sh"
    bare = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30)
    assert bare.returncode == 2 and bare.stderr.startswith("usage: bash scripts/experiment.sh EXPERIMENT")
    assert "lm_domains, lm_ppl, lm_sentiment, lm_translation" in bare.stderr
    wrong = subprocess.run(["bash", str(script), "lm_nope"], capture_output=True, text=True, timeout=30)
    assert wrong.returncode == 2 and "unknown experiment 'lm_nope'" in wrong.stderr and "usage:" in wrong.stderr


def _domain(name, zero, faast, lora, knn, curve, sizes, faast_s=10.0, lora_s=30.0, best=None, at_time=None,
            fp32_s=12.0, solve_s=(0.5, 0.8, 1.0), int8_s=11.0, int8_pass_s=9.0):  # fmt: skip
    """One domain's rows and curves as lm_domains.py records them; best / at_time: LoRA-best's and LoRA at FAAST's
    time's perplexity (default: a little above FAAST's)."""
    best = faast * 1.02 if best is None else best
    at_time = faast * 1.05 if at_time is None else at_time
    rows = [("zero-shot", zero, 0.0), ("FAAST: middle layers + residual output", zero, faast_s),
            ("FAAST: residual output only", faast, faast_s),
            ("FAAST: residual output only, float32 learning pass", faast, fp32_s),
            ("kNN-LM (k=1024, λ=0.25)", knn, 5.0), ("LoRA (peft, r=35, 1 epoch)", lora, lora_s),
            ("linear (backprop, 6 layers, 1 epoch)", lora, lora_s),
            ("LoRA-best (peft, r=35, lr=0.003, 2 epochs, tuned on the held-out tail)", best, 2 * lora_s),
            ("LoRA at FAAST's time (peft, r=35, lr=0.003, 7 steps)", at_time, faast_s),
            ("FAAST: residual output only, float32 learning pass, int8 head logits", faast, int8_s),
            ("FAAST: residual output only, int8 learning pass and head logits", faast, int8_pass_s)]  # fmt: skip
    rows = [{"method": m, "ppl": p, "learn_s": s, "score_s": 1.0, "memory_bytes": 1 << 20,
             "reduction": 1 - p / zero} for m, p, s in rows]  # fmt: skip
    rows[7]["tuning_s"] = 77.0
    faast_curve = {"tokens": [2048, 8192, 32768], "ppl": curve, "bytes": sizes, "step": [0.1] * 3,
                   "solve_s": list(solve_s)}  # fmt: skip
    return {"domain": name, "learned_tokens": 32768, "scored_tokens": 8192, "rows": rows,
            "curve": {"output": faast_curve, "full": {**faast_curve, "ppl": [zero] * 3}}}  # fmt: skip


NEW_GOALS = ("beats LoRA at FAAST's time on every domain", "≥ 90% of LoRA-best's mean reduction",
             "stretch: ≥ 100% of LoRA-best's mean reduction", "never hurts: perplexity ≤ zero-shot × 1.003 at every"
             " point", "perplexity falls at every step 2K → 32K", "float32-learn learn time ≤ ½ the 1-epoch LoRA's",
             "float32 pass, int8 head logits: learn time ≤ ½ the 1-epoch LoRA's",
             "int8 pass and head logits: learn time ≤ ½ the 1-epoch LoRA's", "last solve ≤ 5 s")  # fmt: skip


def _load_report():  # noqa: ANN202 - the experiment's module
    """lab/experiments/lm_domains_report.py, the report of lm_domains."""
    return load_script("lm_domains_report")


def test_the_multi_domain_report_judges_every_goal_from_the_rows_and_can_fail(tmp_path):
    report = _load_report()
    header = {"git_sha": "x", "torch": "t", "cpu_model": "c", "torch_threads": 2, "loadavg_at_start": [0, 0, 0],
              "command": "python lm_domains.py"}  # fmt: skip
    variants = {"full": "FAAST: middle layers + residual output", "output": "FAAST: residual output only"}
    good = {
        "model": "m",
        "header": header,
        "variants": variants,
        "default_variant": "output",
        "domains": [
            _domain("a", 10.0, 8.8, 8.0, 9.5, [9.5, 9.0, 8.8], [5] * 3),  # FAAST -12%, LoRA -20%
            _domain("b", 20.0, 18.0, 17.0, 21.0, [19.5, 18.5, 18.0], [5] * 3),
        ],
    }  # FAAST -10%, LoRA -15%
    goals = {g[0]: g for g in report.goals(good, report.averages(good))}
    share = (0.12 + 0.10) / (0.20 + 0.15)
    assert goals["≥ 60% of LoRA's mean perplexity reduction"][1].startswith(f"{100 * share:.0f}%")
    assert set(NEW_GOALS) <= set(goals) and all(g[2] == "yes" for g in goals.values()), goals
    assert goals["beats LoRA at FAAST's time on every domain"][1].startswith("2 / 2 domains")
    assert goals["last solve ≤ 5 s"][1] == "max 1.00 s (a)"
    assert goals["float32-learn learn time ≤ ½ the 1-epoch LoRA's"][1].startswith("0.40×")
    assert goals["float32 pass, int8 head logits: learn time ≤ ½ the 1-epoch LoRA's"][1].startswith("0.37×")
    assert goals["int8 pass and head logits: learn time ≤ ½ the 1-epoch LoRA's"][1].startswith("0.30×")
    bad = {"model": "m", "header": header, "variants": variants, "default_variant": "output", "domains": [
        _domain("a", 10.0, 9.8, 8.0, 9.0, [9.7, 10.1, 9.8], [5, 6, 7], faast_s=20.0, lora_s=30.0, best=8.0,
                at_time=9.7, fp32_s=16.0, solve_s=(1.0, 1.0, 5.5), int8_s=16.0, int8_pass_s=15.5)]}  # fmt: skip
    goals = {g[0]: g for g in report.goals(bad, report.averages(bad))}
    assert all(g[2] == "**no**" for g in goals.values()), goals
    assert goals["never hurts: perplexity ≤ zero-shot × 1.003 at every point"][1] == "worst +1.00% (a, 8,192 tokens)"
    # Each goal fails alone: FAAST a hair above zero-shot at one point, one domain lost to LoRA at FAAST's time.
    close = {
        **good,
        "domains": [
            _domain("a", 10.0, 8.8, 8.0, 9.5, [10.04, 9.0, 8.8], [5] * 3),
            _domain("b", 20.0, 18.0, 17.0, 21.0, [19.5, 18.5, 18.0], [5] * 3, at_time=17.9),
        ],
    }
    goals = {g[0]: g for g in report.goals(close, report.averages(close))}
    assert [k for k, g in goals.items() if g[2] != "yes"] == [
        "beats LoRA at FAAST's time on every domain",
        "never hurts: perplexity ≤ zero-shot × 1.003 at every point",
    ]
    # Missing rows are "not run", never met; missing in some domains only, the goal is not met either.
    drop = (
        "LoRA-best",
        "LoRA at FAAST's time",
        "FAAST: residual output only, float32",
        "FAAST: residual output only, int8",
    )
    bare = {**good, "domains": [{**d, "rows": [r for r in d["rows"] if not r["method"].startswith(drop)],
                                 "curve": {k: {**c, "solve_s": []} for k, c in d["curve"].items()}}
                                for d in good["domains"]]}  # fmt: skip
    goals = {g[0]: g for g in report.goals(bare, report.averages(bare))}
    not_run = [k for k in NEW_GOALS if k not in ("never hurts: perplexity ≤ zero-shot × 1.003 at every point",
                                                 "perplexity falls at every step 2K → 32K")]  # fmt: skip
    assert all(goals[k][2] == "not run" and goals[k][1].startswith("not run: no ") for k in not_run), goals
    partial = {**good, "domains": [good["domains"][0], bare["domains"][1]]}
    goals = {g[0]: g for g in report.goals(partial, report.averages(partial))}
    assert goals["beats LoRA at FAAST's time on every domain"][1:] == [
        "1 / 2 domains (closest: a, 8.800 vs 9.240); not run on b",
        "**no**",
    ]
    assert goals["≥ 90% of LoRA-best's mean reduction"][2] == "not run"  # the mean needs every domain
    # The other variant (no gain at all here) is judged when it is the default.
    goals = {g[0]: g for g in report.goals({**good, "default_variant": "full"}, report.averages(good))}
    assert goals["≥ 8% absolute mean reduction"][1:] == ["0.0%", "**no**"]
    report.write_report(good, tmp_path / "r")
    text = (tmp_path / "r.md").read_text()
    assert "## Goals (averages over the domains; default: FAAST: residual output only)" in text
    assert "## a: learned 32,768 tokens" in text and "FAAST: residual output only against tokens" in text
    assert "| learn s | tuning s | score s |" in text and "| 60.0 | 77.0 | 1.0 |" in text
    # A run with benchmark and extra domains averages each group apart as well.
    named = {**good, "domains": [{**good["domains"][0], "domain": "asyncio"}, {**good["domains"][1],
                                                                               "domain": "changelog"}]}  # fmt: skip
    text = "\n".join(report.report(named))
    assert "## Averages over all 2 domains" in text and "## Averages over the benchmark domains: asyncio" in text
    assert "## Averages over the extra domains (chosen after the settings): changelog" in text


def test_a_run_of_the_float32_row_alone_judges_it_and_not_as_the_default():
    """--methods fp32learn,lora: the float32 row is judged against LoRA, and the default's goals are "not run" (its
    name extends the default's: it must not stand in for it)."""
    report = _load_report()
    fp32 = "FAAST: residual output only, float32 learning pass"
    variants = {"output": "FAAST: residual output only", "fp32learn": fp32}
    domains = [_domain(n, 10.0, 8.8, 8.0, 9.5, [9.5, 9.0, 8.8], [5] * 3, fp32_s=12.0, lora_s=30.0) for n in "ab"]
    for d in domains:
        d["rows"] = [r for r in d["rows"] if r["method"] in ("zero-shot", fp32) or r["method"].startswith("LoRA (")]
        del d["curve"]["output"]
    payload = {"model": "m", "header": {}, "variants": variants, "default_variant": "output", "domains": domains}
    goals = {g[0]: g for g in report.goals(payload, report.averages(payload))}
    assert goals["float32-learn learn time ≤ ½ the 1-epoch LoRA's"][1:] == ["0.40× (12 s vs 30 s)", "yes"]
    assert goals["≥ 60% of LoRA's mean perplexity reduction"][2] == "not run"
    assert goals["learn time ≤ ½ LoRA's"][2] == "not run"


def _default_alone(variants: dict, learn_pass: str, head: str, faast_s: float = 14.0) -> tuple[list, dict]:
    """(domains, payload) of two domains with only zero-shot, the default row (which learned in `learn_pass` with
    `head` head products) and one LoRA epoch (30 s), for the report's goals with `variants`."""
    default = variants["output"]
    domains = [_domain(n, 10.0, 8.8, 8.0, 9.5, [9.5, 9.0, 8.8], [5] * 3, faast_s=faast_s, lora_s=30.0) for n in "ab"]
    for d in domains:
        d["rows"] = [r for r in d["rows"] if r["method"] in ("zero-shot", default) or r["method"].startswith("LoRA (")]
        d["rows"][1]["precision"] = {"learn_pass": learn_pass, "head_products": head, "native_bf16": False}
    return domains, {"model": "m", "header": {}, "variants": variants, "default_variant": "output", "domains": domains}


def test_without_a_float32_row_the_default_stands_for_it_only_where_it_learned_in_float32():
    """A run on a CPU without native bfloat16 (--methods default,lora): the default's recorded precision is float32
    in every domain, so the float32 goal is judged on it; bfloat16 in one domain, and the goal is "not run"."""
    report = _load_report()
    default = "FAAST: residual output only"
    variants = {"output": default, "fp32learn": "FAAST: residual output only, float32 learning pass"}
    domains, payload = _default_alone(variants, "float32", "float32")
    goal = "float32-learn learn time ≤ ½ the 1-epoch LoRA's"
    judged = {g[0]: g for g in report.goals(payload, report.averages(payload))}[goal]
    assert judged[1:] == ["0.47× (14 s vs 30 s); the default row, which learned in float32 in every domain", "yes"]
    domains[1]["rows"][1]["precision"] = {"learn_pass": "bfloat16", "head_products": "bfloat16", "native_bf16": True}
    assert {g[0]: g for g in report.goals(payload, report.averages(payload))}[goal][2] == "not run"


def test_without_an_int8_row_the_default_stands_for_it_only_where_it_learned_with_int8_head_logits():
    """On a CPU without native bfloat16 but with AVX2 the default learns in float32 with int8 head logits: the int8
    goal is judged on it, and the float32 one (float32 head products) is not."""
    report = _load_report()
    default = "FAAST: residual output only"
    variants = {"output": default, "fp32learn": "FAAST: residual output only, float32 learning pass",
                "int8learn": "FAAST: residual output only, float32 learning pass, int8 head logits"}  # fmt: skip
    _, payload = _default_alone(variants, "float32", "int8")
    goals = {g[0]: g for g in report.goals(payload, report.averages(payload))}
    assert goals["float32 pass, int8 head logits: learn time ≤ ½ the 1-epoch LoRA's"][1:] == [
        "0.47× (14 s vs 30 s); the default row, which learned in float32 with int8 head logits in every domain",
        "yes",
    ]
    assert goals["float32-learn learn time ≤ ½ the 1-epoch LoRA's"][2] == "not run"


def test_without_an_int8_pass_row_the_default_stands_for_it_only_where_it_learned_with_the_int8_pass():
    """On a CPU without native bfloat16 but with AVX2 the default now learns with the decoder's linears and the
    head's logits in int8: the int8-pass goal is judged on it, and the int8-head one (float32 pass) is not."""
    report = _load_report()
    default = "FAAST: residual output only"
    variants = {"output": default, "int8learn": "FAAST: residual output only, float32 learning pass, int8 head logits",
                "int8pass": "FAAST: residual output only, int8 learning pass and head logits"}  # fmt: skip
    domains, payload = _default_alone(variants, "int8", "int8", faast_s=9.0)
    goal = "int8 pass and head logits: learn time ≤ ½ the 1-epoch LoRA's"
    goals = {g[0]: g for g in report.goals(payload, report.averages(payload))}
    assert goals[goal][1:] == [
        "0.30× (9 s vs 30 s); the default row, which learned with the int8 pass and head logits in every domain",
        "yes",
    ]
    assert goals["float32 pass, int8 head logits: learn time ≤ ½ the 1-epoch LoRA's"][2] == "not run"
    domains[1]["rows"][1]["precision"] = {"learn_pass": "float32", "head_products": "int8", "native_bf16": False}
    assert {g[0]: g for g in report.goals(payload, report.averages(payload))}[goal][2] == "not run"


def test_a_peer_that_gains_nothing_on_average_has_no_share_and_the_share_goals_read_from_the_reductions():
    """LoRA-best above zero-shot on average (as tuning on a misleading tail can leave it): no share is printed (no
    nan), a FAAST gain meets the goal, and a FAAST loss larger than least × the peer's does not."""
    report = _load_report()
    variants = {"output": "FAAST: residual output only"}

    def goals(faast: float, best: float) -> dict:
        domains = [_domain(n, 10.0, faast, 8.0, 9.5, [9.9, 9.8, faast], [5] * 3, best=best) for n in "ab"]
        payload = {"model": "m", "header": {}, "variants": variants, "default_variant": "output", "domains": domains}
        return {g[0]: g for g in report.goals(payload, report.averages(payload))}

    worse = goals(9.5, 11.0)  # FAAST −5%, LoRA-best +10%
    assert worse["≥ 90% of LoRA-best's mean reduction"][1:] == [
        "no share: the peer gains nothing (5.0% vs -10.0%)",
        "yes",
    ]
    assert worse["stretch: ≥ 100% of LoRA-best's mean reduction"][2] == "yes"
    lost = goals(10.95, 11.0)  # FAAST loses 9.5%: more than 0.9 × the peer's 10% loss, less than 1.0 × it
    assert lost["≥ 90% of LoRA-best's mean reduction"][2] == "**no**"
    assert lost["stretch: ≥ 100% of LoRA-best's mean reduction"][2] == "yes"
    assert goals(9.0, 8.0)["≥ 90% of LoRA-best's mean reduction"][1:] == ["50% (10.0% vs 20.0%)", "**no**"]


def test_a_resumed_multi_domain_run_keeps_each_domains_machine_and_the_report_names_it(tmp_path, monkeypatch):
    """--resume on another CPU (a name no real machine has, so this one always differs from it): the kept domain
    carries the earlier run's machine, a domain run now carries this run's, and the report names both (times compare
    within a domain only); one machine for all: no such line."""
    module = load_script("lm_domains")
    monkeypatch.setattr(module, "run_domain", lambda name, *rest: _domain(name, 10.0, 8.8, 8.0, 9.5, [9.5, 9.0, 8.8],
                                                                          [5] * 3))  # fmt: skip
    earlier = {"model": "t", "provenance": {"date": "d0", "git_sha": "abcdef0123", "git_dirty": False,
                                            "cpu_model": "Example CPU", "cpu_native_bf16": False},
               "variants": {"full": "FAAST: middle layers + residual output", "output": "FAAST: residual output only"},
               "default_variant": "output",
               "domains": [_domain("asyncio", 10.0, 8.8, 8.0, 9.5, [9.5, 9.0, 8.8], [5] * 3)]}  # fmt: skip
    (tmp_path / "d.json").write_text(json.dumps(earlier), encoding="utf-8")
    payload = module.main(["--domains", "asyncio", "info", "--methods", "default", "--resume", "--results-dir",
                           str(tmp_path), "--out", "d"], load_model=tiny_loader())  # fmt: skip
    kept, new = payload["domains"]
    assert kept["domain"] == "asyncio" and kept["measured_by"]["cpu_model"] == "Example CPU"
    assert kept["measured_by"]["git_sha"] == "abcdef0123" and kept["measured_by"]["cpu_native_bf16"] is False
    assert new["domain"] == "info" and new["measured_by"]["git_sha"] == payload["provenance"]["git_sha"]
    assert new["measured_by"]["cpu_model"] == payload["provenance"]["cpu_model"]
    assert json.loads((tmp_path / "d.json").read_text(encoding="utf-8"))["domains"][0]["measured_by"]["date"] == "d0"
    text = (tmp_path / "d.md").read_text(encoding="utf-8")
    assert "Measured by the run of d0 at abcdef0 on Example CPU (no native bfloat16)" in text
    assert text.count("Measured by the run of") == 2
    report = sys.modules["faast_lab.experiments.lm_domains_report"]
    same = {**payload, "domains": [{**d, "measured_by": kept["measured_by"]} for d in payload["domains"]]}
    assert not any(line.startswith("Measured by") for line in report.report(same))
    # Seconds from two CPUs do not add up: the time goals take the per-domain ratios (FAAST 10 s against LoRA 30 s
    # in the kept domain, 20 s against 100 s in the new one: 0.27× on the mean, not 30 / 130 = 0.23×).
    slow = _domain("info", 10.0, 8.8, 8.0, 9.5, [9.5, 9.0, 8.8], [5] * 3, faast_s=20.0, lora_s=100.0)
    mixed = {**payload, "domains": [kept, {**slow, "measured_by": new["measured_by"]}]}
    goals = {g[0]: g for g in report.goals(mixed, report.averages(mixed))}
    assert goals["learn time ≤ ½ LoRA's"][1].startswith("0.27× (mean of the per-domain ratios")
    assert "largest 0.33×, asyncio on Example CPU, no native bfloat16)" in goals["learn time ≤ ½ LoRA's"][1]
    assert goals["last solve ≤ 5 s"][1] == "max 1.00 s (asyncio, on Example CPU, no native bfloat16)"
    machines = "The domains were measured on different CPUs (asyncio on Example CPU, no native bfloat16; info on "
    assert machines in "\n".join(report.report(mixed))
    one = {**mixed, "domains": [{k: v for k, v in kept.items() if k != "measured_by"}, slow]}
    goals = {g[0]: g for g in report.goals(one, report.averages(one))}
    assert goals["learn time ≤ ½ LoRA's"][1] == "0.23× (15 s vs 65 s)"  # one run (no record): the ratio of means


def _made_up_domain(module, monkeypatch, seed: int, texts: int) -> list[str]:  # noqa: ANN001
    """lm_domains on made-up text (the script's domain files patched: `texts` learned texts of 150 words, two held-out
    ones of 60, drawn with `seed`), for a main given tiny_loader(): returns the learned texts."""
    words = random.Random(seed)

    def make(n: int) -> str:
        return " ".join(words.choice(["alpha", "beta = gamma", "delta", "omega"]) for _ in range(n))

    learn, score = [make(150) for _ in range(texts)], [make(60) for _ in range(2)]
    monkeypatch.setattr(module, "domain_texts", lambda name: (learn, score))
    return learn


def test_the_multi_domain_benchmark_tunes_its_peers_on_faasts_held_out_tail_end_to_end(tmp_path, monkeypatch):
    """lm_domains.main on a tiny Llama (its load_model) and made-up text (the domain's files patched): every method
    but the linear projection (its layers are SmolLM2's), with the tuned peers on FAAST's own held-out tail."""
    pytest.importorskip("peft")
    import dataclasses

    module = load_script("lm_domains")
    args = module.parse_args([])
    assert args.domains == ["asyncio", "man", "copyright", "perl", "tkinter", "changelog", "info"]
    assert {"fp32learn", "int8learn", "int8pass", "knn_tuned", "lora_best", "lora_time"} <= set(args.methods)
    with pytest.raises(SystemExit):
        module.parse_args(["--methods", "lora,lora_time"])  # LoRA at FAAST's time needs FAAST's time
    learn = _made_up_domain(module, monkeypatch, seed=0, texts=5)
    methods = "default,fp32learn,int8learn,int8pass,knn,knn_tuned,lora,lora_best,lora_time"
    payload = module.main([
        "--domains", "info", "--methods", methods, "--learn-tokens", "3000", "--score-tokens", "400", "--window", "64",
        "--train-window", "32", "--lora-lrs", "1e-3,1e-2", "--lora-max-epochs", "2", "--knn-k", "16",
        "--knn-lams", "0.1,0.5", "--knn-temperatures", "1,10", "--results-dir", str(tmp_path), "--out", "d",
    ], load_model=tiny_loader())  # fmt: skip
    rows = {r["method"].split(" (")[0]: r for r in payload["domains"][0]["rows"]}
    fp32 = "FAAST: residual output only, float32 learning pass and head products"
    int8 = "FAAST: residual output only, float32 learning pass, int8 head logits"
    int8_pass = "FAAST: residual output only, int8 learning pass and head logits"
    assert list(rows) == ["zero-shot", "FAAST: residual output only", fp32, int8, int8_pass, "kNN-LM", "kNN-LM tuned",
                          "LoRA", "LoRA-best", "LoRA at FAAST's time"]  # fmt: skip
    # The float32 rows run what a CPU without native bfloat16 runs (without AVX2, and with it), whatever this CPU
    # does; the default follows one of them.
    assert rows[fp32]["precision"]["learn_pass"] == rows[fp32]["precision"]["head_products"] == "float32"
    assert (rows[int8]["precision"]["learn_pass"], rows[int8]["precision"]["head_products"]) == ("float32", "int8")
    assert (rows[int8_pass]["precision"]["learn_pass"], rows[int8_pass]["precision"]["head_products"]) == (
        "int8",
        "int8",
    )
    native = rows[fp32]["precision"]["native_bf16"]
    # 'auto' on a CPU is measured; the suite turns measuring off, so it takes the first modes: float32, exact p·H.
    assert rows[fp32]["precision"]["head_pool_below"] == rows[int8]["precision"]["head_pool_below"] == 0.0
    assert rows["FAAST: residual output only"]["precision"] == {
        "learn_pass": "float32",
        "head_products": "float32",
        "head_pool_below": 0.0,
        "native_bf16": native,
    }
    # The peers tuned on exactly the positions FAAST tuned its step on, and fitted on what it fitted on.
    faast_tuning, best, knn = rows["FAAST: residual output only"]["tuning"], rows["LoRA-best"], rows["kNN-LM tuned"]
    assert faast_tuning["tuned"] and faast_tuning["held_out_tokens"] == best["tuned"]["held_tokens"]
    # The curve's 2K cut falls inside a text, whose rest the next part continues: one text to FAAST's tuning.
    from faast.hf.tokens import token_lists

    texts = token_lists(learn, CharTokenizer(), 3000)
    ends = [sum(len(t) for t in texts[: i + 1]) for i in range(len(texts))]
    assert 2048 < ends[-1] and 2048 not in ends  # cut inside a text: as parts, one text more
    assert faast_tuning["held_out_documents"] == len(texts)
    assert best["tuned"]["fit_tokens"] == faast_tuning["fitted_tokens"] == knn["tuned"]["fit_tokens"]
    assert knn["tuned"]["held_tokens"] == faast_tuning["held_out_tokens"]
    assert len(best["grid"]) == 4 and len(knn["grid"]) == 4 and best["tuning_s"] > 0 and knn["tuning_s"] > 0
    assert best["method"].startswith(f"LoRA-best (peft, r={best['tuned']['rank']}, lr={best['tuned']['lr']:g}, ")
    assert knn["method"] == f"kNN-LM tuned (k=16, λ={knn['tuned']['lam']:g}, T={knn['tuned']['temperature']:g})"
    # LoRA at FAAST's time: LoRA-best's lr, for the learn + solve seconds the default row measured.
    timed = rows["LoRA at FAAST's time"]
    assert timed["budget_s"] == rows["FAAST: residual output only"]["learn_s"] and timed["lr_from"] == "LoRA-best"
    assert f"lr={best['tuned']['lr']:g}, {timed['steps']} steps)" in timed["method"] and timed["steps"] >= 1
    text = (tmp_path / "d.md").read_text(encoding="utf-8")
    goals = text.split("## Goals")[1].split("## Averages")[0]
    assert "beats LoRA at FAAST's time on every domain" in goals and "not run" not in goals  # every goal judged
    # On another machine, without LoRA-best's tuning: its row is imported, and LoRA at FAAST's time takes its lr.
    other = "1e-2" if best["tuned"]["lr"] == 1e-3 else "1e-3"  # --lora-lr, which must not be used
    again = module.main([
        "--domains", "info", "--methods", "default,lora_time", "--learn-tokens", "3000", "--score-tokens", "400",
        "--window", "64", "--train-window", "32", "--lora-lr", other, "--baselines-from", str(tmp_path / "d.json"),
        "--results-dir", str(tmp_path), "--out", "e",
    ], load_model=tiny_loader())  # fmt: skip
    rows_again = {r["method"].split(" (")[0]: r for r in again["domains"][0]["rows"]}
    assert all(rows_again[m]["imported_from"]["file"] == "d.json" for m in ("LoRA", "LoRA-best", "kNN-LM tuned"))
    timed_again = rows_again["LoRA at FAAST's time"]
    assert timed_again["lr_from"] == "LoRA-best, imported from d.json" and "imported_from" not in timed_again
    assert f"lr={best['tuned']['lr']:g}, " in timed_again["method"]
    assert timed_again["budget_s"] == rows_again["FAAST: residual output only"]["learn_s"]
    # What solve() returns goes in the row when it is a report, not the model itself.
    assert module.solve_report(module, module) is None and module.solve_report({"off": True}, module) == {"off": True}
    report = dataclasses.make_dataclass("Report", [("off", bool), ("parts", list)])(False, [1])
    assert module.solve_report(report, module) == {"off": False, "parts": [1]}


def _variants_layer(positions: int):  # noqa: ANN202 - (the script, its head, a layer that learned, its keys)
    """lm_output_variants' layer on an 8 → 11 head after learning `positions` random keys as one document."""
    variants = load_script("lm_output_variants")
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False)
    layer = variants.layer_for(head, 8, 11)
    keys, targets = torch.randn(positions, 8), torch.randint(0, 11, (positions,))
    variants.feed(layer, keys, targets, [0])
    return variants, head, layer, keys


def test_output_variants_space_uses_that_space_default_and_restores_the_layer():
    # lm_output_variants scores the logit-space rule on the layer the shipped rule uses: with too few positions to
    # tune, it must read at logit space's own default step, and leave the shipped layer's settings as they were.
    from faast.hf import OutputPolicy

    logit, probability = OutputPolicy().default_step_logit, OutputPolicy().default_step_probability
    # Past the untuned step's ramp (default_step_per_dim positions per dimension of the 8-wide keys), still too few
    # positions to tune on.
    positions = int(OutputPolicy().default_step_per_dim * 8) + 4
    variants, head, layer, _ = _variants_layer(positions)
    assert layer.untuned_step() == layer.default_step and not layer.held_out_positions()
    before = layer.space, layer.weight, layer.default_step
    m, step, weight = variants.VARIANTS["logit"](layer, None)
    assert step == logit and weight == 1.0
    assert (layer.space, layer.weight, layer.default_step) == before
    m_shipped, step_shipped, weight_shipped = variants.shipped(layer, None)
    assert step_shipped == probability and weight_shipped == layer.weight
    torch.testing.assert_close(m, m_shipped * logit / probability)


def test_output_variants_leverage_is_the_float64_hand_computation_and_gates_per_position():
    variants, head, layer, keys = _variants_layer(60)
    query, ys = torch.randn(7, 8), torch.randint(0, 11, (7,))
    # By hand: C = Σ k kᵀ / N over the learned keys, r = qᵀ(C + μ·mean eig(C)·I)⁻¹q / d.
    c = keys.double().T @ keys.double() / 60
    shift = variants.LEVERAGE_RIDGE * torch.linalg.eigvalsh(c).clamp_min(0).mean()
    inverse = torch.linalg.inv(c + shift * torch.eye(8, dtype=torch.float64))
    expected = ((query.double() @ inverse) * query.double()).sum(-1) / 8
    torch.testing.assert_close(variants.relative_leverage(layer, query), expected, rtol=1e-9, atol=0)
    scorer = variants.Scorer(head, query, ys)
    m = 0.1 * torch.randn(8, 8)
    # One λ for every position is the scalar mixture; λ = 0 everywhere is the frozen model.
    assert scorer.nll(m, torch.full((7,), 0.3)) == pytest.approx(scorer.nll(m, 0.3), rel=1e-6)
    torch.testing.assert_close(scorer.token_nll(m, torch.zeros(7)), scorer.base_tokens.double())
    m_shipped, _, lam = variants.shipped(layer, scorer)
    _, _, flat = variants.leverage_gate(0.0)(layer, scorer)
    assert torch.equal(flat, torch.full((7,), lam, dtype=flat.dtype))
    _, _, gated = variants.leverage_gate(1.0)(layer, scorer)
    r = variants.relative_leverage(layer, query)
    torch.testing.assert_close(gated, (lam * r.pow(-1.0).clamp_max(1.0)).clamp(0, 0.95))
    variants.leverage_bins(layer, scorer, bins=3)
    bins = scorer.extra["bins"]
    assert [b[2] for b in bins] == [3, 2, 2] and bins[0][0] <= bins[1][0] <= bins[2][0]
    gain = scorer.base_tokens.double() - scorer.token_nll(m_shipped, lam)
    assert sum(b[1] * b[2] for b in bins) == pytest.approx(float(gain.sum()), rel=1e-9, abs=1e-12)


def test_the_step_probe_learns_the_longest_files_in_their_order_with_longest():
    module = load_script("lm_step_probe")
    assert module.longest_texts(["aa", "b", "cccc", "dd", "eee"], 3) == ["aa", "cccc", "eee"]  # ties: the earlier
    assert module.longest_texts(["aa", "b", "cccc", "dd", "eee"], 2) == ["cccc", "eee"]
    assert module.longest_texts(["a", "b"], 5) == ["a", "b"]


def test_the_step_probe_rebuilds_the_models_read_and_leaves_the_layer_as_shipped(tmp_path, monkeypatch):
    """lm_step_probe.main on a tiny Llama and made-up text: at every point the perplexity rebuilt from the kept states
    equals the model's own read (and evaluate.perplexity), the curve's ×1 point and the untuned default pair are that
    read, the oracle is no worse than any step on the curve; gap_steps restores the shipped gap and step. The read is
    the model's learning the curve's parts as the benchmark does (a cut text continued) with --key-layers' keys."""
    from faast.hf import FaastConfig, OutputPolicy, ResidualOutput, apply_faast
    from faast.hf.evaluate import token_windows
    from faast.hf.tokens import split_continuing, token_lists

    module = load_script("lm_step_probe")
    base = tiny_model("llama")
    words = random.Random(1)

    def make(n: int) -> str:
        return " ".join(words.choice(["alpha", "beta = gamma", "delta", "omega"]) for _ in range(n))

    learn, score = [make(150) for _ in range(5)], [make(60) for _ in range(2)]
    monkeypatch.setattr(module, "domain_texts", lambda name: (learn, score))
    argv = ["--domains", "info", "--curve", "300,3000", "--learn-tokens", "3000", "--score-tokens", "400", "--window",
            "64", "--learn-window", "32", "--pairs", "--w-grid", "--key-layers", "0,1", "--results-dir", str(tmp_path),
            "--out", "p"]  # fmt: skip
    payload = module.main(argv, load_model=tiny_loader(base))
    rows = payload["rows"]
    assert [r["tokens"] for r in rows] == [300, 3000] and not rows[0]["tuned"] and rows[1]["tuned"]
    for r in rows:
        assert r["ppl_reconstructed"] == pytest.approx(r["ppl_read"], rel=1e-5)
        factor_one = module.CURVE_STEPS.index(1.0)
        assert r["curve"][factor_one][1] == pytest.approx(r["ppl_read"], rel=1e-5)
        assert r["oracle_ppl"] <= min(p for _, p in r["curve"]) + 1e-9
        assert r["gap_steps"]["2"]["step"] == pytest.approx(r["tuned_step"], rel=1e-9)
    # --w-grid: the shipped W (δ 1, α 1) is the layer's own tuning and read; the others are solved and tuned apart
    assert "w_variants" not in rows[0]
    variants = {(v["damping"], v["alpha"]): v for v in rows[1]["w_variants"]}
    assert len(variants) == len(module.W_DAMPINGS) * len(module.W_ALPHAS)
    assert variants[1.0, 1.0]["step"] == pytest.approx(rows[1]["tuned_step"], rel=1e-9)
    assert variants[1.0, 1.0]["ppl"] == pytest.approx(rows[1]["ppl_read"], rel=1e-5)
    assert len({round(variants[d, 1.0]["step"], 9) for d in module.W_DAMPINGS}) == len(module.W_DAMPINGS)
    assert all(v["oracle_ppl"] <= v["ppl"] + 1e-9 for v in variants.values() if v["oracle_ppl"] is not None)
    assert "## Differently regularised W" in (tmp_path / "p.md").read_text(encoding="utf-8")
    default = [p for e, w, p in rows[0]["pairs"] if e == 0.03 and w == 0.5]
    assert default == [pytest.approx(rows[0]["ppl_read"], rel=1e-5)] and "pairs" not in rows[1]
    assert "## Untuned (300 tokens learned)" in (tmp_path / "p.md").read_text(encoding="utf-8")
    # The read is the model's: evaluate.perplexity over the windows the probe read gives the same number.
    model = apply_faast(base, FaastConfig(output=ResidualOutput(key_layers=[0, 1])))
    try:
        texts = token_lists(learn, CharTokenizer(), 3000)
        parts = split_continuing(texts, [300, 3000])
        assert [c for _, c in parts] == [False, True]  # the 300th token cuts a text: the second part continues it
        for part, continues in parts:
            model.learn(part, max_length=32, batch_size=8, continues=continues)
            model.solve()
        assert model.output_memory_layer.memory.dim_key == 3 * base.config.hidden_size  # [h̃; x̂₀; x̂₁]
        scored = [w for t in token_lists(score, CharTokenizer(), 400) for w in token_windows(t, 64)]
        assert perplexity(model, scored, batch_size=1).ppl == pytest.approx(rows[1]["ppl_read"], rel=1e-5)
        layer = model.output_memory_layer
        shipped = layer.chosen_step()
        steps = module.gap_steps(layer)
        assert layer.policy == OutputPolicy() and layer.chosen_step() == shipped == steps["2"]["step"]
        assert steps["0"]["fitted_tokens"] > steps["2"]["fitted_tokens"]  # no gap: more of the text is fitted
        memory_alpha, damping = layer.memory.alpha, layer.damping
        module.w_variants(layer, module.read_states(model, scored[:1]))
        assert (layer.memory.alpha, layer.damping) == (memory_alpha, damping) and layer.chosen_step() == shipped
    finally:
        model.remove_faast()


def test_the_step_probes_bias_corrections_are_the_float64_hand_computation():
    """lm_step_probe --bias on a tiny Llama: learned_sums adds up the learned keys and targets; the bias alone is the
    Newton step on the mean gradient, and the intercept regression is the fit on centred keys with its bias, both
    against float64 from the final states; bias_variants' oracles are no worse than the read at the tuned step."""
    from faast.hf import FaastConfig, ResidualOutput, apply_faast
    from faast.hf.output import tuning
    from test_hf_residual import ids, newton, reference_statistics
    from tolerances import STEP_SEARCH_REL, TRUTH_REL_W, assert_close, rel

    module = load_script("lm_step_probe")
    # float32 throughout (not bfloat16 where the CPU multiplies it natively): the hand computation's precision
    output = ResidualOutput(key_layers=[], tune_tokens=4096, head_dtype="float32", bias=0.0)  # the probe's setting
    model = apply_faast(tiny_model("llama"), FaastConfig(output=output, learn_dtype="model"))
    layer = model.output_memory_layer
    sums = module.learned_sums(layer)
    try:
        x = ids(batch=8, seq=100, period=23)
        model.learn(x)
        assert layer.chosen_step() > 0 and layer.chosen_key_width() == layer.hidden_size
        k, y, s, t, mu_gram, mass = reference_statistics(model, x, torch.ones_like(x, dtype=torch.bool))
        assert_close(sums["keys"], k.sum(0), torch.float32)
        assert torch.equal(sums["targets"], torch.bincount(y, minlength=VOCAB).double())
        b, w, c = module.bias_corrections(layer, sums)
        head = model.base_model.get_output_embeddings().weight.double()
        n = k.shape[0]
        curvature = (head.T * mass) @ head - mu_gram
        curvature = curvature / n + layer.damping * (curvature / n).diagonal().mean() * torch.eye(head.shape[1])
        r_mean = (head[y] - torch.softmax(k @ head.T, -1) @ head).mean(0)
        assert_close(b, torch.linalg.solve(curvature.double(), r_mean), torch.float32)
        k_mean = k.mean(0)
        w_ref = newton(s - n * torch.outer(k_mean, k_mean), t - n * torch.outer(k_mean, r_mean), n, mu_gram, mass,
                       head, damping=layer.damping)  # fmt: skip
        # the centred statistics cancel: a solution's tolerance against the float64 truth, not an elementwise one
        assert rel(w, w_ref) < TRUTH_REL_W and rel(c, b - k_mean @ w_ref) < TRUTH_REL_W
        # The oracles: each no worse than its correction read at the step the probe starts from.
        states = module.read_states(model, [x[0].tolist(), x[1].tolist()])
        variants = module.bias_variants(layer, states, sums)
        shipped = module.held_out_logits(layer, states)
        read = math.exp(tuning.held_out_nll(shipped, layer.chosen_step(), layer.chosen_weight()))
        assert variants["shipped"]["ppl"] <= read + 1e-9
        # the W + κ·bias grid holds κ = 0 at the shipped oracle step
        assert variants["w_plus_bias"]["ppl"] <= variants["shipped"]["ppl"] * (1 + 1e-6)
        assert {"bias", "intercept"} <= set(variants)
        # The tail's own choice: at κ = 0 it is the layer's tuned step (before the shrink); the κ chosen is no worse.
        tail = variants["tail_tuned"]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(module, "BIAS_KAPPAS", (0.0,))
            alone = module.tail_bias_step(layer, sums)
        assert alone["step"] == pytest.approx(layer.last_tuning["tail_step"], rel=1e-9)
        assert tail["tail_nll"] <= alone["tail_nll"] and tail["kappa"] in module.BIAS_KAPPAS
        # --fixed-bias: β·b added to the shipped correction, read against the hand-made logits; the tail's step at
        # β = 0 is the layer's own tuned step (a golden section against its search: their tolerance).
        fixed = module.fixed_bias(layer, states, sums, tuned=True)
        z0, z1, t0, _ = shipped
        zb = (b @ head.T).float()
        for beta in module.FIXED_BETAS:
            z = z1 * layer.chosen_step() + beta * zb
            hand = math.exp(tuning.held_out_nll((z0, z, t0, z.gather(-1, states[2][:, None])[:, 0]), 1.0,
                                                layer.chosen_weight()))  # fmt: skip
            assert fixed[f"{beta:g}"]["shipped"]["ppl"] == pytest.approx(hand, rel=1e-6)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(module, "FIXED_BETAS", (0.0,))
            zero = module.fixed_bias(layer, states, sums, tuned=True)["0"]
        assert zero["tail"]["step"] == pytest.approx(layer.chosen_step(), rel=STEP_SEARCH_REL)
        assert zero["shipped"]["ppl"] == pytest.approx(read, rel=1e-6)
    finally:
        del layer.learn
        model.remove_faast()


def test_the_step_probes_folds_score_each_document_by_a_fit_without_its_own_folds_ends(monkeypatch):
    """lm_step_probe --folds on a tiny Llama, 8 texts: with one fold the step is the layer's own tail step and shrink;
    with two, each held-out row's logit change is keys·W·Hᵀ for the W fitted without the left-out positions of its
    own fold's documents only (documents dealt alternately), against float64 from the kept rows; the layer is left as
    it was."""
    from faast.hf import FaastConfig, ResidualOutput, apply_faast
    from faast_lab.experiments.lm_baselines import faast_min_fit
    from test_hf_residual import ids
    from tolerances import STEP_SEARCH_REL, TRUTH_REL_W, rel

    module = load_script("lm_step_probe")
    output = ResidualOutput(key_layers=[], tune_tokens=4096, head_dtype="float32")
    model = apply_faast(tiny_model("llama"), FaastConfig(output=output, learn_dtype="model"))
    layer = model.output_memory_layer
    try:
        model.learn(ids(batch=8, seq=100, period=23))
        shipped = layer.chosen_step()
        last = dict(layer.last_tuning)
        assert last["tuned"] and shipped > 0
        # The logits each k's step search is given: the script's own with_targets builds them (a lab function).
        seen, build = [], module.with_targets
        monkeypatch.setattr(module, "with_targets", lambda *a: seen.append(build(*a)) or seen[-1])
        steps = module.fold_steps(layer)
        monkeypatch.undo()
        assert layer.chosen_step() == shipped and set(steps) == {str(k) for k in module.FOLDS}
        assert steps["1"]["tail_step"] == pytest.approx(last["tail_step"], rel=STEP_SEARCH_REL)
        assert steps["2"]["step"] / steps["2"]["tail_step"] == pytest.approx(last["document_shrink"], rel=1e-12)
        count, min_fit = int(layer.memory.count), faast_min_fit(layer.hidden_size)
        keys, _, docs, out_k, out_v, _, _ = layer.held_out.split(count, min_fit)
        out_docs = layer.held_out.left_out_documents(count, min_fit)
        assert out_docs.shape[0] == out_k.shape[0]
        order = sorted(set(out_docs.tolist()))
        assert len(order) == 8
        head, curvature, memory = layer.head.weight.double(), layer.damped_curvature(), layer.memory
        z1 = seen[1][1]  # k = 2
        assert rel(z1, seen[0][1]) > 1e-3  # the folds' fits are not the one fit without every text's end
        for fold in (order[0::2], order[1::2]):
            left = torch.isin(out_docs, torch.tensor(fold))
            kk, vv = out_k[left].double(), out_v[left].double()
            w = layer.newton(memory.gram - kk.T @ kk, memory.cross - kk.T @ vv, memory.count - float(left.sum()),
                             curvature)  # fmt: skip
            rows = torch.isin(docs, torch.tensor(fold))
            assert rows.any()
            assert rel(z1[rows].double(), keys[rows].double() @ w @ head.T) < TRUTH_REL_W
    finally:
        model.remove_faast()


@pytest.mark.parametrize("products", ["float32", "bfloat16", "int8"])
def test_the_pool_probe_measures_each_threshold_against_float64_products(tmp_path, monkeypatch, products):
    """lm_head_pool.main on a tiny Llama's head and made-up states, with `--products`: threshold 0 is the exact
    products (every column kept, errors of that dtype's grade); a threshold that pools reports the error head_gradients
    gives at it in that dtype, with the gradient sum exact to that grade; the kept share is measured on the blocks
    learning forms."""
    from faast.hf import OutputPolicy
    from faast.hf.output import head as head_module
    from tolerances import BF16_HEAD_PRODUCTS_REL, INT8_HEAD_PRODUCTS_REL

    module = load_script("lm_head_pool")
    monkeypatch.setenv("FAAST_BACKEND", "int8_linear=torch.int_mm")  # the 8-bit kernel the thresholds were set on
    base = tiny_model("llama")
    head = base.get_output_embeddings()
    g = torch.Generator().manual_seed(3)
    keys = 40 * torch.randn(70, head.weight.shape[1], generator=g)  # sharp predictions: many columns pool
    targets = torch.randint(0, head.weight.shape[0], (70,), generator=g)
    torch.save({"learn": (keys, targets)}, tmp_path / "d.pt")
    argv = ["--cache", str(tmp_path), "--domains", "d", "--pools", "0,0.01", "--positions", "60", "--batch", "24",
            "--repeats", "1", "--results-dir", str(tmp_path), "--out", "p", "--products", products,
            # blocks of 16; pool however few columns fall below; 4 of the tiny head's 32 columns float32, most int8
            "--chunk", "16", "--dense-share", "1", "--outliers", "4"]  # fmt: skip
    exact, pooled = module.main(argv, load_model=tiny_loader(base))["rows"]
    grade = {"float32": 1e-5, "bfloat16": BF16_HEAD_PRODUCTS_REL, "int8": INT8_HEAD_PRODUCTS_REL}[products]
    assert exact["kept_share"] == 1.0 and exact["r_rel"] < grade and exact["time_ratio"] == 1.0
    assert products == "float32" or exact["r_rel"] > 1e-5  # the products did round to bfloat16 or int8
    weight = head.weight.detach().double()
    kept, got = [], []
    for i in range(0, 60, 24):  # blocks of 16 within calls of 24 rows: 16, 8, 16, 8, 12
        for j in range(i, min(i + 24, 60), 16):
            peak = torch.softmax(keys[j : min(j + 16, i + 24, 60)].double() @ weight.T, -1).amax(0)
            kept.append(float((peak >= 0.01).double().mean()))
        y = targets[i : min(i + 24, 60)][None]
        learned = torch.ones_like(y, dtype=torch.bool)
        got.append(head_module.head_gradients(head, keys[i : i + y.shape[1]][None], y, learned,
                                              getattr(torch, products), pool=0.01, chunk=16, outliers=4,
                                              policy=OutputPolicy(pool_dense_share=1.0))[0][0])  # fmt: skip
    assert pooled["kept_share"] == pytest.approx(sum(kept) / len(kept)) and 0 < pooled["kept_share"] < 1
    r64 = weight[targets[:60]] - torch.softmax(keys[:60].double() @ weight.T, -1) @ weight
    assert pooled["r_rel"] == pytest.approx(float((torch.cat(got).double() - r64).norm() / r64.norm()), rel=1e-6)
    # Pooling moves the rows: by far more than float32's rounding, and still visibly beside bfloat16's.
    assert pooled["r_rel"] > (10 if products == "float32" else 1.1) * exact["r_rel"]
    assert pooled["gradient_sum_rel"] < grade
    assert "| d | 0.01 |" in (tmp_path / "p.md").read_text(encoding="utf-8")
