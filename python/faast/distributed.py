"""Data-parallel learning: sum the fast-weight statistics of every rank.

The statistics S, T, N and the GCV statistic are sums over rows, as are the sums of a faast.Accumulator, so learning
a sharded corpus on R ranks and adding the R partial sums gives the statistics of the whole corpus: the solved weights
equal a single-process run up to float64 rounding of the different summation order. `all_reduce` does that addition
with torch.distributed (NCCL on GPUs, gloo on CPU), packing the tensors of many memories into a few flat buckets so
that a model with dozens of memory layers costs a handful of collectives, not one per layer and tensor.

Call it once, after every rank has learned its shard: afterwards each rank holds the total, so a second call would
count every row R times. To continue learning afterwards, learn into memories reset on all ranks but one, or keep a
local memory per rank and all-reduce a copy.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar, overload

import torch
import torch.distributed as dist
from torch import nn

from .statistics import SummedStatistics

T = TypeVar("T")
S = TypeVar("S", bound=SummedStatistics)

DEFAULT_BUCKET_MB = 256.0


@overload
def find_memories(obj: object) -> list[tuple[str, SummedStatistics]]: ...


@overload
def find_memories(obj: object, kind: type[S]) -> list[tuple[str, S]]: ...


def find_memories(obj: object, kind: type[Any] = SummedStatistics) -> list[tuple[str, Any]]:
    """The statistics modules held by `obj` with their names: a faast.FastWeights or faast.Accumulator, a module
    containing some, or a list of them.

    Every faast.SummedStatistics is found (FastWeights and Accumulators alike: both are summed, checkpointed and
    restored); kind=faast.FastWeights keeps only the memories, kind=faast.Accumulator only the accumulators. A
    module shared by two parents appears once (nn.Module.named_modules deduplicates), so it is summed once.
    """
    if not (isinstance(kind, type) and issubclass(kind, SummedStatistics)):
        raise TypeError(f"kind: expected faast.SummedStatistics or a subclass, got {kind!r}")
    if isinstance(obj, SummedStatistics):
        found = [("", obj)] if isinstance(obj, kind) else []
    elif isinstance(obj, nn.Module):
        found = [(name, m) for name, m in obj.named_modules() if isinstance(m, kind)]
    elif isinstance(obj, list | tuple):
        if not all(isinstance(m, SummedStatistics) for m in obj):
            bad = next(type(m).__name__ for m in obj if not isinstance(m, SummedStatistics))
            raise TypeError(f"obj: expected a list of faast.FastWeights or faast.Accumulator, found a {bad}")
        seen: dict[int, tuple[str, SummedStatistics]] = {}
        for i, m in enumerate(obj):
            if isinstance(m, kind):
                seen.setdefault(id(m), (str(i), m))
        found = list(seen.values())
    else:
        raise TypeError(
            "obj: expected a faast.FastWeights, an nn.Module containing some, or a list of them; "
            f"got {type(obj).__name__}"
        )
    if not found:
        what = "faast.FastWeights or faast.Accumulator" if kind is SummedStatistics else f"faast.{kind.__name__}"
        raise ValueError(f"obj: the {type(obj).__name__} holds no {what} to reduce")
    return found


def _fingerprint(memories: list[tuple[str, SummedStatistics]]) -> str:
    """A description of what is summed; ranks whose descriptions differ would add unrelated numbers."""
    parts = []
    for name, m in memories:
        fixed = {
            key: hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
            for key, t in m.fixed_tensors().items()
        }
        parts.append({"name": name, "format": m.FORMAT, "config": m.config(), "fixed": fixed})
    return json.dumps(parts, sort_keys=True)


def _check_group(group: dist.ProcessGroup | None) -> None:
    if not dist.is_available():
        raise RuntimeError("faast.distributed: this torch build has no torch.distributed support")
    if not dist.is_initialized():
        raise RuntimeError(
            "faast.distributed.all_reduce: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group (torchrun sets the environment it needs) before reducing"
        )


def _local_problem(memories: list[tuple[str, SummedStatistics]], group: dist.ProcessGroup | None) -> str | None:
    """Why this rank's memories cannot be reduced, or None. Checked here, reported after the probe collective."""
    devices = {m.device for _, m in memories}
    if len(devices) != 1:
        return f"obj: all memories must be on one device to be reduced together, found {sorted(map(str, devices))}"
    for name, m in memories:
        reason = m.not_summable_reason()
        if reason is not None:
            return f"obj: memory {name or '<root>'} {reason}"
    if dist.get_backend(group) == "nccl" and next(iter(devices)).type != "cuda":
        return f"obj: the NCCL backend reduces CUDA tensors, but the memories are on {next(iter(devices))}; move them"
    return None


def _probe_device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree(memories: list[tuple[str, SummedStatistics]], group: dist.ProcessGroup | None) -> None:
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
        held = [(n or "<root>", [list(t.shape) for t in m.summed_tensors()]) for n, m in memories]
        raise ValueError(
            f"obj: ranks hold memories with different names, shapes or configuration, or another rank failed its "
            f"checks (rank {dist.get_rank()} has, per memory, the shapes of its sums: {held}); every rank must build "
            "the same memories with the same arguments; nothing was reduced"
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
    """Sum the statistics (S, T, N, the GCV statistic, dropped-row counts; an Accumulator's sums and count) of `obj`
    across the ranks of `group`.

    Args:
        obj: a faast.FastWeights or faast.Accumulator, an nn.Module containing some (e.g. a faast model), or a list
            of them (see find_memories). Every rank must hold the same ones, identically configured; memories in
            mode='exact'; all on one device (CUDA for NCCL).
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
    tensors = [t for _, m in memories for t in m.summed_tensors()]
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
        m.mark_changed()
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
