"""Checkpoint and resume long learning runs.

A run that learns 10^8 rows takes hours; a crash must cost minutes, and resuming must give exactly the state an
uninterrupted run would have. The state of a learning run is small and complete: the statistics of every memory
(O(d²) each; a faast.Accumulator's sums alike) plus the position in the data stream. `Checkpointer` writes both to
one safetensors file per checkpoint (atomically: temporary file, fsync, rename, so a process killed while writing
leaves the previous checkpoint as the newest intact one), verifies a checksum on read, and never executes code when
loading. `learn_stream` drives a learning loop with periodic checkpoints and resumes from the newest one.

Resuming is bitwise exact: the restored statistics are the saved float64 bytes, and the remaining batches are
applied by the same updates in the same order. Under torch.distributed each rank writes its own files (the rank is
in the name); ranks resume independently, which is exact because their partial statistics are only summed at the
end (faast.distributed.all_reduce).
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import cast

import torch.distributed as dist
from torch import nn

from ._version import __version__
from .distributed import find_memories
from .memory import FastWeights
from .ops._validate import require_nonnegative_number, require_positive_int
from .persist import CorruptFileError, read_verified, write_atomic
from .statistics import SummedStatistics

FORMAT = "faast.Checkpoint"
FORMAT_VERSION = 1
_log = logging.getLogger("faast")

Batch = object
Step = Callable[[object, Batch], "int | None"]


def _distributed_rank_and_size() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Checkpointer:
    """Periodic, atomic checkpoints of the memories in a learning run and of the run's position.

    Args:
        directory: where the files go (created if missing). One writer per (directory, name, rank).
        keep: how many of this rank's newest checkpoints to keep (older ones are deleted after a save succeeds).
        name: file name prefix.
        rank, world_size: default to torch.distributed's when it is initialized, else 0 and 1. A checkpoint is only
            restored by the same rank of a run with the same world size (the shards would differ otherwise).

    Files are named ``{name}-rank{rank:05d}-batch{batches:015d}.safetensors``.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        keep: int = 2,
        name: str = "checkpoint",
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.keep = require_positive_int("keep", keep)
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.]+", name):
            raise ValueError(f"name: expected letters, digits, '_' or '.', got {name!r}")
        self.name = name
        default_rank, default_size = _distributed_rank_and_size()
        self.world_size = require_positive_int("world_size", default_size if world_size is None else world_size)
        self.rank = default_rank if rank is None else rank
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank: expected an int in [0, {self.world_size}), got {self.rank!r}")
        self._pattern = re.compile(rf"{re.escape(name)}-rank{self.rank:05d}-batch(\d+)\.safetensors")

    def path(self, batches: int) -> Path:
        return self.directory / f"{self.name}-rank{self.rank:05d}-batch{batches:015d}.safetensors"

    def checkpoints(self) -> list[Path]:
        """This rank's checkpoint files, newest (most batches) first."""
        if not self.directory.is_dir():
            return []
        found = []
        for p in self.directory.iterdir():
            m = self._pattern.fullmatch(p.name)
            if m:
                found.append((int(m.group(1)), p))
        return [p for _, p in sorted(found, reverse=True)]

    # ------------------------------------------------------------------ writing

    def save(self, obj: object, position: Mapping[str, object]) -> Path:
        """Write the statistics of every memory in `obj` and `position` (JSON-serialisable; must hold an int
        'batches', the number of batches consumed) as a new checkpoint, atomically; then prune to `keep`."""
        batches = position.get("batches") if isinstance(position, Mapping) else None
        if not isinstance(batches, int) or isinstance(batches, bool) or batches < 0:
            raise ValueError(f"position: expected a mapping with a non-negative int 'batches', got {position!r}")
        try:
            position_json = json.dumps(dict(position), sort_keys=True)
        except (TypeError, ValueError) as err:
            raise ValueError(f"position: must be JSON-serialisable ({err})") from None
        path = _write(self.path(batches), obj, position_json, self.rank, self.world_size)
        for old in self.checkpoints()[self.keep :]:
            old.unlink(missing_ok=True)
        return path

    # ------------------------------------------------------------------ reading

    def _remove_stale_temporaries(self) -> None:
        # A writer killed between creating its temporary file and the rename leaves `.{final name}.{pid}.{id}.tmp`.
        # Only this (rank, name) writes such names, so at restore time they are garbage.
        if not self.directory.is_dir():
            return
        prefix = f".{self.name}-rank{self.rank:05d}-batch"
        for p in self.directory.iterdir():
            if p.name.startswith(prefix) and p.name.endswith(".tmp"):
                p.unlink(missing_ok=True)

    def _read(
        self,
        path: Path,
        memories: list[tuple[str, SummedStatistics]],
        *,
        same_run: bool = True,
        optional: frozenset[str] = frozenset(),
    ) -> tuple[dict, list]:
        """Validate a checkpoint against `memories` without touching them. Returns (position, [(memory, tensors,
        source)]). same_run: also require this checkpointer's world size (needed to resume a sharded stream).
        optional: names of `memories` a file may lack (written before their owner kept them; see _optional_in_files):
        they load empty."""
        tensors, metadata = read_verified(path)
        if metadata.get("format") != FORMAT:
            raise ValueError(f"{path}: not a {FORMAT} file (format={metadata.get('format')!r})")
        try:
            version = int(metadata["format_version"])
            world_size = int(metadata["world_size"])
            position = json.loads(metadata["position"])
            saved = json.loads(metadata["memories"])
        except (ValueError, KeyError) as err:
            raise ValueError(f"{path}: malformed {FORMAT} metadata ({err!r})") from None
        if version > FORMAT_VERSION:
            raise ValueError(f"{path}: written by a newer faast (format_version {version}); upgrade faast")
        if same_run and world_size != self.world_size:
            raise ValueError(
                f"{path}: written by a run with world_size={world_size}, this run has {self.world_size}; the data "
                "shards would differ, so it cannot be resumed exactly"
            )
        names = [name for name, _ in memories]
        absent = {name for name in names if name not in saved}
        if sorted(saved) != sorted(set(names) - (absent & optional)):
            raise ValueError(f"{path}: holds memories {sorted(saved)}, the object being restored has {sorted(names)}")
        plan = []
        for name, m in memories:
            if name in absent:
                _log.info("faast: %s has no %s (written before faast kept it): it loads empty", path, name)
                plan.append((m, m.empty_like().state_dict(), f"{path} (memory {name}, absent: empty)"))
                continue
            # A root module is the only one in its file: every tensor is its own (a blend window's are `blend.*`).
            own = {k[len(name) + 1 :]: t for k, t in tensors.items() if k.startswith(f"{name}.")} if name else tensors
            source = f"{path} (memory {name or '<root>'})"
            # Files written before Accumulators existed hold FastWeights only and name no format.
            kind = saved[name].get("format", FastWeights.FORMAT)
            if kind != m.FORMAT:
                raise ValueError(f"{source}: holds a {kind}, the object being restored has a {m.FORMAT} there")
            m.validate_state(own, saved[name]["config"], source)
            plan.append((m, own, source))
        return position, plan

    def restore(self, obj: object) -> dict | None:
        """Load the newest intact checkpoint of this rank into the memories of `obj` and return its position, or
        None when there is none (obj untouched).

        A newest file that fails verification (bit rot, a copy cut short) is skipped with a warning in favour of the
        previous one, whose position matches its own statistics, so the resumed result stays exact. Raises if files
        exist but none is intact, or if a file does not match `obj` (different memories or configuration).
        """
        memories = find_memories(obj)
        optional = _optional_in_files(obj, [name for name, _ in memories])
        self._remove_stale_temporaries()
        candidates = self.checkpoints()
        failures = []
        for path in candidates:
            try:
                position, plan = self._read(path, memories, optional=optional)
            except CorruptFileError as err:
                _log.warning("faast: skipping unreadable checkpoint %s (%s)", path, err)
                failures.append(str(err))
                continue
            for m, own, source in plan:
                m.load_statistics(own, source=source)
            return position
        if failures:
            raise ValueError(f"{self.directory}: no intact checkpoint for rank {self.rank}: " + "; ".join(failures))
        return None


def _optional_in_files(obj: object, names: list[str]) -> frozenset[str]:
    """The names among `names` (of statistics modules inside the nn.Module `obj`, as find_memories gives them) that a
    checkpoint may lack: those whose owning module lists their attribute name in its class's OPTIONAL_IN_FILES, for
    statistics it began to keep after files were written without them (such an owner must tell an empty or partial
    sum from a complete one, e.g. by its count)."""
    if not isinstance(obj, nn.Module):
        return frozenset()
    found = set()
    for name in names:
        parent, _, attribute = name.rpartition(".")
        owner = obj.get_submodule(parent) if parent else obj
        if attribute in getattr(type(owner), "OPTIONAL_IN_FILES", ()):
            found.add(name)
    return frozenset(found)


def _write(path: Path, obj: object, position_json: str, rank: int, world_size: int) -> Path:
    tensors, configs = {}, {}
    for name, m in find_memories(obj):
        configs[name] = {"format": m.FORMAT, "config": m.config(), "has_prior": "prior" in m.fixed_tensors()}
        for key, t in m.state_dict().items():
            tensors[f"{name}.{key}" if name else key] = t
    metadata = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "faast_version": __version__,
        "rank": str(rank),
        "world_size": str(world_size),
        "position": position_json,
        "memories": json.dumps(configs, sort_keys=True),
    }
    return write_atomic(path, tensors, metadata)


def save_state(path: str | Path, obj: object, extra: Mapping[str, object] | None = None) -> Path:
    """Write the statistics of every memory in `obj` to one file, atomically (missing parent folders are created);
    load_checkpoint reads it back and returns `extra` (JSON-serialisable settings of the owner) in its position."""
    position: dict[str, object] = {"batches": 0}
    if extra:
        if "batches" in extra:
            raise ValueError("extra: 'batches' is the stream position's own key")
        position.update(extra)
    try:
        position_json = json.dumps(position, sort_keys=True)
    except (TypeError, ValueError) as err:
        raise ValueError(f"extra: must be JSON-serialisable ({err})") from None
    return _write(Path(path), obj, position_json, 0, 1)


# ---------------------------------------------------------------------------------------------------- the loop


def count_rows(memory: FastWeights, batch: object) -> int:
    """Rows of one memory's share of a batch: the mask's True entries, else all rows (per memory of batch_shape)."""
    keys, _, _, mask = _batch_fields(batch)
    if mask is not None:
        return int(mask.sum()) // max(1, _prod(memory.batch_shape))
    return keys.numel() // keys.shape[-1] // max(1, _prod(memory.batch_shape))


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _batch_fields(batch: object) -> tuple:
    if isinstance(batch, Mapping):
        unknown = set(batch) - {"keys", "values", "scores", "mask"}
        if unknown or "keys" not in batch or "values" not in batch:
            raise ValueError(
                "batches: a dict batch needs 'keys' and 'values' (optional 'scores', 'mask'), "
                f"got keys {sorted(batch)}"
            )
        return batch["keys"], batch["values"], batch.get("scores"), batch.get("mask")
    if isinstance(batch, tuple | list) and len(batch) in (2, 3):
        return (*batch, *(None,) * (4 - len(batch)))
    raise TypeError(
        "batches: each batch must be (keys, values), (keys, values, scores) or a dict with keys/values/scores/mask, "
        f"got {type(batch).__name__}"
    )


def _update_memory(memory: FastWeights, batch: object) -> int:
    keys, values, scores, mask = _batch_fields(batch)
    memory.update(keys, values, scores, mask=mask)
    return count_rows(memory, batch)


def learn_stream(
    obj: object,
    batches: Iterable[Batch] | Callable[[int], Iterable[Batch]],
    *,
    step: Step | None = None,
    checkpoint_dir: str | Path | None = None,
    every: int | None = 1000,
    every_seconds: float | None = None,
    keep: int = 2,
    checkpointer: Checkpointer | None = None,
) -> dict:
    """Learn every batch of a stream into `obj`, with periodic checkpoints, resuming from the newest one.

    Args:
        obj: what learns: a FastWeights (batches are (keys, values[, scores]) or dicts with keys/values/scores/mask),
            or any object with memories inside (a module) together with `step`.
        batches: an iterable of batches, or a function start -> iterable of the batches from index `start` on
            (for sources that can seek; a plain iterable is resumed by reading and discarding consumed batches).
        step: step(obj, batch) -> rows learned (int) or None; default: FastWeights.update.
        checkpoint_dir: where checkpoints go; None learns without checkpoints (still returns the position).
        every: checkpoint after every `every` batches (None: not by count).
        every_seconds: also checkpoint when this many seconds passed since the last one (None: not by time).
        keep: checkpoints kept per rank.
        checkpointer: a configured Checkpointer instead of checkpoint_dir/keep.

    Returns the final position: {'batches': consumed, 'rows': learned, 'resumed_from': batches at start,
    'seconds': time spent in this call}. A final checkpoint is written when the stream ends.
    """
    if step is None:
        if not isinstance(obj, FastWeights):
            raise TypeError(f"step: required to learn into a {type(obj).__name__} (the default handles a FastWeights)")
        step = cast(Step, _update_memory)  # obj is a FastWeights: checked just above
    if every is not None:
        every = require_positive_int("every", every)
    if every_seconds is not None:
        every_seconds = require_nonnegative_number("every_seconds", every_seconds, allow_zero=False)
    if checkpointer is None and checkpoint_dir is not None:
        checkpointer = Checkpointer(checkpoint_dir, keep=keep)
    find_memories(obj)  # fail now, not at the first checkpoint, if obj holds no memory

    position = {"batches": 0, "rows": 0}
    if checkpointer is not None:
        restored = checkpointer.restore(obj)
        if restored is not None:
            position = {"batches": int(restored["batches"]), "rows": int(restored.get("rows", 0))}
            _log.info("faast: resumed from batch %d (%d rows) in %s", position["batches"], position["rows"],
                      checkpointer.directory)  # fmt: skip
    start = position["batches"]
    stream = batches(start) if callable(batches) else itertools.islice(batches, start, None)

    began = last_save = time.monotonic()
    saved_at = start
    for batch in stream:
        rows = step(obj, batch)
        position["batches"] += 1
        position["rows"] += int(rows) if rows is not None else 0
        if checkpointer is None:
            continue
        due = every is not None and position["batches"] % every == 0
        due = due or (every_seconds is not None and time.monotonic() - last_save >= every_seconds)
        if due:
            checkpointer.save(obj, position)
            last_save, saved_at = time.monotonic(), position["batches"]
    if checkpointer is not None and (saved_at != position["batches"] or not checkpointer.checkpoints()):
        checkpointer.save(obj, position)
    return {**position, "resumed_from": start, "seconds": time.monotonic() - began}


def load_checkpoint(path: str | Path, obj: object, check: Callable[[dict], None] | None = None) -> dict:
    """Load one specific checkpoint file into the memories of `obj` (all or nothing); returns its position.
    check(position), when given, runs before anything is copied: it raises to refuse the file."""
    path = Path(path)
    memories = find_memories(obj)
    optional = _optional_in_files(obj, [name for name, _ in memories])
    reader = Checkpointer(path.parent, rank=0, world_size=1)
    position, plan = reader._read(path, memories, same_run=False, optional=optional)
    if check is not None:
        check(position)
    for m, own, source in plan:
        m.load_statistics(own, source=source)
    return position
