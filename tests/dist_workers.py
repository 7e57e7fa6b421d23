"""Code that runs inside the gloo processes of test_distributed.py (spawned, so it lives in an importable module)."""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import faast
from faast import distributed

NUM_BATCHES = 7


class Layers(nn.Module):
    """A stand-in for a faast model: several memories of different shapes, one layer-batched, one with a prior, and
    an Accumulator of plain sums (as the residual output layer keeps its curvature and token mass)."""

    def __init__(self, dim_key: int = 12, alpha: float = 1.0) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            [faast.FastWeights(dim_key, 5, batch_shape=(3,)), faast.FastWeights(dim_key, 7, alpha=alpha)]
        )
        self.output = faast.FastWeights(dim_key, dim_key, prior="identity", prior_count=4.0, drop_nonfinite=True)
        self.sums = faast.Accumulator({"gram": (dim_key, dim_key), "mass": (7,)})
        self.head = nn.Linear(2, 2)  # not a memory: must be left alone


def batch(i: int) -> dict[str, torch.Tensor]:
    """Batch i of the synthetic corpus, the same on every rank; sizes vary and batch 3 holds a NaN row."""
    g = torch.Generator().manual_seed(1000 + i)
    n = 5 + 3 * i
    data = {
        "k3": torch.randn(3, n, 12, generator=g, dtype=torch.float64),
        "v3": torch.randn(3, n, 5, generator=g, dtype=torch.float64),
        "k": torch.randn(n, 12, generator=g, dtype=torch.float64),
        "v": torch.randn(n, 7, generator=g, dtype=torch.float64),
        "s": torch.rand(n, generator=g, dtype=torch.float64),
        "vo": torch.randn(n, 12, generator=g, dtype=torch.float64),
    }
    if i == 3:
        data["vo"][1, 4] = float("nan")
    return data


def learn(model: Layers, indices) -> None:
    for i in indices:
        b = batch(i)
        model.blocks[0].update(b["k3"], b["v3"])
        model.blocks[1].update(b["k"], b["v"], b["s"])
        model.output.update(b["k"], b["vo"])
        model.sums.add(count=b["k"].shape[0], gram=b["k"].T @ b["k"], mass=b["v"].sum(0))


def run(rank: int, world_size: int, init_file: str, out_dir: str, scenario: str, bucket_mb: float) -> None:
    """One rank: learn its shard, all-reduce, save what it holds (or the error it raised) to out_dir."""
    out = Path(out_dir)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        torch.set_num_threads(1)
        # "mismatch": one rank configures a memory differently; summing would mix estimators silently.
        model = Layers(alpha=0.5 if (scenario == "mismatch" and rank == 1) else 1.0)
        if scenario == "blend" and rank == world_size - 1:
            model.blocks[1] = faast.FastWeights(12, 7, mode="blend")
        # "empty": fewer batches than ranks, so the last rank learns nothing and still joins the collectives.
        learn(model, distributed.shard(range(2 if scenario == "empty" else NUM_BATCHES)))
        distributed.all_reduce(model, bucket_mb=bucket_mb)
        state = {k: v for k, v in model.state_dict().items() if not k.startswith("head.")}
        weights = {f"{n}.W": m.weights for n, m in distributed.find_memories(model, faast.FastWeights)}
        torch.save({"state": state, "weights": weights}, out / f"rank{rank}.pt")
    except Exception as err:  # noqa: BLE001 - the parent test inspects the error
        (out / f"rank{rank}.err").write_text(f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os._exit(0)
