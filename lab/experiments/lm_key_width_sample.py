"""The residual output layer's solve at 32K tokens with the key width chosen on a sample of the held-out rows
(shipped) against the choice on every row (previous), in the same process on the same learned statistics.

    python -m faast_lab.experiments.lm_key_width_sample --cache /tmp/faast_layers \
        --domains email multiprocessing licenses

For each domain, FaastConfig()'s model (SmolLM2, keys h̃ and an early block's input) learns the domain's first
`--tokens` tokens as lab/experiments/lm_domains.py learns them; its residual output layer is then kept (in --cache, so
a rerun solves without learning again). Each repetition solves a fresh copy of it under each variant, in a rotating
order:

- `previous`: both widths formed and tuned on every held-out row (the layer given an OutputPolicy whose
  width_sample_min_rows is above their number) and the key solves through the spectrum (FAAST_BACKEND=eigh=torch),
  as before;
- `sample`: the width chosen on the sample, the key solves still through the spectrum;
- `shipped`: the width chosen on the sample, and the key solves by Cholesky where nothing is cut.

The table gives each one's median solve time, the width, step and weight it chose, and the held-out NLL on every row
at its choice (nats, what the layer reads).
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import time
from pathlib import Path

from faast import provenance
from faast_lab.experiments._common import RESULTS, ROOT

VARIANTS = ("previous", "sample", "shipped")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", type=Path, required=True, help="folder of learned layers (read, or written when absent)")
    p.add_argument("--domains", nargs="+", default=["email", "multiprocessing", "licenses"])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--out", default="lm_key_width_sample_cpu")
    return p.parse_args(argv)


def learned_layer(name: str, args: argparse.Namespace, base, tokenizer) -> bytes:  # noqa: ANN001
    """The residual output layer of FaastConfig()'s model after learning the domain's first tokens, serialised."""
    import torch

    from faast.hf import FaastConfig, apply_faast
    from faast.hf.tokens import token_lists
    from faast_lab.experiments.domains import domain_texts

    path = args.cache / f"layer_{name}_{args.tokens}.pt"
    if not path.exists():
        learn, _ = domain_texts(name)
        model = apply_faast(base, FaastConfig())
        try:
            model.learn(token_lists(learn, tokenizer, args.tokens), max_length=1024, batch_size=2)
            args.cache.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".partial")
            torch.save(model.output_memory_layer, partial)
            partial.replace(path)  # a cache file is whole or absent
        finally:
            model.remove_faast()
    return path.read_bytes()


def solve(blob: bytes, variant: str) -> dict:
    """A fresh copy of the learned layer solved under `variant`: its time, choice and held-out NLL on every row."""
    import dataclasses

    import torch

    from faast.hf import OutputPolicy
    from faast.hf.output import tuning

    layer = torch.load(io.BytesIO(blob), weights_only=False)
    policy = OutputPolicy()
    # every layer is given its policy: a layer cached before the policy existed has none
    layer.policy = dataclasses.replace(policy, width_sample_min_rows=10**9) if variant == "previous" else policy
    backend = os.environ.get("FAAST_BACKEND")
    if variant != "shipped":
        os.environ["FAAST_BACKEND"] = "eigh=torch"
    try:
        started = time.perf_counter()
        layer.solution(torch.device("cpu"), torch.float32)
        seconds = time.perf_counter() - started
    finally:
        if backend is None:
            os.environ.pop("FAAST_BACKEND", None)
        else:
            os.environ["FAAST_BACKEND"] = backend
    info = layer.last_tuning
    # The held-out NLL on every row at the choice, as the layer reads it: from the diagnosis's mean gain.
    keys, ys, *_ = layer.step_choice().tail_statistics()
    z0, target0 = layer.step_choice().tail_base(keys, ys)
    log_base = tuning.base_log_targets((z0, None, target0, None))
    base_nll = float(-log_base.mean())
    return {"variant": variant, "seconds": seconds, "key_width": info["key_width"], "step": info["step"],
            "weight": info["weight"], "held_out_rows": int(keys.shape[0]),
            "held_out_nll": base_nll if info["off"] else base_nll - info["held_out_gain"], "base_nll": base_nll,
            "by_key_width": info.get("by_key_width", {})}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    from faast.hf.default import load_base_model

    args = parse_args(argv)
    record = provenance.start(ROOT)
    base, tokenizer, description = load_base_model("smollm2")
    rows: list[dict] = []
    for name in args.domains:
        blob = learned_layer(name, args, base, tokenizer)
        runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
        for repeat in range(args.repeats):
            for variant in VARIANTS[repeat % 3 :] + VARIANTS[: repeat % 3]:
                runs[variant].append(solve(blob, variant))
        for variant, results in runs.items():
            last = results[-1]
            row = {"domain": name, "tokens": args.tokens, **last,
                   "seconds_all": [r["seconds"] for r in results],
                   "seconds": statistics.median(r["seconds"] for r in results)}  # fmt: skip
            rows.append(row)
            print(f"{name:>15} {variant:>8}: {row['seconds']:.2f} s  width {row['key_width']}  η {row['step']:.4f}  "
                  f"NLL {row['held_out_nll']:.5f}", flush=True)  # fmt: skip
    lines = [f"Median of {args.repeats} solves each, rotating order, on 2 torch threads. NLL: mean held-out NLL on"
             " every held-out row at the variant's choice (nats); base: the model without the memory.", "",
             "| domain | variant | solve s | ratio | key width | step | weight | held-out NLL | base NLL |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        previous = next(p for p in rows if p["domain"] == r["domain"] and p["variant"] == "previous")
        lines.append(f"| {r['domain']} | {r['variant']} | {r['seconds']:.2f} | "
                     f"{previous['seconds'] / r['seconds']:.2f}× | {r['key_width']} | {r['step']:.4f} | "
                     f"{r['weight']:.3g} | {r['held_out_nll']:.5f} | {r['base_nll']:.5f} |")  # fmt: skip
    settings = {k: str(v).replace(str(ROOT) + "/", "") for k, v in vars(args).items()}
    payload = {"model": description, "settings": settings, "rows": rows}
    title = "The key width chosen on a sample of the held-out rows: the solve at 32K tokens"
    provenance.write(args.results_dir / args.out, record, payload, title, lines)
    return payload


if __name__ == "__main__":
    main()
