"""When does each regularisation mode win? Few-shot and full-data text classification on real data.

    python -m faast_lab.benchmarks.bench_gcv_text [--episodes 20] [--queries 50] [--out lab/benchmarks/results]

Frozen all-MiniLM-L6-v2 embeddings (384-d, unit norm) of the shipped Debian-sections task (16 classes), one-hot
values, no prior. The protocol is bench_classify_text.py's, through the same functions and with the same defaults:
`faast.classify.evaluate_episodes` (16-way episodes of 1/5/20 shots from the train split, `--queries` test queries per
class, seeded) and `evaluate_full` (the whole train split, scored on the whole test split, Wilson interval). So the
rows the two benchmarks share (zero-shot, the tuned logistic probe) are the same numbers, and one task has one table
of episodes. Compared in one run:
  zero-shot (cosine to a label prompt), FAAST with the paper's fixed cut (alpha 1.0 and 0.8), FAAST alpha='auto'
  (GCV-chosen rank), FAAST ridge='auto' (GCV-chosen penalty), and the tuned logistic-regression probe of
  bench_classify_text.py (scikit-learn, C chosen by stratified cross-validation on the support set; C = 1 at 1 shot,
  where no split exists).
Reports mean accuracy with a 95% interval over episodes (1.96·sd/sqrt(E)) and the mean fit time of each method.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from faast.classify import (
    FAASTClassifier,
    ZeroShotClassifier,
    embed_debian_sections,
    evaluate_episodes,
    evaluate_full,
)
from faast_lab.benchmarks import _harness as H
from faast_lab.benchmarks.bench_classify_text import SHOTS, TunedLogisticProbe

# FastWeights on one-hot values through the estimator API: no label embeddings, so no prior.
FAAST_MODES = {
    "FAAST α=1.0 (paper default)": {"alpha": 1.0, "ridge": None},
    "FAAST α=0.8": {"alpha": 0.8, "ridge": None},
    "FAAST alpha=auto (GCV rank)": {"alpha": "auto", "ridge": None},
    "FAAST ridge=auto (GCV ridge)": {"ridge": "auto"},
}
ZERO_SHOT = 'zero-shot (cosine to "<section> software")'
PROBE = "logistic probe (tuned)"


def methods(label_keys: torch.Tensor) -> dict:
    """name -> make(classes): a fresh estimator for an episode's classes."""

    def faast(kwargs: dict):  # noqa: ANN202
        return lambda classes: FAASTClassifier(classes=classes.tolist(), **kwargs)

    def zero_shot(classes: torch.Tensor) -> ZeroShotClassifier:
        return ZeroShotClassifier(label_embeddings=label_keys[classes], classes=classes.tolist())

    out = {ZERO_SHOT: zero_shot}
    out.update({name: faast(kwargs) for name, kwargs in FAAST_MODES.items()})
    out[PROBE] = lambda classes: TunedLogisticProbe()
    return out


def run(task, args: argparse.Namespace) -> dict:
    """{setting: {method: {accuracy, ci95, fit_seconds}}} for every shot count and the full split."""
    train_x, train_y, test_x, test_y = task.train_keys, task.train.labels, task.test_keys, task.test.labels
    table: dict[str, dict] = {f"{shots}-shot": {} for shots in SHOTS} | {"full": {}}
    for name, make in methods(task.label_keys).items():
        for shots in SHOTS:
            r = evaluate_episodes(
                make, train_x, train_y, ways=None, shots=shots, queries=args.queries, episodes=args.episodes,
                seed=args.seed, query_features=test_x, query_labels=test_y,
            )  # fmt: skip
            table[f"{shots}-shot"][name] = {"accuracy": r.accuracy, "ci95": r.ci95, "fit_seconds": r.fit_seconds}
        r = evaluate_full(make, train_x, train_y, test_x, test_y)
        table["full"][name] = {"accuracy": r.accuracy, "ci95": r.ci95, "fit_seconds": r.fit_seconds}
        print(f"{name:32} " + "  ".join(f"{s} {100 * v[name]['accuracy']:.1f}" for s, v in table.items()), flush=True)
    return table


def title(task, args: argparse.Namespace) -> str:
    d = task.train_keys.shape[-1]
    return (
        f"Debian sections, {task.num_classes} classes, all-MiniLM-L6-v2 ({d}-d), one-hot values: test accuracy % "
        f"(mean ± 95% CI over {args.episodes} episodes, {args.queries} test queries per class, rows N = shots x "
        f"{task.num_classes}; full = {len(task.train)} train rows scored on the whole test split, Wilson interval)"
    )


def markdown(table: dict) -> str:
    settings = list(table)
    lines = ["| method | " + " | ".join(settings) + " | fit time (20-shot / full) |"]
    lines.append("|---" * (len(settings) + 2) + "|")
    for m in table[settings[0]]:
        cells = [f"{100 * table[s][m]['accuracy']:.1f} ± {100 * table[s][m]['ci95']:.1f}" for s in settings]
        times = f"{H.fmt_s(table['20-shot'][m]['fit_seconds'])} / {H.fmt_s(table['full'][m]['fit_seconds'])}"
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {times} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=20)
    parser.add_argument("--queries", type=int, default=50, help="test queries per class and episode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    H.set_threads()
    record = H.start()
    task = embed_debian_sections()
    table = run(task, args)
    payload = {"config": vars(args) | {"out": None}, "results": table}
    H.write(args.out / "gcv_text_cpu", record, payload, title(task, args), markdown(table))
    print(title(task, args) + "\n\n" + markdown(table))


if __name__ == "__main__":
    main()
