"""The memories a server holds: a save_pretrained folder on disk, a capped set of them resident in the model, and
changes committed to the folder all at once or not at all (docs/serving.md, "The server").

The folder is the layout FaastModel.save_pretrained writes (faast_config.json, faast_adapter.safetensors,
memories/<name>.safetensors, faast_manifest.json), plus `faast_serve.json` (the tokens each memory learned). A change
(learn, forget, merge, delete) is committed through a redo log, so a process killed at any point leaves the folder
holding either the old memories or the new ones:

1. the changed memory files, the new manifest and the new faast_serve.json are written into `.staging/`, each
   atomically;
2. `.staging/COMMIT` (the list of memory files to remove) is written atomically: from here on the change counts;
3. the staged files are renamed into place, the removed files unlinked, and `.staging/` is removed.

Opening a folder (MemoryHouse.__init__) first finishes a commit whose COMMIT file exists and drops a staging folder
without one. Only memories named in the manifest are served.

Resident memories are named memories of the FaastModel; the others are only on disk. At most `max_resident` are
resident; the least recently used is dropped from the model when another must come in (its file is already the
committed one), and it is read back from its file, bit for bit, when a request names it again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from .._version import __version__
from ..hf import persistence
from ..hf.base import CONFIG_NAME
from ..hf.config import FaastConfig
from ..hf.memory_store import Ledger, check_name
from ..hf.model import FaastModel, apply_faast
from ..persist import write_text_atomic
from .pieces import Meter, pieces
from .schemas import ServeError

STAGING = ".staging"
COMMIT = "COMMIT"
SIDECAR = "faast_serve.json"  # {name: {"tokens": int}}: what the manifest does not say about a memory
IDLE = "__idle__"  # the memory bound to the layers between calls: empty, never served (not a valid name)


def _sha256(path: Path) -> tuple[int, str]:
    blob = path.read_bytes()
    return len(blob), hashlib.sha256(blob).hexdigest()


def _fsync_dir(path: Path) -> None:
    # the renames of a commit must reach the disk in order
    if hasattr(os, "O_DIRECTORY"):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _move(source: Path, target: Path) -> None:
    """One rename of a commit (a function of its own, so that the tests can stop a commit between two)."""
    os.replace(source, target)


def recover(folder: Path) -> None:
    """Finish the commit `.staging/COMMIT` announces, or drop a staging folder without one (see the module)."""
    staging = folder / STAGING
    if not staging.is_dir():
        return
    marker = staging / COMMIT
    if marker.is_file():
        removed = json.loads(marker.read_text(encoding="utf-8"))["remove"]
        (folder / persistence.MEMORY_DIR).mkdir(exist_ok=True)
        for staged in staging.glob("*.safetensors"):
            _move(staged, persistence.memory_file(folder, staged.stem))
        for name in (SIDECAR, persistence.MANIFEST_NAME):  # the manifest last: it names the files above
            if (staging / name).is_file():
                _move(staging / name, folder / name)
        _fsync_dir(folder / persistence.MEMORY_DIR)
        _fsync_dir(folder)
        for name in removed:
            persistence.memory_file(folder, name).unlink(missing_ok=True)
    shutil.rmtree(staging)


class MemoryHouse:
    """A FaastModel serving the memories of one folder (see the module docstring). Every use of the model, reading
    or learning, holds `lock` (the model is one object, not safe to use from two threads at once).

    Args:
        base_model: a transformers causal LM (frozen); faast is applied to it here.
        tokenizer: its tokenizer (texts to learn and forget are tokenised with it).
        folder: the memories folder; created (with FaastConfig() or `config`) when it holds no faast_config.json.
        max_resident: how many memories may be resident in the model at once (>= 1).
        config: the FaastConfig of a new folder (ignored when the folder has one).
    """

    def __init__(
        self,
        base_model: nn.Module,
        tokenizer: Any,
        folder: str | Path,
        *,
        max_resident: int = 8,
        config: FaastConfig | None = None,
    ) -> None:
        if type(max_resident) is not int or max_resident < 1:
            raise ValueError(f"max_resident: expected an int >= 1, got {max_resident!r}")
        self.folder, self.tokenizer, self.max_resident = Path(folder), tokenizer, max_resident
        self.lock = threading.RLock()
        self.folder.mkdir(parents=True, exist_ok=True)
        recover(self.folder)
        fresh = not (self.folder / CONFIG_NAME).is_file()
        model = apply_faast(
            base_model,
            config
            if fresh and config is not None
            else FaastConfig()
            if fresh
            else FaastConfig.load(self.folder / CONFIG_NAME),
        )
        if not isinstance(model, FaastModel):
            raise ValueError("base_model: expected a causal LM (faast applied a module-memory model to it)")
        self.model: FaastModel = model
        if fresh:
            persistence.save_pretrained(model, self.folder)
            self.entries: dict[str, dict] = {}
            self.tokens: dict[str, int | None] = {}
            self._commit({}, [])
        else:
            model.load_adapter(self.folder)
            manifest = persistence.read_manifest(self.folder)
            if manifest is None:
                raise ValueError(f"folder: {self.folder} holds no {persistence.MANIFEST_NAME}")
            persistence.check_base(manifest, model, self.folder)
            self.entries = {e["name"]: e for e in manifest["memories"]}
            for name in self.entries:
                check_name(name, f"{self.folder}: memories")
            sidecar = self.folder / SIDECAR
            saved = json.loads(sidecar.read_text(encoding="utf-8")) if sidecar.is_file() else {}
            self.tokens = {n: saved.get(n, {}).get("tokens") for n in self.entries}
        model.named_memories.creating(IDLE)
        model.set_memory(IDLE)
        if "default" in model.memories and "default" not in self.entries:
            model.delete_memory("default")  # a new model's own memory: served only when the folder names it
        self.resident: OrderedDict[str, None] = OrderedDict()  # least recently used first

    # ------------------------------------------------------------------ reading

    @property
    def names(self) -> list[str]:
        """The served memories, in the manifest's order."""
        return list(self.entries)

    def info(self, name: str) -> dict:
        """{name, bytes (its file), tokens (learned; None when the folder does not say), resident}."""
        entry = self.require(name)
        return {
            "name": name,
            "bytes": entry["bytes"],
            "tokens": self.tokens.get(name),
            "resident": name in self.resident,
        }

    def require(self, name: object, field: str = "memory") -> dict:
        """The manifest entry of memory `name`; ServeError (404) naming `field` when it is not served."""
        if not isinstance(name, str) or name not in self.entries:
            raise ServeError(f"{field}: no memory named {name!r}", field, 404)
        return self.entries[name]

    def make_resident(self, names: list[str]) -> None:
        """Load every memory of `names` that is only on disk, dropping the least recently used others to stay within
        max_resident; then mark `names` most recently used. Hold `lock`."""
        wanted = list(dict.fromkeys(names))
        if len(wanted) > self.max_resident:
            raise ServeError(
                f"model: {len(wanted)} memories at once, the server keeps {self.max_resident}", "model", 429
            )
        for name in wanted:
            if name not in self.resident:
                self._evict_until(self.max_resident - 1, keep=wanted)
                self._load(name)
            self.resident[name] = None
            self.resident.move_to_end(name)

    def _evict_until(self, size: int, keep: list[str]) -> None:
        for name in [n for n in self.resident if n not in keep]:
            if len(self.resident) <= size:
                return
            self._drop(name)

    def _drop(self, name: str) -> None:
        """Remove memory `name` from the model (its committed file stays)."""
        self.resident.pop(name, None)
        if name in self.model.memories:
            self.model.delete_memory(name)

    def _load(self, name: str) -> None:
        path = persistence.verified_memory_file(self.folder, self.entries[name])
        ledger = Ledger.from_json(persistence.saved_ledger(path), path)
        # all or nothing: a file that does not load leaves no memory `name` behind
        self.model.named_memories.load(
            {name: path}, {name: ledger}, None, self.model.load_fast_weights, str(self.folder)
        )

    # ------------------------------------------------------------------ changing

    def learn(
        self,
        name: str,
        texts: list[str],
        *,
        create: bool,
        progress: Callable[[dict], None] | None = None,
        field: str = "texts",
    ) -> dict:
        """Learn `texts` into memory `name` (a new one when `create`, else an existing one), solve it and commit it.
        The texts are learned one batch of windows at a time (faast.serve.pieces: the memory is what one learn() call
        gives), and `progress` is handed an event after each batch and before the solve and the save. A failure at
        any point leaves the folder as it was and drops the memory from the model (it is read back from its
        committed file when next named); an error about the texts names `field` (the request field they came in).
        Returns {object, memory, tokens (this call), warning (the solve's, or None), record (info())}. Hold `lock`."""
        if create:
            if name in self.entries:
                raise ServeError(f"name: a memory named {name!r} exists already", "name", 409)
        else:
            self.require(name, "name")
            self.make_resident([name])
        ids = [list(self.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
        parts = pieces(ids)
        if not parts:
            raise ServeError(f"{field}: nothing to learn: every text is shorter than 2 tokens", field)
        meter = Meter(name, sum(p.tokens for p in parts))
        try:
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                for part in parts:
                    stats = self.model.learn(part.texts, memory=name, continues=part.continues, progress=False)
                    meter.done += stats.tokens
                    if progress is not None:
                        progress(meter.event("learning"))
                if progress is not None:
                    progress(meter.event("solving"))
                tuning = self.model.solve(memories=[name], progress=False)[name]
            if progress is not None:
                progress(meter.event("saving"))
        except BaseException as err:
            self._drop(name)  # served again from its committed file, as the folder holds it
            if isinstance(err, ValueError) and not isinstance(err, ServeError):
                raise ServeError(f"{field}: {err}", field) from None
            raise
        tokens = (self.tokens.get(name) or 0) + meter.done
        self._commit_memory(name, tokens)
        return {
            "object": "memory.learned",
            "memory": name,
            "tokens": meter.done,
            "warning": (tuning or {}).get("warning"),
            "record": self.info(name),
        }

    def forget(self, name: str, texts: list[str], *, field: str = "texts") -> dict:
        """Unlearn `texts` from memory `name` exactly (they must have been learned into it), solve and commit it; an
        error about the texts names `field`."""
        self.require(name, "name")
        self.make_resident([name])
        try:
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                stats = self.model.forget(texts, tokenizer=self.tokenizer, memory=name)
                self.model.solve(memories=[name], progress=False)
        except ValueError as err:
            raise ServeError(f"{field}: {err}", field) from None
        known = self.tokens.get(name)
        self._commit_memory(name, None if known is None else max(known - stats.tokens, 0))
        return {"memory": name, "tokens": stats.tokens}

    def merge(self, sources: list[str], into: str) -> dict:
        """Create memory `into` holding the union of `sources` (faast's merge_memories), solve and commit it."""
        for source in sources:
            self.require(source, "sources")
        if into in self.entries:
            raise ServeError(f"into: a memory named {into!r} exists already", "into", 409)
        self.make_resident([*sources])
        self.model.merge_memories(list(sources), into=into)
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            self.model.solve(memories=[into], progress=False)
        counts = [self.tokens.get(s) for s in sources]
        tokens = None if any(c is None for c in counts) else sum(c for c in counts if c is not None)
        self._commit_memory(into, tokens)
        return {"memory": into, "tokens": tokens}

    def delete(self, name: str) -> None:
        """Remove memory `name` from the model and the folder."""
        self.require(name, "name")
        entries = {n: e for n, e in self.entries.items() if n != name}
        tokens = {n: t for n, t in self.tokens.items() if n != name}
        self._commit({}, [name], entries, tokens)
        self._drop(name)

    def _commit_memory(self, name: str, tokens: int | None) -> None:
        """Commit the resident memory `name` as it is now; on a failure, drop it from the model, so that what is
        served is what the folder holds."""
        try:
            self._commit({name: tokens}, [])
        except BaseException:
            self._drop(name)
            raise
        self.resident[name] = None
        self.resident.move_to_end(name)
        self._evict_until(self.max_resident, keep=[name])

    def _commit(
        self,
        changed: dict[str, int | None],
        removed: list[str],
        entries: dict[str, dict] | None = None,
        tokens: dict[str, int | None] | None = None,
    ) -> None:
        """Write the memories `changed` (name -> tokens learned) and drop `removed` through the redo log."""
        entries = dict(self.entries if entries is None else entries)
        tokens = dict(self.tokens if tokens is None else tokens)
        staging = self.folder / STAGING
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        for name, count in changed.items():
            path = staging / f"{name}.safetensors"
            self.model.set_memory(name)
            try:
                persistence.save_fast_weights(self.model, path, ledger=self.model.memory_store.ledgers[name].to_json())
            finally:
                self.model.set_memory(IDLE)
            size, digest = _sha256(path)
            entries[name] = {
                "name": name,
                "file": f"{persistence.MEMORY_DIR}/{name}.safetensors",
                "bytes": size,
                "sha256": digest,
            }
            tokens[name] = count
        manifest = {
            "format": persistence.MANIFEST_FORMAT,
            "format_version": persistence.MANIFEST_VERSION,
            "faast_version": __version__,
            "base": persistence.base_shape(self.model),
            "selected": next(iter(entries), None),
            "memories": list(entries.values()),
        }
        write_text_atomic(staging / persistence.MANIFEST_NAME, json.dumps(manifest, indent=2) + "\n")
        sidecar = {n: {"tokens": t} for n, t in tokens.items()}
        write_text_atomic(staging / SIDECAR, json.dumps(sidecar, indent=2) + "\n")
        write_text_atomic(staging / COMMIT, json.dumps({"remove": removed}) + "\n")
        _fsync_dir(staging)
        recover(self.folder)
        self.entries, self.tokens = entries, tokens
