"""faast.hf with the datasets library: learn() from a Dataset / IterableDataset, and the readout trainer's local data
read through datasets.load_dataset("json" | "text"). Offline: every file is written to tmp_path."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

datasets = pytest.importorskip("datasets")

from faast.hf import EmbeddingOutput, FaastConfig, MiddleLayers, ResidualOutput, apply_faast, corpus, learn_datasets  # noqa: E402
from faast.hf.train import main as train_main  # noqa: E402
from hf_models import save_tiny_checkpoint, tiny_model  # noqa: E402
from tolerances import REORDER_REL, rel  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return save_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    # A character-level fast tokenizer (ids below the tiny model's vocabulary) that, like any transformers tokenizer,
    # takes a list of texts.
    return pytest.importorskip("transformers").AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(autouse=True)
def several_reads(monkeypatch):
    # Rows are read 7 at a time, so every dataset below spans several reads with a partial last one.
    monkeypatch.setattr(learn_datasets, "ROWS_PER_READ", 7)


def some_texts(n=30, seed=0):
    rng = random.Random(seed)
    words = ["def", "x", "return", "the cat", "sat", "on", "a mat", "(1, 2)", "\n", "class A:"]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randrange(0, 12))) for _ in range(n)]
    return texts[:3] + ["", "y"] + texts[3:]  # an empty text and a one-token text learn no pair


def fresh(target="embedding"):
    output = {"embedding": EmbeddingOutput, "residual": ResidualOutput}[target]()
    return apply_faast(tiny_model("llama"), FaastConfig(output=output, middle=MiddleLayers(num_layers=2)))


def assert_same_statistics(actual, expected):
    """Every learned statistic of two models (middle bank, output layer) equal to float64 reordering tolerance."""
    pairs = list(zip((s for _, s in actual.learned_state()), (s for _, s in expected.learned_state()), strict=True))
    assert pairs
    for a, b in pairs:
        for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
            if x.is_floating_point():
                assert rel(x, y) <= REORDER_REL, name
            else:
                assert torch.equal(x, y), name
    assert float(expected.fast_weights()[0].count.sum()) > 0  # something was learned


def learn_list(texts, tokenizer, **kwargs):
    model = fresh()
    stats = model.learn(list(texts), tokenizer=tokenizer, max_length=16, batch_size=3, progress=False, **kwargs)
    return model, stats


def learn_dataset(dataset, tokenizer, target="embedding", **kwargs):
    model = fresh(target)
    stats = model.learn(dataset, tokenizer=tokenizer, max_length=16, batch_size=3, progress=False, **kwargs)
    return model, stats


# ---------------------------------------------------------------------------------------------------- texts


def test_a_dataset_learns_what_the_same_texts_as_a_list_learn(tokenizer):
    texts = some_texts()
    expected, expected_stats = learn_list(texts, tokenizer)
    dataset = datasets.Dataset.from_dict({"text": texts, "label": list(range(len(texts)))})
    for data in (dataset, dataset.to_iterable_dataset(num_shards=1)):
        model, stats = learn_dataset(data, tokenizer)  # the only string column is found
        assert_same_statistics(model, expected)
        assert (stats.tokens, stats.pairs, stats.batches) == (
            expected_stats.tokens,
            expected_stats.pairs,
            expected_stats.batches,
        )
    assert expected_stats.pairs == sum(max(len(tokenizer(t)["input_ids"]) - 1, 0) for t in texts)


def test_an_iterable_dataset_streamed_from_local_jsonl_and_text_files(tmp_path, tokenizer):
    texts = [t for t in some_texts(seed=1) if t]  # a text file has no empty line to keep apart from a missing one
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "body": t.replace("\n", " ")}) + "\n" for i, t in enumerate(texts)))
    lines = tmp_path / "rows.txt"
    lines.write_text("".join(t.replace("\n", " ") + "\n" for t in texts))
    expected, _ = learn_list([t.replace("\n", " ") for t in texts], tokenizer)
    for builder, path, column in (("json", jsonl, "body"), ("text", lines, None)):
        stream = datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True)
        assert isinstance(stream, datasets.IterableDataset)
        model, _ = learn_dataset(stream, tokenizer, text_column=column)
        assert_same_statistics(model, expected)


def test_a_stream_is_read_as_it_is_learned_not_first_in_full(tokenizer):
    texts = some_texts(n=40, seed=2)
    produced = []

    def rows():
        for t in texts:
            produced.append(t)
            yield {"text": t}

    stream = datasets.IterableDataset.from_generator(rows)
    model = fresh()
    seen_at_first_batch = []
    learn_batch = model.learner.learn_batch

    def spy(*args, **kwargs):
        seen_at_first_batch.append(len(produced))
        return learn_batch(*args, **kwargs)

    model.learner.learn_batch = spy
    model.learn(stream, tokenizer=tokenizer, max_length=16, batch_size=3, progress=False)
    assert len(produced) == len(texts)
    assert seen_at_first_batch[0] < len(texts)  # learning started before the stream was read to its end
    expected, _ = learn_list(texts, tokenizer)
    assert_same_statistics(model, expected)


def test_the_text_column_is_chosen_or_the_choice_refused_with_the_columns_named(tokenizer):
    texts = some_texts(n=10, seed=3)
    two = datasets.Dataset.from_dict({"title": ["t"] * len(texts), "body": texts})
    with pytest.raises(ValueError, match=r"several string columns \['body', 'title'\]"):
        learn_dataset(two, tokenizer)
    with pytest.raises(ValueError, match=r"several string columns \['body', 'title'\]"):
        learn_dataset(two.to_iterable_dataset(), tokenizer)
    model, _ = learn_dataset(two, tokenizer, text_column="body")
    assert_same_statistics(model, learn_list(texts, tokenizer)[0])
    with pytest.raises(ValueError, match=r"text_column: 'text' is not a column of the dataset \(columns: \['body'"):
        learn_dataset(two, tokenizer, text_column="text")
    numbers = datasets.Dataset.from_dict({"n": [1, 2], "body": ["ab", "cd"]})
    with pytest.raises(ValueError, match="text_column: 'n' does not hold strings"):
        learn_dataset(numbers, tokenizer, text_column="n")
    with pytest.raises(ValueError, match=r"no string column and no 'input_ids' column \(columns: \['n'\]\)"):
        learn_dataset(numbers.remove_columns("body"), tokenizer)
    with pytest.raises(ValueError, match="text_column: row 1 of 'body' is NoneType"):
        learn_dataset(datasets.Dataset.from_dict({"body": ["ab", None]}), tokenizer)
    with pytest.raises(ValueError, match="tokenizer: required"):
        learn_dataset(datasets.Dataset.from_dict({"body": ["ab"]}), None)
    with pytest.raises(ValueError, match=r"a dict of dataset splits \['train'\]; pass one split"):
        learn_dataset(datasets.DatasetDict({"train": two}), tokenizer)
    with pytest.raises(ValueError, match="text_column: only valid with a datasets.Dataset"):
        fresh().learn(["ab"], tokenizer=tokenizer, text_column="text")
    empty = datasets.Dataset.from_dict({"text": ["a text"]}).filter(lambda row: False)  # keeps its features
    with pytest.raises(ValueError, match="inputs: nothing to learn: the Dataset held no tokens"):
        learn_dataset(empty, tokenizer)


# ---------------------------------------------------------------------------------------------------- token ids


def token_rows(n=12, seed=4, vocab=40):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 21, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for length in lengths]


def test_an_input_ids_dataset_learns_what_the_same_token_lists_learn(tokenizer):
    rows = token_rows()
    expected, _ = learn_list(rows, tokenizer)
    # A tokenised dataset that kept its text: the input_ids column is the one learned.
    dataset = datasets.Dataset.from_dict({"input_ids": rows, "text": ["unused"] * len(rows)})
    for data in (dataset, dataset.to_iterable_dataset(num_shards=1), dataset.with_format("torch")):
        model, _ = learn_dataset(data, None)
        assert_same_statistics(model, expected)
    # Left- and right-padded rows with their attention_mask learn the real tokens only.
    width = max(len(r) for r in rows)
    padded, masks = [], []
    for i, r in enumerate(rows):
        pad = [0] * (width - len(r))
        padded.append(pad + r if i % 2 else r + pad)
        masks.append([0] * len(pad) + [1] * len(r) if i % 2 else [1] * len(r) + [0] * len(pad))
    model, _ = learn_dataset(datasets.Dataset.from_dict({"input_ids": padded, "attention_mask": masks}), None)
    assert_same_statistics(model, expected)
    holed = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7]], "attention_mask": [[1, 0, 1]]})
    with pytest.raises(ValueError, match="attention_mask: row 0 expected 0/1 entries with the real tokens contiguous"):
        learn_dataset(holed, None)
    with pytest.raises(ValueError, match="input_ids: row 1 expected a list of ints"):
        learn_dataset(datasets.Dataset.from_dict({"input_ids": [[5, 6], None]}), None)


@pytest.mark.parametrize("target", ["embedding", "residual"])
def test_labels_of_minus_100_mark_the_pairs_not_learned(target, tokenizer):
    rows = token_rows(n=9, seed=5)
    g = torch.Generator().manual_seed(6)
    labels = [[t if bool(torch.rand((), generator=g) < 0.6) else -100 for t in r] for r in rows]
    labels[2] = [-100] * len(rows[2])  # a row with nothing to learn
    dataset = datasets.Dataset.from_dict({"input_ids": rows, "labels": labels})
    # Reference: the same batches as input_ids tensors with labels (rows no longer than max_length are not cut).
    expected = fresh(target)
    for start in range(0, len(rows), 3):
        group = list(range(start, min(start + 3, len(rows))))
        width = max(len(rows[i]) for i in group)
        ids = torch.tensor([rows[i] + [0] * (width - len(rows[i])) for i in group])
        mask = torch.tensor([[1] * len(rows[i]) + [0] * (width - len(rows[i])) for i in group])
        lab = torch.tensor([labels[i] + [-100] * (width - len(rows[i])) for i in group])
        expected.learn(input_ids=ids, attention_mask=mask, labels=lab)
    for data in (dataset, dataset.to_iterable_dataset(num_shards=1)):
        model = fresh(target)
        model.learn(data, max_length=32, batch_size=3, progress=False)
        assert_same_statistics(model, expected)
    # Cut into overlapping windows, each labelled pair is still learned exactly once.
    wanted = sum(sum(1 for t in lab[1:] if t != -100) for lab in labels)
    stats = fresh(target).learn(dataset, max_length=4, batch_size=2, progress=False)
    assert stats.pairs == wanted and 0 < wanted < sum(len(r) - 1 for r in rows)
    bad = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7]], "labels": [[5, 6]]})
    with pytest.raises(ValueError, match="labels: row 0 has 2 labels for 3 input_ids"):
        fresh(target).learn(bad, progress=False)


def test_learn_needs_no_datasets_for_lists_and_tensors():
    # A fresh interpreter in which `import datasets` fails: faast.hf imports and learns texts, id lists and tensors.
    code = """
import sys
sys.modules["datasets"] = None
import torch
from faast.hf import FaastConfig, MiddleLayers, apply_faast
from hf_models import CharTokenizer, tiny_model
model = apply_faast(tiny_model("gpt2"), FaastConfig(middle=MiddleLayers(num_layers=1)))
a = model.learn(["some text", "more"], tokenizer=CharTokenizer(), progress=False)
b = model.learn([[5, 6, 7, 8]], progress=False)
c = model.learn(torch.tensor([[5, 6, 7]]))
print(a.pairs + b.pairs + c.pairs)
"""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")])),
    }
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == str(8 + 3 + 3 + 2)


# ---------------------------------------------------------------------------------------------------- trainer data


def test_read_dataset_reads_local_jsonl_and_text_files_through_load_dataset(tmp_path, monkeypatch):
    rows = [{"text": f"row {i} " * (i % 4), "n": i} for i in range(9)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:5]))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[5:]))
    (tmp_path / "lines.txt").write_text("first line\n\n  \nsecond line\n")
    calls = []
    load = datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append((a, k)) or load(*a, **k))

    got = list(corpus.read_dataset(str(tmp_path / "*.jsonl"), split="test"))
    wanted = [r["text"] for r in rows if r["text"].strip()]
    assert [t for _, t in got] == wanted and len(wanted) < len(rows)  # empty texts skipped
    assert calls[-1][0] == ("json",) and calls[-1][1]["streaming"] is True
    assert list(calls[-1][1]["data_files"]) == ["test"]
    got = list(corpus.read_dataset(str(tmp_path / "a.jsonl"), text_column="text"))
    assert [t for _, t in got] == [r["text"] for r in rows[:5] if r["text"].strip()]
    assert [t for _, t in corpus.read_dataset(str(tmp_path / "lines.txt"))] == ["first line", "second line"]
    assert calls[-1][0] == ("text",)
    with pytest.raises(ValueError, match=r"text_column: 'body' is not a column of .*\(columns: \['n', 'text'\]\)"):
        list(corpus.read_dataset(str(tmp_path / "a.jsonl"), text_column="body"))
    (tmp_path / "table.csv").write_text("text\nx\n")
    with pytest.raises(ValueError, match="a local file of unknown type"):
        list(corpus.read_dataset(str(tmp_path / "table.csv")))
    with pytest.raises(FileNotFoundError, match="matches no file"):
        list(corpus.read_dataset(str(tmp_path / "*.json")))

    # A hub name (or a folder) still goes to load_dataset as it is, with its config.
    calls.clear()
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append((a, k)) or [{"text": "hub row"}])
    assert list(corpus.read_dataset("wikitext", config="wikitext-2-raw-v1", split="test")) == [
        ("wikitext:test:0", "hub row")
    ]
    assert calls == [(("wikitext", "wikitext-2-raw-v1"), {"split": "test", "streaming": True})]


def test_read_text_files_reads_one_document_per_file_through_load_dataset(tmp_path, monkeypatch):
    texts = {"b.txt": "second\nfile\n", "a[1].txt": "first", "sub/c.py": "x = 1\n" * 3, "short.txt": "ab"}
    for name, text in texts.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "a1.txt").write_text("not matched by the bracketed name")
    (tmp_path / "sub" / "data.bin").write_bytes(b"\x89PNG\xff\x00")
    calls = []
    load = datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append((a, k)) or load(*a, **k))
    patterns = [str(tmp_path / "*[bt].txt"), str(tmp_path / "**" / "*.*")]
    got = dict(corpus.read_text_files(patterns, min_chars=3))
    assert calls and all(a == ("text",) and k["sample_by"] == "document" for a, k in calls)
    expected = {str(tmp_path / n): t for n, t in texts.items() if len(t) >= 3}
    expected[str(tmp_path / "a1.txt")] = "not matched by the bracketed name"
    assert got == expected  # not UTF-8 (data.bin) and shorter than min_chars (short.txt): skipped
    order = [p for p, _ in corpus.read_text_files(patterns, min_chars=3)]
    mixed = [p for p, _ in corpus.read_text_files(patterns, min_chars=3, shuffle_seed=1)]
    assert sorted(mixed) == sorted(order) and mixed != order


def test_the_trainer_command_line_trains_on_a_local_jsonl_file(tmp_path, checkpoint, tokenizer):
    rng = random.Random(7)
    words = ["the", "cat", "sat", "on", "a", "mat."]
    rows = [{"text": " ".join(rng.choice(words) for _ in range(rng.randrange(2, 30)))} for _ in range(20)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seq_len, batch_size = 8, 2
    # The batches the data allows: the trainer runs out of them before --steps.
    pairs = list(corpus.window_pairs(((str(i), r["text"]) for i, r in enumerate(rows)), tokenizer, seq_len))
    assert len(pairs) > batch_size
    out = tmp_path / "out"
    argv = ["--model", checkpoint, "--dataset", str(data), "--output", str(out), "--steps", "100", "--seq-len",
            str(seq_len), "--batch-size", str(batch_size), "--num-layers", "1", "--warmup-steps", "1",
            "--threads", "1"]  # fmt: skip
    assert train_main(argv) == 0
    log = json.loads((out / "training_log.json").read_text())
    assert len(log["history"]) == math.ceil(len(pairs) / batch_size)
    assert sum(r["tokens"] for r in log["history"]) == seq_len * len(pairs)
    assert (out / "faast_config.json").is_file() and all(math.isfinite(r["loss"]) for r in log["history"])
