"""Labelled text-classification data that ships with faast, so the demo and the benchmarks run offline.

``load_debian_sections`` gives the Debian-sections text-classification data: the one-line synopses of Debian
bookworm packages (e.g. "Configuration tool for amateur radios"), labelled with the archive section the package is
filed under, for 16 topical sections ("admin", "database", ..., "web"). Each class has at most 200 train and 200
test records (the smallest has about 50 of each); one package per Debian source package is kept and no synopsis is
repeated, so nothing leaks between the two splits. Provenance, the exact selection rules and per-class counts are
in the data card ``faast/data/debian_sections.md`` (generated with ``lab/benchmarks/data/make_debian_sections.py``,
which imports ``DEBIAN_SECTIONS`` from here: this is the one definition of the section table).
"""

from __future__ import annotations

import csv
import functools
import gzip
import io
from dataclasses import dataclass
from importlib.resources import files
from typing import cast

import torch

__all__ = ["DEBIAN_SECTIONS", "TextClassificationData", "load_debian_sections"]

# Section id -> title used by packages.debian.org. Label id i is the i-th id in sorted order.
DEBIAN_SECTIONS: dict[str, str] = {
    "admin": "Administration Utilities",
    "database": "Databases",
    "devel": "Development",
    "editors": "Editors",
    "electronics": "Electronics",
    "fonts": "Fonts",
    "games": "Games",
    "graphics": "Graphics",
    "hamradio": "Amateur Radio",
    "mail": "Mail",
    "math": "Mathematics",
    "net": "Network",
    "science": "Science",
    "sound": "Sound",
    "video": "Video",
    "web": "Web Software",
}
_SPLITS = ("train", "test")
_DEBIAN_FILE = "debian_sections.tsv.gz"
_HEADER = ["split", "label", "package", "text"]


@dataclass(frozen=True)
class TextClassificationData:
    """A labelled text-classification split.

    Attributes:
        texts: N input strings.
        labels: int64 tensor of shape [N]; ``labels[i]`` indexes ``label_names``.
        label_names: C class ids, sorted alphabetically (the same for every split of a dataset).
        label_titles: C human-readable class titles, in the order of ``label_names``.
        packages: N record identifiers (for the Debian data, the binary package name).
    """

    texts: list[str]
    labels: torch.Tensor
    label_names: list[str]
    label_titles: list[str]
    packages: list[str]

    def __post_init__(self) -> None:
        n = len(self.texts)
        if self.labels.dtype != torch.int64 or self.labels.shape != (n,):
            got = f"{self.labels.dtype} {tuple(self.labels.shape)}"
            raise ValueError(f"labels must be int64 of shape [{n}], got {got}")
        if len(self.packages) != n:
            raise ValueError(f"packages has {len(self.packages)} entries, texts has {n}")
        if len(self.label_titles) != len(self.label_names):
            raise ValueError("label_titles and label_names differ in length")

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def num_classes(self) -> int:
        return len(self.label_names)

    def subset(self, index: torch.Tensor | list[int]) -> TextClassificationData:
        """Return the records at ``index``, in that order; the class list is unchanged.

        Args:
            index: integer positions (list, or int tensor of shape [M]) or a bool mask tensor of shape [N].
        """
        idx = torch.as_tensor(index)
        if idx.dtype == torch.bool:
            if idx.shape != (len(self),):
                raise ValueError(f"bool mask must have shape [{len(self)}], got {tuple(idx.shape)}")
            idx = idx.nonzero().flatten()
        elif idx.numel() == 0:
            # torch.as_tensor([]) is float32; an empty selection is still a valid index.
            idx = idx.to(torch.int64)
        elif idx.is_floating_point() or idx.is_complex():
            raise TypeError(f"index must hold integers or bools, got {idx.dtype}")
        idx = idx.reshape(-1).to(torch.int64)
        positions = idx.tolist()
        n = len(self)
        if any(not -n <= p < n for p in positions):
            raise IndexError(f"index out of range for {n} records")
        return TextClassificationData(
            texts=[self.texts[p] for p in positions],
            labels=self.labels[idx].clone(),
            label_names=list(self.label_names),
            label_titles=list(self.label_titles),
            packages=[self.packages[p] for p in positions],
        )


@functools.lru_cache(maxsize=1)
def _read_debian_rows() -> tuple[tuple[str, str, str, str], ...]:
    blob = (files("faast") / "data" / _DEBIAN_FILE).read_bytes()
    text = gzip.decompress(blob).decode("utf-8")
    # QUOTE_NONE: synopses contain quote characters and are never quoted in the file.
    reader = csv.reader(io.StringIO(text, newline=""), delimiter="\t", quoting=csv.QUOTE_NONE)
    header = next(reader)
    if header != _HEADER:
        raise ValueError(f"{_DEBIAN_FILE}: expected header {_HEADER}, got {header}")
    rows = tuple(tuple(row) for row in reader if row)
    bad = [r for r in rows if len(r) != 4 or r[0] not in _SPLITS or r[1] not in DEBIAN_SECTIONS]
    if bad:
        raise ValueError(f"{_DEBIAN_FILE}: {len(bad)} malformed rows, first {bad[0]!r}")
    return cast("tuple[tuple[str, str, str, str], ...]", rows)  # every row has 4 fields: checked above


def load_debian_sections(split: str) -> TextClassificationData:
    """Load one split of the Debian-sections dataset (16 classes, ~2.4k records per split).

    Args:
        split: "train" or "test".

    Returns:
        TextClassificationData with texts (package synopses), labels (int64 [N], indexes into the 16 sorted
        section ids in ``label_names``), ``label_titles`` and ``packages``; rows sorted by (label, package).
    """
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {list(_SPLITS)}, got {split!r}")
    names = sorted(DEBIAN_SECTIONS)
    label_id = {name: i for i, name in enumerate(names)}
    rows = [r for r in _read_debian_rows() if r[0] == split]
    return TextClassificationData(
        texts=[r[3] for r in rows],
        labels=torch.tensor([label_id[r[1]] for r in rows], dtype=torch.int64),
        label_names=names,
        label_titles=[DEBIAN_SECTIONS[n] for n in names],
        packages=[r[2] for r in rows],
    )
