"""Readout and scorer training (docs/design.md §6): the base model stays frozen, the LM loss trains P and the scorer.

Each step: discount every memory's statistics by γ (0.9), learn a batch of text into the fast weights, solve
W = S_eps^+ T for all middle layers at once (one batched solve of their shared bank) with T differentiable in the
scorer (S_eps^+ a constant, so no eigensolver backward), then run the LM loss through h + P(dropout(h W)) on the
continuation of that text. Parameters are fp32 master weights whatever the model's dtype; AdamW with linear warmup
and a cosine schedule; checkpoints are written atomically and a run resumes from the newest one.

Command line: `python -m faast.hf.train --help`.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import cast

import torch
from torch.optim.lr_scheduler import LRScheduler

from .layers import MemoryLayer
from .model import FaastModel
from .output import MemoryOffWarning

_log = logging.getLogger("faast.hf.train")

TRAINER_STATE = "trainer_state.pt"
FAST_WEIGHTS = "fast_weights.safetensors"


@dataclass
class TrainConfig:
    """Hyper-parameters of train_readout.

    Attributes:
        steps: optimizer steps in total (a resumed run continues up to this number).
        lr: peak learning rate (AdamW); warmup_steps of linear warmup, then cosine decay to lr·min_lr_ratio.
        discount: γ applied to every memory's statistics before each step's learning (forgets old steps).
        grad_clip: max global gradient norm (0 disables).
        checkpoint_dir: where checkpoints go (None: no checkpoints); one every checkpoint_every steps, the newest
            `keep` are kept.
    """

    steps: int = 500
    lr: float = 1e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    discount: float = 0.9
    grad_clip: float = 1.0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 50
    keep: int = 2
    log_every: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "checkpoint_every", "keep", "log_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps: expected an int >= 0, got {self.warmup_steps!r}")
        if not self.lr > 0:
            raise ValueError(f"lr: expected > 0, got {self.lr!r}")
        if not 0 < self.discount <= 1:
            raise ValueError(f"discount: expected a number in (0, 1], got {self.discount!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio: expected a number in [0, 1], got {self.min_lr_ratio!r}")


def trainable_parameters(model: FaastModel) -> list[torch.nn.Parameter]:
    """The readout and scorer weights of every middle memory layer (the base model is frozen)."""
    # memory_layers holds MemoryLayers (an nn.ModuleDict types them nn.Module); an nn.Linear's weight is a
    # Parameter (torch types it Tensor).
    params: list[torch.nn.Parameter] = []
    for module in model.memory_layers.values():
        layer = cast(MemoryLayer, module)
        params.append(cast(torch.nn.Parameter, layer.readout.weight))
        if layer.scorer is not None:
            params.append(cast(torch.nn.Parameter, layer.scorer.weight))
    for p in params:
        p.requires_grad_(True)
    return params


def lr_factor(step: int, config: TrainConfig) -> float:
    """Multiplier of the peak lr at `step`: linear warmup, then cosine down to min_lr_ratio."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    span = max(config.steps - config.warmup_steps, 1)
    progress = min((step - config.warmup_steps) / span, 1.0)
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _labels(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ids.masked_fill(mask == 0, -100)


def training_step(model: FaastModel, batch: dict[str, torch.Tensor], discount: float) -> torch.Tensor:
    """Learn batch['learn_ids'] (default: the batch itself), then return the LM loss on batch['input_ids'] with the
    differentiable fast weights. The caller runs backward and then end_training_step (see train_readout)."""
    device = model.get_input_embeddings().weight.device
    ids = batch["input_ids"].to(device)
    mask = batch.get("attention_mask")
    mask = torch.ones_like(ids) if mask is None else mask.to(device)
    learn_ids = batch.get("learn_ids")
    learn_mask = batch.get("learn_mask")
    if learn_ids is None:
        learn_ids, learn_mask = ids, mask
    else:
        learn_ids = learn_ids.to(device)
        learn_mask = torch.ones_like(learn_ids) if learn_mask is None else learn_mask.to(device)
    for _, state in model.learned_state():  # the middle layers' bank in one call, then the output layer's state
        state.apply_discount(discount)
    model.learn_batch(learn_ids, learn_mask, differentiable=True)
    model.begin_training_step()  # one solve for every middle layer
    # The output layer's memory here is the training stream's, rebuilt every step, not one a user reads: whether its
    # tuned step is off says nothing about the readout being trained.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MemoryOffWarning)
        out = model(input_ids=ids, attention_mask=mask, labels=_labels(ids, mask), use_cache=False)
    return out.loss


def end_training_step(model: FaastModel) -> None:
    """Drop the step's differentiable fast weights (after backward): the layers read the folded weights again."""
    model.end_training_step()


# ---------------------------------------------------------------------------------------------------- checkpoints


def _checkpoints(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]), reverse=True)


def save_training_checkpoint(
    directory: Path, model: FaastModel, optimizer: torch.optim.Optimizer, scheduler: LRScheduler, step: int,
    history: list[dict], keep: int,
) -> Path:  # fmt: skip
    """Write adapter + fast weights + optimizer state into a temporary folder, then rename it: all or nothing."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"step-{step:08d}"
    tmp = directory / f".step-{step:08d}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        model.save_pretrained(tmp, memories=False)  # the training-time memory is the one file beside it
        model.save_fast_weights(tmp / FAST_WEIGHTS)
        state = {
            "step": step,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": torch.get_rng_state(),
            "history": json.dumps(history),
        }
        with open(tmp / TRAINER_STATE, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in _checkpoints(directory)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_training_checkpoint(
    path: Path, model: FaastModel, optimizer: torch.optim.Optimizer, scheduler: LRScheduler
) -> tuple[int, list[dict]]:
    """Restore a checkpoint folder written by save_training_checkpoint; returns (step, history)."""
    state = torch.load(path / TRAINER_STATE, weights_only=True)  # never unpickles code
    model.load_adapter(path)
    model.load_fast_weights(path / FAST_WEIGHTS)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    return int(state["step"]), json.loads(state["history"])


# ---------------------------------------------------------------------------------------------------- the loop


def train_readout(
    model: FaastModel,
    batches: Iterable[dict[str, torch.Tensor]] | Callable[[int], Iterable[dict[str, torch.Tensor]]],
    config: TrainConfig,
    *,
    callback: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Train every middle layer's readout P and scorer with the base model frozen. Returns the loss history.

    Args:
        model: a FaastModel (apply_faast). Its memories are used as the training-time memory (discounted by γ each
            step); reset_fast_weights() afterwards before learning a task.
        batches: an iterable of dicts with input_ids / attention_mask [B, T] (predicted) and optionally
            learn_ids / learn_mask (learned first; default: the batch itself), or a function start_step -> such an
            iterable so a resumed run seeks instead of re-reading consumed batches.
        config: TrainConfig. With checkpoint_dir set, the newest intact checkpoint there is resumed.
        callback: called with each history record (step, loss, lr, tokens, seconds).
    """
    if not isinstance(model, FaastModel):
        raise TypeError(f"model: expected a faast.hf.FaastModel (apply_faast), got {type(model).__name__}")
    if not model.memory_layers:
        raise ValueError("model: has no middle memory layers, so there is no readout to train")
    torch.manual_seed(config.seed)
    params = trainable_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, config))
    directory = Path(config.checkpoint_dir) if config.checkpoint_dir else None
    start, history = _resume(directory, model, optimizer, scheduler)
    stream = _stream_from(batches, start)
    was_training = model.training
    model.base_model.eval()
    for layer in model.memory_layers.values():
        layer.train()
    try:
        for step in range(start, config.steps):
            batch = next(stream, None)
            if batch is None:
                _log.warning("faast: the data ran out after %d steps (of %d)", step, config.steps)
                break
            record = {"step": step + 1, **_optimizer_step(model, batch, params, optimizer, scheduler, config)}
            history.append(record)
            if callback is not None:
                callback(record)
            _log_progress(history, config)
            if directory is not None and ((step + 1) % config.checkpoint_every == 0 or step + 1 == config.steps):
                save_training_checkpoint(directory, model, optimizer, scheduler, step + 1, history, config.keep)
    finally:
        model.train(was_training)
    return history


def _resume(
    directory: Path | None, model: FaastModel, optimizer: torch.optim.Optimizer, scheduler: LRScheduler
) -> tuple[int, list[dict]]:
    """(start step, history) of the newest readable checkpoint in `directory`, loaded into the model, optimizer and
    scheduler; (0, []) when there is none."""
    if directory is None:
        return 0, []
    for path in _checkpoints(directory):
        try:
            start, history = load_training_checkpoint(path, model, optimizer, scheduler)
        except (ValueError, RuntimeError, OSError, KeyError) as err:
            _log.warning("faast: skipping unreadable checkpoint %s (%s)", path, err)
            continue
        _log.info("faast: resuming from %s (step %d)", path, start)
        return start, history
    return 0, []


def _stream_from(
    batches: Iterable[dict[str, torch.Tensor]] | Callable[[int], Iterable[dict[str, torch.Tensor]]], start: int
) -> Iterator[dict[str, torch.Tensor]]:
    """The batches from step `start` on: a function seeks itself; a plain iterable is read and its first `start`
    batches dropped (what the checkpoint consumed)."""
    if callable(batches):
        return iter(batches(start))
    stream = iter(batches)
    for _ in range(start):
        next(stream, None)
    return stream


def _optimizer_step(
    model: FaastModel,
    batch: dict[str, torch.Tensor],
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler,
    config: TrainConfig,
) -> dict:
    """One training step on `batch` (learn, loss, backward, clip, AdamW and schedule steps); returns its history
    record without the step number (loss, lr, tokens, seconds)."""
    started = time.perf_counter()
    try:
        loss = training_step(model, batch, config.discount)
        loss.backward()
        if config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    finally:
        end_training_step(model)
    return {
        "loss": float(loss.detach()),
        "lr": optimizer.param_groups[0]["lr"],
        "tokens": int(batch.get("attention_mask", batch["input_ids"]).ne(0).sum()),
        "seconds": time.perf_counter() - started,
    }


def _log_progress(history: list[dict], config: TrainConfig) -> None:
    """Log the mean loss and time per step of the last log_every steps, every log_every steps."""
    record = history[-1]
    if record["step"] % config.log_every != 0:
        return
    recent = history[-config.log_every :]
    _log.info(
        "step %d loss %.4f lr %.2e %.1f s/step", record["step"],
        sum(r["loss"] for r in recent) / len(recent), record["lr"],
        sum(r["seconds"] for r in recent) / len(recent),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m faast.hf.train",
        description="Train the readout and token scorer of FAAST memory layers on a frozen causal LM.",
    )
    p.add_argument("--model", default="smollm2", help="'smollm2' (the embedded default) or a transformers id/path")
    p.add_argument("--gguf-file", default=None, help="GGUF file name inside --model (transformers gguf_file=)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--text-files", nargs="+", metavar="GLOB", help="local text files, one document each (recursive ** allowed)"
    )
    src.add_argument(
        "--dataset",
        help="a datasets name, e.g. wikitext (needs access to the hub), a local folder of data files, or local "
        ".jsonl/.json/.txt files (a path or a glob; --split names them)",
    )
    p.add_argument("--dataset-config", default=None)
    p.add_argument("--split", default="train")
    p.add_argument("--text-column", default="text")
    p.add_argument("--output", required=True, help="folder for the trained adapter (save_pretrained)")
    p.add_argument("--checkpoint-dir", default=None, help="default: OUTPUT/checkpoints; a rerun resumes there")
    p.add_argument("--num-layers", type=int, default=None, help="middle memory layers (default: the paper's rule)")
    p.add_argument("--layers", type=int, nargs="+", default=None, help="explicit block indices")
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--no-output-layer", action="store_true")
    p.add_argument(
        "--output-target",
        choices=("embedding", "residual"),
        default="embedding",
        help="the output layer present while training (default: the paper's, as for the shipped readout)",
    )
    p.add_argument("--seq-len", type=int, default=256, help="tokens per learned window and per predicted window")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--shuffle-buffer", type=int, default=512)
    p.add_argument(
        "--pairs", default="next-window", choices=["next-window", "same-domain"],
        help="next-window: learn a window, predict the next window of the same document; same-domain: learn windows "
        "of other documents of the same --text-files pattern (one pattern = one domain) and predict this one",
    )  # fmt: skip
    p.add_argument("--steps-per-domain", type=int, default=8)
    for field_name, default in (("steps", 500), ("lr", 1e-3), ("warmup_steps", 20), ("discount", 0.9),
                                ("checkpoint_every", 50), ("weight_decay", 0.0), ("seed", 0)):  # fmt: skip
        p.add_argument("--" + field_name.replace("_", "-"), type=type(default), default=default)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    return p


def main(argv: list[str] | None = None) -> int:
    from . import corpus
    from .config import EmbeddingOutput, FaastConfig, MiddleLayers, Regulariser, ResidualOutput
    from .default import load_base_model
    from .model import apply_faast

    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    base, tokenizer, name = load_base_model(args.model, gguf_file=args.gguf_file, dtype=getattr(torch, args.dtype))
    output = {"embedding": EmbeddingOutput, "residual": ResidualOutput}[args.output_target]()
    config = FaastConfig(
        output=None if args.no_output_layer else output,
        middle=MiddleLayers(num_layers=args.num_layers, layers=args.layers),
        regulariser=Regulariser(alpha=args.alpha),
        base_model=name,
    )
    # A causal LM without target_modules: apply_faast wraps it in a FaastModel (train_readout refuses anything else).
    model = cast(FaastModel, apply_faast(base, config))
    train_config = TrainConfig(
        steps=args.steps, lr=args.lr, warmup_steps=args.warmup_steps, discount=args.discount,
        checkpoint_every=args.checkpoint_every, weight_decay=args.weight_decay, seed=args.seed,
        checkpoint_dir=args.checkpoint_dir or str(Path(args.output) / "checkpoints"),
    )  # fmt: skip

    def documents() -> Iterator[tuple[str, str]]:
        if args.text_files:
            return corpus.read_text_files(args.text_files, min_chars=64, shuffle_seed=args.seed)
        return corpus.read_dataset(
            args.dataset, config=args.dataset_config, split=args.split, text_column=args.text_column
        )

    def stream(start: int) -> Iterator[dict]:
        if args.pairs == "same-domain":
            if not args.text_files:
                raise SystemExit("--pairs same-domain needs --text-files (each pattern is one domain)")
            groups = [list(corpus.read_text_files([pattern], min_chars=64)) for pattern in args.text_files]
            batches: Iterator[dict[str, torch.Tensor]] = (
                corpus.collate(b)
                for b in corpus.domain_pairs(groups, tokenizer, args.seq_len, batch_size=args.batch_size,
                                             steps_per_domain=args.steps_per_domain, seed=args.seed)
            )  # fmt: skip
        else:
            pairs = corpus.shuffled(
                corpus.window_pairs(documents(), tokenizer, args.seq_len), args.shuffle_buffer, args.seed
            )
            batches = corpus.batches(pairs, args.batch_size)
        for _ in range(start):  # deterministic stream: skipping reproduces the uninterrupted order
            next(batches, None)
        return batches

    history = train_readout(model, stream, train_config)
    model.reset_fast_weights()
    model.save_pretrained(args.output)
    record = {"config": model.faast_config.to_dict(), "train": asdict(train_config), "argv": argv or [],
              "history": history}  # fmt: skip
    (Path(args.output) / "training_log.json").write_text(json.dumps(record, indent=1))
    print(f"faast: wrote {args.output} after {len(history)} logged steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
