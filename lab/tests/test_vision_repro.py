"""The vision reproduction path without the real data or weights: a tiny CLIP built from a config in-process,
dataset loaders on files in the official formats written here, and lab/benchmarks/repro_vision.py's protocol run as a
script on synthetic features."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

from faast.classify import ClipEncoder

# The dataset readers are benchmark code (lab/benchmarks/vision_data.py), imported as repro_vision.py does.
from faast_lab.benchmarks.vision_data import load_cifar10, load_mini_imagenet

SCRIPT = "faast_lab.benchmarks.repro_vision"


@pytest.fixture(scope="module")
def tiny_clip():
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    words = ["[PAD]", "[UNK]", "a", "photo", "of", "cat", "dog", "ship", "."]
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]")
    config = transformers.CLIPConfig(
        text_config={"vocab_size": len(words), "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "max_position_embeddings": 16, "eos_token_id": 8, "bos_token_id": 2},
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 32, "patch_size": 8},
        projection_dim=12,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.CLIPModel(config)
    return ClipEncoder.from_clip_model(model, tokenizer, identity="tiny-clip-test"), model


def test_clip_encoder_matches_the_model_and_caches(tiny_clip, tmp_path):
    encoder, model = tiny_clip
    images = torch.randint(0, 256, (5, 32, 32, 3), dtype=torch.uint8)
    out = encoder.encode_images(images, batch_size=2, cache_dir=tmp_path)
    assert out.shape == (5, 12) and torch.allclose(out.norm(dim=-1), torch.ones(5))
    pixels = encoder.preprocess(images)
    with torch.no_grad():  # the full forward's projected image embeddings: an independent path to the same numbers
        direct = model(pixel_values=pixels, input_ids=torch.ones(5, 2, dtype=torch.long)).image_embeds
    assert torch.allclose(out, torch.nn.functional.normalize(direct, dim=-1), atol=1e-5)
    encoder_fn = encoder.image_fn
    encoder.image_fn = lambda x: (_ for _ in ()).throw(AssertionError("encoded twice"))
    try:
        assert torch.equal(encoder.encode_images(images, cache_dir=tmp_path), out)  # from the cache
    finally:
        encoder.image_fn = encoder_fn
    texts = encoder.encode_texts(["a photo of a cat .", "a photo of a dog ."], cache_dir=tmp_path)
    assert texts.shape == (2, 12) and not torch.allclose(texts[0], texts[1])


def test_clip_encoder_rejects_bad_images(tiny_clip):
    encoder, _ = tiny_clip
    with pytest.raises(ValueError, match=r"images: expected a uint8 tensor \[N, H, W, 3\]"):
        encoder.encode_images(torch.zeros(2, 3, 32, 32))


def test_cifar10_loader_reads_the_official_layout(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name, n in [*((f"data_batch_{i}", 4) for i in range(1, 6)), ("test_batch", 3)]:
        batch = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"labels": list(rng.integers(0, 10, n))}
        (folder / name).write_bytes(pickle.dumps(batch))
    (folder / "batches.meta").write_bytes(pickle.dumps({b"label_names": [f"c{i}".encode() for i in range(10)]}))
    data = load_cifar10(tmp_path)
    assert data["support_images"].shape == (20, 32, 32, 3) and data["query_images"].shape == (3, 32, 32, 3)
    raw = pickle.loads((folder / "test_batch").read_bytes())[b"data"][0]
    assert torch.equal(data["query_images"][0, :, :, 0].flatten(), torch.from_numpy(raw[:1024].copy()))  # red plane
    assert data["class_names"][3] == "c3"


def test_mini_imagenet_halves_each_class_with_seed_42(tmp_path):
    wnids = ["n02", "n01", "n03"]
    class_dict = {w: list(range(i * 6, i * 6 + 6)) for i, w in enumerate(wnids)}
    images = np.arange(18, dtype=np.uint8)[:, None, None, None] * np.ones((1, 4, 4, 3), dtype=np.uint8)
    (tmp_path / "mini-imagenet-cache-test.pkl").write_bytes(
        pickle.dumps({"image_data": images, "class_dict": class_dict})
    )
    names = tmp_path / "names.json"
    names.write_text(json.dumps({"n01": "dog", "n02": "cat", "n03": "ship"}))
    data = load_mini_imagenet(tmp_path, names, use_ids=False)
    assert data["class_names"] == ["dog", "cat", "ship"]  # sorted wnids
    support = set(data["support_images"][:, 0, 0, 0].tolist())
    query = set(data["query_images"][:, 0, 0, 0].tolist())
    assert len(support) == len(query) == 9 and not support & query
    assert torch.bincount(data["support_labels"]).tolist() == [3, 3, 3]
    again = load_mini_imagenet(tmp_path, names, use_ids=True)
    assert torch.equal(again["support_images"], data["support_images"]) and again["class_names"] == sorted(wnids)
    with pytest.raises(ValueError, match="--class-names"):
        load_mini_imagenet(tmp_path, None, use_ids=False)


def test_protocol_runs_every_method_on_synthetic_features(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    g = torch.Generator().manual_seed(0)
    label_keys = torch.nn.functional.normalize(torch.randn(3, 8, generator=g), dim=-1)

    def split(n):  # noqa: E306
        labels = torch.arange(n) % 3
        return label_keys[labels] + 0.3 * torch.randn(n, 8, generator=g), labels

    support, support_labels = split(60)
    query, query_labels = split(30)
    features = {"support": support, "support_labels": support_labels, "query": query, "query_labels": query_labels,
                "label_keys": label_keys}  # fmt: skip
    safetensors_torch.save_file(features, str(tmp_path / "synthetic.safetensors"))
    out = tmp_path / "results"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run(
        [sys.executable, "-m", SCRIPT, "--dataset", "cifar10", "--features", str(tmp_path / "synthetic.safetensors"),
         "--shots", "1", "5", "--queries", "4", "--episodes", "3", "--seed", "0", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (result,) = out.glob("vision_cifar10_*.json")
    table = json.loads(result.read_text())["results"]
    assert list(table) == ["1-shot", "5-shot", "full"]
    assert len(table["full"]) == 8 and all(0 <= r["accuracy"] <= 1 for row in table.values() for r in row.values())
    assert table["full"]["FAAST default"]["accuracy"] >= 0.9  # well-separated synthetic classes
