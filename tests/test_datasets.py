"""The packaged Debian-sections dataset: shape, labels, leakage between splits and the generating rules."""

import dataclasses
import os
import re
import subprocess
import sys
from collections import Counter
from importlib.resources import files

import pytest
import torch

from faast.classify.data import DEBIAN_SECTIONS, TextClassificationData, load_debian_sections

SECTION_IDS = sorted(DEBIAN_SECTIONS)

# The counts table of faast/data/debian_sections.md. Regenerating the data from another index changes it; update
# both together.
EXPECTED_COUNTS = {
    "admin": (200, 200),
    "database": (73, 73),
    "devel": (200, 200),
    "editors": (114, 114),
    "electronics": (57, 57),
    "fonts": (200, 200),
    "games": (200, 200),
    "graphics": (188, 188),
    "hamradio": (51, 50),
    "mail": (112, 112),
    "math": (154, 153),
    "net": (200, 200),
    "science": (200, 200),
    "sound": (200, 200),
    "video": (74, 73),
    "web": (168, 168),
}


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


@pytest.fixture(scope="module")
def train() -> TextClassificationData:
    return load_debian_sections("train")


@pytest.fixture(scope="module")
def test() -> TextClassificationData:
    return load_debian_sections("test")


def _counts(data: TextClassificationData) -> dict[str, int]:
    counts = Counter(data.labels.tolist())
    return {data.label_names[i]: counts[i] for i in range(len(data.label_names))}


@pytest.mark.parametrize("split", ["train", "test"])
def test_split_loads_with_16_sorted_classes(split):
    data = load_debian_sections(split)
    n = len(data)
    assert n > 1000
    assert len(data.texts) == len(data.packages) == n
    assert data.labels.dtype == torch.int64 and data.labels.shape == (n,)
    assert data.label_names == SECTION_IDS
    assert data.label_names == sorted(data.label_names)
    assert data.label_titles == [DEBIAN_SECTIONS[s] for s in SECTION_IDS]
    assert data.label_titles[data.label_names.index("hamradio")] == "Amateur Radio"
    assert int(data.labels.min()) == 0 and int(data.labels.max()) == 15
    assert set(data.labels.tolist()) == set(range(16))
    assert all(isinstance(t, str) and t.strip() and not re.search(r"[\t\r\n]", t) for t in data.texts)
    assert len(set(data.packages)) == n


def test_no_leakage_between_splits(train, test):
    assert not set(train.packages) & set(test.packages)
    train_texts = {_norm(t) for t in train.texts}
    test_texts = {_norm(t) for t in test.texts}
    assert not train_texts & test_texts
    # Synopses are deduplicated across the whole dataset, not only across splits.
    assert len(train_texts) == len(train) and len(test_texts) == len(test)


def test_generating_rules_hold(train, test):
    for data in (train, test):
        lowered = [t.lower() for t in data.texts]
        assert not any("transitional" in t or "dummy package" in t for t in lowered)
    train_counts, test_counts = _counts(train), _counts(test)
    for section in SECTION_IDS:
        n_train, n_test = train_counts[section], test_counts[section]
        assert n_train >= 40 and n_test >= 40, section
        assert n_train - n_test in (0, 1), section  # 50/50 split, the odd record goes to train
        assert n_train + n_test <= 400, section  # per-class cap
    assert {s: (train_counts[s], test_counts[s]) for s in SECTION_IDS} == EXPECTED_COUNTS


def test_rows_sorted_by_label_then_package(train):
    keys = list(zip(train.labels.tolist(), train.packages, strict=True))
    assert keys == sorted(keys)


def test_bad_split_raises():
    with pytest.raises(ValueError, match=r"split.*'train'.*'test'.*'validation'"):
        load_debian_sections("validation")


def test_subset(train):
    sub = train.subset([5, 0, 5])
    assert len(sub) == 3
    assert sub.texts == [train.texts[5], train.texts[0], train.texts[5]]
    assert sub.packages == [train.packages[5], train.packages[0], train.packages[5]]
    assert torch.equal(sub.labels, train.labels[[5, 0, 5]])
    assert sub.label_names == train.label_names and sub.label_titles == train.label_titles

    mask = train.labels == train.label_names.index("games")
    games = train.subset(mask)
    assert len(games) == int(mask.sum()) and set(games.labels.tolist()) == {train.label_names.index("games")}
    assert games.packages == [p for p, m in zip(train.packages, mask.tolist(), strict=True) if m]
    assert train.subset(torch.nonzero(mask).flatten()).packages == games.packages

    empty = train.subset([])
    assert len(empty) == 0 and empty.labels.dtype == torch.int64 and empty.labels.shape == (0,)
    with pytest.raises(IndexError):
        train.subset([len(train)])


def test_data_is_frozen(train):
    with pytest.raises(dataclasses.FrozenInstanceError):
        train.texts = []  # type: ignore[misc]


def test_packaged_files_present():
    data_dir = files("faast") / "data"
    tsv = (data_dir / "debian_sections.tsv.gz").read_bytes()
    assert len(tsv) < 1_000_000
    assert "## Counts" in (data_dir / "debian_sections.md").read_text(encoding="utf-8")


def test_loading_data_does_not_import_transformers():
    code = "import sys, faast.classify.data as d; d.load_debian_sections('test'); print('transformers' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_loader_is_public_in_faast_classify():
    from faast import classify

    assert classify.load_debian_sections is load_debian_sections
