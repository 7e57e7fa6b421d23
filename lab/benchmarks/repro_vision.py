"""Reproduce the paper's image classification with CLIP: CIFAR-10 and mini-ImageNet, few-shot episodes and full data.

    python -m faast_lab.benchmarks.repro_vision --dataset cifar10 --data-dir DATA [--encoder open_clip:RN50] \
        [--episodes 600]

Needs the datasets on disk and CLIP weights in the open_clip / transformers cache (or network); neither is reachable
from the machine this project is developed on, so results are produced where they are. Protocols (docs/authors.md §2):
  cifar10           CIFAR-10 python batches (cifar-10-batches-py/): train = support pool, test = query pool; 10-way.
  mini-imagenet     the mini-ImageNet *test* split (mini-imagenet-cache-test.pkl: image_data [N, 84, 84, 3],
                    class_dict {wnid: [indices]}), each class halved into support/query with seed 42; 20-way.
                    Class names from --class-names (JSON {wnid: name}).
  mini-imagenet-id  the same with the WordNet ids themselves as label text (no readable names, so no useful
                    prior): the paper runs it with N0 = 0.
Label prompt "A photo of a {name}." Episodes: all classes, --shots each, --queries per class (paper: 20), mean ± 95%
CI; full: the whole support pool, every query once (Wilson interval). Methods: FAAST default (prior weight and ridge
from the data), FAAST paper (α=1, N0 = 400 / 800 / 0 as in their eval.py), zero-shot, kNN, softmax and linear
attention (±centred), SGD linear probe. Embeddings are cached (--cache), so each image is encoded once.
--features FILE runs the protocol on embeddings already computed (a safetensors file holding the float tensors
support [N, d], query [M, d], label_keys [C, d] and the int64 tensors support_labels [N], query_labels [M]) instead
of reading --data-dir and encoding it. The readers are lab/benchmarks/vision_data.py (load_cifar10 /
load_mini_imagenet).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from faast.classify import (
    FAASTClassifier,
    KNNMemoryClassifier,
    LinearAttentionClassifier,
    LinearProbeClassifier,
    SoftmaxAttentionClassifier,
    ZeroShotClassifier,
    evaluate_episodes,
    evaluate_full,
)
from faast_lab.benchmarks import _harness as H
from faast_lab.benchmarks.vision_data import load_cifar10, load_mini_imagenet

PAPER_N0 = {"cifar10": 400.0, "mini-imagenet": 800.0, "mini-imagenet-id": 0.0}
PROMPT = "A photo of a {}."


def methods(label_keys: torch.Tensor, paper_n0: float) -> dict:
    def labelled(cls, **kw):  # noqa: ANN001, ANN202
        return lambda classes: cls(label_embeddings=label_keys[classes], classes=classes.tolist(), **kw)

    return {
        "FAAST default": labelled(FAASTClassifier),
        f"FAAST paper (α=1, N0={paper_n0:g})": labelled(FAASTClassifier, ridge=None, alpha=1.0, prior_count=paper_n0),
        "zero-shot": labelled(ZeroShotClassifier),
        "kNN (k=10)": lambda classes: KNNMemoryClassifier(classes=classes.tolist()),
        "softmax attention": labelled(SoftmaxAttentionClassifier),
        "linear attention": labelled(LinearAttentionClassifier),
        "linear attention, centred": labelled(LinearAttentionClassifier, centered=True),
        "linear probe (SGD)": labelled(LinearProbeClassifier),
    }


def run_protocol(features: dict, *, dataset: str, shots: list[int], queries: int, episodes: int, seed: int) -> dict:
    """Accuracy table {setting: {method: {accuracy, ci95, fit_seconds}}} from precomputed embeddings."""
    table: dict[str, dict] = {}
    make = methods(features["label_keys"], PAPER_N0[dataset])
    for n in shots:
        row = table.setdefault(f"{n}-shot", {})
        for name, factory in make.items():
            r = evaluate_episodes(
                factory, features["support"], features["support_labels"], ways=None, shots=n, queries=queries,
                episodes=episodes, seed=seed, query_features=features["query"], query_labels=features["query_labels"],
            )  # fmt: skip
            row[name] = {"accuracy": r.accuracy, "ci95": r.ci95, "fit_seconds": r.fit_seconds}
    row = table.setdefault("full", {})
    for name, factory in make.items():
        r = evaluate_full(factory, features["support"], features["support_labels"], features["query"],
                          features["query_labels"])  # fmt: skip
        row[name] = {"accuracy": r.accuracy, "ci95": r.ci95, "fit_seconds": r.fit_seconds}
    return table


def encode(data: dict, encoder_spec: str, cache: Path | None) -> dict:
    from faast.classify import ClipEncoder

    kind, _, name = encoder_spec.partition(":")
    if kind == "open_clip":
        encoder = ClipEncoder.open_clip(name or "RN50", "openai")
    elif kind == "transformers":
        encoder = ClipEncoder.transformers(name)
    else:
        raise ValueError(f"--encoder: expected open_clip:NAME or transformers:ID, got {encoder_spec!r}")
    return {
        "support": encoder.encode_images(data["support_images"], cache_dir=cache),
        "query": encoder.encode_images(data["query_images"], cache_dir=cache),
        "support_labels": data["support_labels"],
        "query_labels": data["query_labels"],
        "label_keys": encoder.encode_texts([PROMPT.format(n) for n in data["class_names"]], cache_dir=cache),
    }


FEATURE_KEYS = ("support", "support_labels", "query", "query_labels", "label_keys")


def load_features(path: Path) -> dict:
    """Precomputed embeddings for run_protocol from a safetensors file (the tensors named in FEATURE_KEYS)."""
    from safetensors.torch import load_file

    features = load_file(str(path))
    missing = [k for k in FEATURE_KEYS if k not in features]
    if missing:
        raise SystemExit(f"--features: {path} lacks the tensors {missing}; expected {list(FEATURE_KEYS)}")
    return {k: features[k] for k in FEATURE_KEYS}


def markdown(table: dict) -> str:
    settings = list(table)
    lines = ["| method | " + " | ".join(settings) + " |", "|---|" + "---|" * len(settings)]
    for name in table[settings[0]]:
        cells = [f"{100 * table[s][name]['accuracy']:.1f} ± {100 * table[s][name]['ci95']:.1f}" for s in settings]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=sorted(PAPER_N0), required=True)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data-dir", type=Path, help="the dataset's files, read and encoded with --encoder")
    source.add_argument("--features", type=Path, help="precomputed embeddings (safetensors; see above)")
    parser.add_argument("--class-names", type=Path, default=None)
    parser.add_argument("--encoder", default="open_clip:RN50")
    parser.add_argument("--shots", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--queries", type=int, default=20)
    parser.add_argument("--episodes", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", type=Path, default=Path(".cache/clip-embeddings"))
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    record = H.start()
    if args.features is not None:
        features = load_features(args.features)
    else:
        if args.dataset == "cifar10":
            data = load_cifar10(args.data_dir)
        else:
            data = load_mini_imagenet(args.data_dir, args.class_names, use_ids=args.dataset == "mini-imagenet-id")
        features = encode(data, args.encoder, args.cache)
    table = run_protocol(features, dataset=args.dataset, shots=args.shots, queries=args.queries,
                         episodes=args.episodes, seed=args.seed)  # fmt: skip
    source = f"features-{args.features.stem}" if args.features is not None else args.encoder
    name = f"vision_{args.dataset}_{source.replace(':', '-').replace('/', '-')}"
    payload = {"config": {k: H.provenance.relative(str(v), H.REPO) for k, v in vars(args).items()}, "results": table}
    title = f"Image classification over frozen CLIP features: {args.dataset}, {source}"
    H.write(args.out / name, record, payload, title, markdown(table))
    print((args.out / f"{name}.md").read_text())


if __name__ == "__main__":
    main()
