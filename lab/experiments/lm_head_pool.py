"""The pooled p·H of the residual output layer's learning on cached states (ResidualOutput.head_pool_below,
docs/design.md §6.3): for each pooling threshold, the share of the vocabulary a block of positions keeps, the error
of the learned gradients r = H[y] − pH and of Σ μμᵀ against float64 products, and the time of the head products
in `--products` (float32, what a CPU without native bfloat16 or AVX2 forms; bfloat16, what 'auto' forms where it is
native; int8, the logits alone, p·H float32).

    python -m faast_lab.experiments.lm_output_states --cache /tmp/faast_states
    python -m faast_lab.experiments.lm_head_pool --cache /tmp/faast_states --domains email asyncio

The positions go through faast.hf.output.head.head_gradients in batches of `--batch` rows, as learn passes a batch of 8
windows of 256 tokens, so the blocks that decide what is pooled are the ones learning forms (`--chunk` positions,
head_gradients' own by default). The threshold's effect on held-out perplexity is lm_output_variants.py's
`--head-pool-below`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from faast import provenance
from faast_lab.experiments._common import RESULTS, ROOT, ModelLoader, table

POOLS = (0.0, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", type=Path, required=True)
    p.add_argument("--domains", nargs="+", default=["email", "asyncio"])
    p.add_argument("--pools", default=",".join(f"{x:g}" for x in POOLS), help="thresholds, 0 (exact) first")
    p.add_argument("--positions", type=int, default=8160, help="learned positions per domain, from the start")
    p.add_argument("--batch", type=int, default=2040, help="positions per head_gradients call (8 × 255)")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per threshold (the median is reported)")
    p.add_argument("--products", choices=("float32", "bfloat16", "int8"), default="float32",
                   help="the head products' dtype")  # fmt: skip
    # The head's own settings unless given (None): what learning runs.
    p.add_argument("--chunk", type=int, help="positions per block, what pooling decides on (default READ_CHUNK)")
    p.add_argument("--outliers", type=int, help="key columns int8 logits multiply in float32 (default INT8_OUTLIERS)")
    p.add_argument("--dense-share", type=float, help="OutputPolicy.pool_dense_share (default the shipped policy's)")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--out", default="lm_head_pool_cpu")
    return p.parse_args(argv)


def exact(weight, keys, targets, batch: int, block: int):  # noqa: ANN001, ANN201
    """(r [n, d], Σ μμᵀ [d, d]) in float64, and each block's largest probability per column [V] float32, in the
    blocks head_gradients forms: `block` rows at a time within each `batch`-row call."""
    import torch

    w64 = weight.double()
    grads, gram, peaks = [], torch.zeros(w64.shape[1], w64.shape[1], dtype=torch.float64), []
    for i in range(0, len(targets), batch):
        for j in range(i, min(i + batch, len(targets)), block):
            end = min(j + block, i + batch, len(targets))
            p = torch.softmax(keys[j:end].double() @ w64.T, -1)
            mu = p @ w64
            grads.append(w64[targets[j:end]] - mu)
            gram += mu.T @ mu
            peaks.append(p.amax(0).float())
    return torch.cat(grads), gram, peaks


def run(head, keys, targets, pool: float, products, args: argparse.Namespace, policy):  # noqa: ANN001, ANN201
    """head_gradients over the positions in calls of args.batch rows with `products` (a torch dtype) and `policy` (an
    OutputPolicy), in blocks of args.chunk, their buffers and cast weights shared by the calls as within one learn()
    call: (r [n, d], Σ μμᵀ, seconds)."""
    import torch

    from faast.hf.output.head import HeadBuffers, head_gradients

    batch = args.batch
    started = time.perf_counter()
    grads, gram, buffers = [], 0, HeadBuffers()
    with buffers.kept():
        for i in range(0, len(targets), batch):
            k, y = keys[i : i + batch][None], targets[i : i + batch][None]
            mask = torch.ones_like(y, dtype=torch.bool)
            g, m, _ = head_gradients(head, k, y, mask, products, pool=pool, buffers=buffers, policy=policy,
                                     chunk=args.chunk, outliers=args.outliers)  # fmt: skip
            grads.append(g[0])
            gram = gram + m
    return torch.cat(grads), gram, time.perf_counter() - started


def cells(row: dict) -> list[str]:
    return [row["domain"], f"{row['pool']:g}", f"{100 * row['kept_share']:.1f}%", f"{row['r_rel']:.2e}",
            f"{row['gram_rel']:.2e}", f"{row['gradient_sum_rel']:.1e}", f"{row['seconds']:.2f} s",
            f"{row['time_ratio']:.2f}×"]  # fmt: skip


def main(argv: list[str] | None = None, *, load_model: ModelLoader | None = None) -> dict:
    """Run the probe with `argv`'s options on the head of the model load_model gives (default
    faast.hf.default.load_base_model)."""
    import torch

    from faast.hf import OutputPolicy
    from faast.hf.default import load_base_model
    from faast.hf.output.head import READ_CHUNK

    args = parse_args(argv)
    policy = OutputPolicy() if args.dense_share is None else OutputPolicy(pool_dense_share=args.dense_share)
    pools = [float(x) for x in args.pools.split(",")]
    products = getattr(torch, args.products)
    if pools[0] != 0:
        raise SystemExit("--pools: the first threshold must be 0, the exact products the others are timed against")
    record = provenance.start(ROOT)
    base, _, description = (load_model or load_base_model)("smollm2")
    head = base.get_output_embeddings()
    weight = head.weight.detach().float()
    rows = []
    for name in args.domains:
        keys, targets = torch.load(args.cache / f"{name}.pt")["learn"]
        keys, targets = keys[: args.positions].float(), targets[: args.positions]
        r64, gram64, peaks = exact(weight, keys, targets, args.batch, args.chunk or READ_CHUNK)
        run(head, keys[: args.batch], targets[: args.batch], pools[0], products, args, policy)  # warm allocator, BLAS
        base_s = None
        for pool in pools:
            timed = [run(head, keys, targets, pool, products, args, policy) for _ in range(args.repeats)]
            grads, gram, _ = timed[0]
            seconds = statistics.median(t[2] for t in timed)
            base_s = seconds if base_s is None else base_s
            kept = [float((peak >= pool).float().mean()) for peak in peaks]
            rows.append({"domain": name, "pool": pool, "positions": len(targets), "kept_share": statistics.mean(kept),
                         "r_rel": float((grads.double() - r64).norm() / r64.norm()),
                         "gram_rel": float((gram - gram64).norm() / gram64.norm()),
                         "gradient_sum_rel": float((grads.double().sum(0) - r64.sum(0)).norm() / r64.sum(0).norm()),
                         "seconds": seconds, "time_ratio": seconds / base_s})  # fmt: skip
            print(f"{name:>15} pool {pool:<7g} kept {100 * rows[-1]['kept_share']:5.1f}%  r {rows[-1]['r_rel']:.2e}  "
                  f"{seconds:.2f} s ({seconds / base_s:.2f}×)", flush=True)  # fmt: skip
    settings = {k: str(v).replace(str(ROOT) + "/", "") for k, v in vars(args).items()}
    payload = {"model": description, "settings": settings, "rows": rows}
    markdown = [
        f"{description}: the first {args.positions:,} learned positions per domain, in calls of {args.batch} rows. "
        "`kept`: the mean share of the vocabulary a block keeps; `r error` and `Σμμᵀ error`: relative to float64 "
        "products (Frobenius); `Σr error`: of the gradient sum; time: median of "
        f"{args.repeats} passes of the {args.products} head products (their buffers shared by the calls, as in one "
        "learn() call), and its ratio to the exact products'.",
        "",
        *table(
            ["domain", "pool below", "kept", "r error", "Σμμᵀ error", "Σr error", "time", "× exact"],
            [cells(r) for r in rows],
        ),  # fmt: skip
    ]
    provenance.write(args.results_dir / args.out, provenance.finish(record), payload,
                     "Residual output layer: pooled p·H on cached states", markdown)  # fmt: skip
    return payload


if __name__ == "__main__":
    main()
