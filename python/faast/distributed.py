"""Data-parallel learning: sum the fast-weight statistics of every rank.

The statistics S, T, N and the GCV statistic are sums over rows, so learning a sharded corpus on R ranks and adding
the R partial sums gives the statistics of the whole corpus: the solved weights equal a single-process run up to
float64 rounding of the different summation order. `all_reduce` does that addition with torch.distributed (NCCL on
GPUs, gloo on CPU), packing the tensors of many memories into a few flat buckets so that a model with dozens of
memory layers costs a handful of collectives, not one per layer and tensor.

Call it once, after every rank has learned its shard: afterwards each rank holds the total, so a second call would
count every row R times. To continue learning afterwards, learn into memories reset on all ranks but one, or keep a
local memory per rank and all-reduce a copy.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

from .memory import FastWeights

T = TypeVar("T")

# Tensors summed across ranks, per memory, in this order (the prior and the configuration are identical everywhere).
_SUMMED = ("gram", "cross", "count", "target_sqnorm", "num_dropped")
DEFAULT_BUCKET_MB = 256.0


def find_memories(obj: object) -> list[tuple[str, FastWeights]]:
    """The FastWeights held by `obj` with their names: a FastWeights, a module containing some, or a list of them.

    A memory shared by two parents appears once (nn.Module.named_modules deduplicates), so it is summed once.
    """
    if isinstance(obj, FastWeights):
        return [("", obj)]
    if isinstance(obj, nn.Module):
        found = [(name, m) for name, m in obj.named_modules() if isinstance(m, FastWeights)]
    elif isinstance(obj, list | tuple):
        if not all(isinstance(m, FastWeights) for m in obj):
            bad = next(type(m).__name__ for m in obj if not isinstance(m, FastWeights))
            raise TypeError(f"obj: expected a list of faast.FastWeights, found a {bad}")
        seen: dict[int, tuple[str, FastWeights]] = {}
        for i, m in enumerate(obj):
            seen.setdefault(id(m), (str(i), m))
        found = list(seen.values())
    else:
        raise TypeError(
            "obj: expected a faast.FastWeights, an nn.Module containing some, or a list of them; "
            f"got {type(obj).__name__}"
        )
    if not found:
        raise ValueError(f"obj: the {type(obj).__name__} holds no faast.FastWeights to reduce")
    return found


def _fingerprint(memories: list[tuple[str, FastWeights]]) -> str:
    """A description of what is summed; ranks whose descriptions differ would add unrelated numbers."""
    parts = []
    for name, m in memories:
        prior = None
        if m.prior is not None:
            prior = hashlib.sha256(m.prior.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
        parts.append({"name": name, "config": m.config(), "prior": prior})
    return json.dumps(parts, sort_keys=True)


def _check_group(group: object) -> None:
    if not dist.is_available():
        raise RuntimeError("faast.distributed: this torch build has no torch.distributed support")
    if not dist.is_initialized():
        raise RuntimeError(
            "faast.distributed.all_reduce: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group (torchrun sets the environment it needs) before reducing"
        )


def _local_problem(memories: list[tuple[str, FastWeights]], group: object) -> str | None:
    """Why this rank's memories cannot be reduced, or None. Checked here, reported after the probe collective."""
    devices = {m.device for _, m in memories}
    if len(devices) != 1:
        return f"obj: all memories must be on one device to be reduced together, found {sorted(map(str, devices))}"
    for name, m in memories:
        if m.mode != "exact":
            return f"obj: memory {name or '<root>'} has mode={m.mode!r}; only mode='exact' statistics add across ranks"
    if dist.get_backend(group) == "nccl" and next(iter(devices)).type != "cuda":
        return f"obj: the NCCL backend reduces CUDA tensors, but the memories are on {next(iter(devices))}; move them"
    return None


def _probe_device(group: object) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree(memories: list[tuple[str, FastWeights]], group: object) -> None:
    """One small collective before any data moves, so that a problem on one rank fails every rank instead of
    leaving the others blocked in a collective it never joins, or summing unrelated numbers."""
    problem = _local_problem(memories, group)
    if problem is None:
        text = _fingerprint(memories)
        digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")
    else:
        digest = -1 - dist.get_rank()  # negative and distinct per rank: can never look like agreement
    # MAX of (h, -h) gives (max h, -min h) in one call: all ranks agree iff max == min.
    probe = torch.tensor([digest, -digest], dtype=torch.int64, device=_probe_device(group))
    dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=group)
    if problem is not None:
        raise ValueError(problem + "; nothing was reduced")
    if int(probe[0]) != -int(probe[1]):
        rank = dist.get_rank()
        raise ValueError(
            f"obj: ranks hold memories with different names, shapes or configuration, or another rank failed its "
            f"checks (rank {rank} has: {[(n or '<root>', m.dim_key, m.dim_value, m.batch_shape) for n, m in memories]}"
            "); every rank must build the same memories with the same arguments; nothing was reduced"
        )


def _buckets(tensors: list[torch.Tensor], cap_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive tensors of one dtype, packed up to cap_bytes; a tensor larger than the cap is a bucket alone."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for t in group:
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > cap_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append(t)
            size += nbytes
        if bucket:
            yield bucket


@torch.no_grad()
def all_reduce(obj: T, group: dist.ProcessGroup | None = None, *, bucket_mb: float = DEFAULT_BUCKET_MB) -> T:
    """Sum the statistics (S, T, N, the GCV statistic, dropped-row counts) of `obj` across the ranks of `group`.

    Args:
        obj: a faast.FastWeights, an nn.Module containing FastWeights (e.g. a faast model), or a list of them. Every
            rank must hold the same memories, identically configured; all in mode='exact' and on one device (CUDA
            for NCCL).
        group: the process group (default: the world).
        bucket_mb: tensors are packed into flat buckets of at most this many MiB (one all_reduce per bucket); a
            tensor larger than that is reduced in place on its own, without a copy.

    Returns `obj`, reduced in place: every rank then holds the statistics of all ranks' rows. Raises before reducing
    anything if torch.distributed is not initialized or the ranks' memories differ.

    Exact for discount=1 (the default). With a per-update discount γ < 1 each rank discounts only its own history,
    so the sum weights rows differently from a single sequential stream.
    """
    _check_group(group)
    if not isinstance(bucket_mb, int | float) or isinstance(bucket_mb, bool) or not bucket_mb > 0:
        raise ValueError(f"bucket_mb: expected a positive number, got {bucket_mb!r}")
    memories = find_memories(obj)
    _agree(memories, group)
    tensors = [getattr(m, name) for _, m in memories for name in _SUMMED]
    for bucket in _buckets(tensors, int(bucket_mb * (1 << 20))):
        if len(bucket) == 1:
            dist.all_reduce(bucket[0], group=group)  # buffers are contiguous: reduce in place, no copy
            continue
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.all_reduce(flat, group=group)
        offset = 0
        for t in bucket:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
    for _, m in memories:
        m._changed()
    return obj


def shard(items: Iterable[T], *, rank: int | None = None, world_size: int | None = None) -> Iterator[T]:
    """Every world_size-th item of `items`, starting at `rank` (defaults: this process's rank and the world size).

    Streams: nothing is materialised. A rank whose shard is empty yields nothing and can still join all_reduce.
    """
    if rank is None or world_size is None:
        initialized = dist.is_available() and dist.is_initialized()
        rank = (dist.get_rank() if initialized else 0) if rank is None else rank
        world_size = (dist.get_world_size() if initialized else 1) if world_size is None else world_size
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank: expected an int in [0, {world_size}), got {rank!r}")
    for i, item in enumerate(items):
        if i % world_size == rank:
            yield item
