"""Readers for the paper's image-classification data in the official distribution formats (files you supply).

Benchmark code, not part of the faast package: faast_lab.benchmarks.repro_vision reads its data through these.
Nothing is downloaded: pass the folder that holds the files. Both readers return the same dict, ready for a CLIP
encoder and the few-shot protocol (faast.classify.episodes):

    support_images  uint8 [N, H, W, 3]     support_labels  int64 [N]
    query_images    uint8 [M, H, W, 3]     query_labels    int64 [M]
    class_names     list of C strings, label i is class_names[i]

The files are pickles, so read only copies you trust (pickle can run code while loading).
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import torch

__all__ = ["MINI_IMAGENET_SPLIT_SEED", "load_cifar10", "load_mini_imagenet"]

# The paper halves every mini-ImageNet test class into support and query with this seed (docs/authors.md §2).
MINI_IMAGENET_SPLIT_SEED = 42


def load_cifar10(root: str | os.PathLike) -> dict:
    """CIFAR-10, python version: ``root/cifar-10-batches-py/`` (data_batch_1..5, test_batch, batches.meta).

    The train batches are the support pool (50,000 images) and the test batch the query pool (10,000); 32 x 32 images.
    """
    folder = Path(root) / "cifar-10-batches-py"
    if not folder.is_dir():
        raise FileNotFoundError(f"root: expected the folder cifar-10-batches-py inside {root}")

    def read(name: str) -> dict:
        with open(folder / name, "rb") as f:
            return pickle.load(f, encoding="bytes")

    def images(batch: dict) -> torch.Tensor:
        # Rows are 3072 bytes: the red, green and blue 32 x 32 planes in turn; HWC is what the encoders take.
        return torch.from_numpy(
            np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1).copy()
        )

    train = [read(f"data_batch_{i}") for i in range(1, 6)]
    test = read("test_batch")
    names = [n.decode() for n in read("batches.meta")[b"label_names"]]
    return {
        "support_images": torch.cat([images(b) for b in train]),
        "support_labels": torch.tensor(sum((list(b[b"labels"]) for b in train), []), dtype=torch.int64),
        "query_images": images(test),
        "query_labels": torch.tensor(list(test[b"labels"]), dtype=torch.int64),
        "class_names": names,
    }


def load_mini_imagenet(root: str | os.PathLike, class_names: str | os.PathLike | None, *, use_ids: bool) -> dict:
    """The mini-ImageNet test split, each class halved (seed 42) into a support and a query pool; 84 x 84 images.

    Args:
        root: folder with ``mini-imagenet-cache-test.pkl`` (image_data uint8 [N, 84, 84, 3], class_dict {wnid: [row]}).
        class_names: JSON file {wnid: readable name}; needed unless ``use_ids``.
        use_ids: name the classes by their WordNet ids (no readable names, so a text prior is of no use).

    Classes are ordered by sorted WordNet id.
    """
    with open(Path(root) / "mini-imagenet-cache-test.pkl", "rb") as f:
        data = pickle.load(f)
    wnids = sorted(data["class_dict"])
    if use_ids:
        names = wnids
    else:
        if class_names is None:
            raise ValueError(
                "class_names: mini-imagenet needs a JSON file {wnid: readable name} (repro_vision.py --class-names), "
                "or use_ids=True (mini-imagenet-id)"
            )
        mapping = json.loads(Path(class_names).read_text())
        names = [mapping[w] for w in wnids]
    images = torch.from_numpy(np.asarray(data["image_data"], dtype=np.uint8))
    g = torch.Generator().manual_seed(MINI_IMAGENET_SPLIT_SEED)
    support, query, s_lab, q_lab = [], [], [], []
    for c, w in enumerate(wnids):
        idx = torch.tensor(sorted(data["class_dict"][w]))
        idx = idx[torch.randperm(idx.numel(), generator=g)]
        half = idx.numel() // 2
        support.append(idx[:half])
        query.append(idx[half:])
        s_lab += [c] * half
        q_lab += [c] * (idx.numel() - half)
    return {
        "support_images": images[torch.cat(support)],
        "support_labels": torch.tensor(s_lab, dtype=torch.int64),
        "query_images": images[torch.cat(query)],
        "query_labels": torch.tensor(q_lab, dtype=torch.int64),
        "class_names": names,
    }
