"""A FaastModel on disk: its configuration and trained parts (save_pretrained / load_adapter), and what it learned
(save_fast_weights / load_fast_weights).

Every file is written atomically and read back verified (faast.persist). Nothing of the base model is written.

- The adapter folder: `faast_config.json` (the FaastConfig) and `faast_adapter.safetensors` (each middle layer's
  readout and scorer, float32), whose metadata repeats the configuration so a folder is checked as a whole. Since
  adapter format 2 the metadata records the configuration's `config_version`; format-1 files hold version 1 (the
  flat layout of faast 0.1).
- The fast-weights file: a faast.Checkpoint file (faast.checkpoint) of every piece of learned state, in the
  per-layer layout (one d×d memory per middle layer, `memory_layers.<block>.memory`, then the output layer's and the
  module memories'), so files written before the middle layers shared one bank and files written now are
  interchangeable. The residual output layer's step, weight and key width in use are saved with it.

The functions take the FaastModel and use only the members faast.hf.protocols.SavedModel names.
"""

from __future__ import annotations

import hashlib
import json
import math
import tempfile
from functools import partial
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from .._version import __version__
from ..accumulator import Accumulator
from ..checkpoint import load_checkpoint, save_state
from ..memory import FastWeights
from ..persist import read_verified, write_atomic, write_text_atomic
from .base import CONFIG_NAME, MEMORIES_NAME
from .config import CONFIG_VERSION, FaastConfig
from .layers import MemoryLayer
from .lm import input_embeddings
from .output import ResidualOutputLayer
from .protocols import SavedModel

# load_adapter and load_fast_weights return the model they are given, typed as given.
Model = TypeVar("Model", bound=SavedModel)

WEIGHTS_NAME = "faast_adapter.safetensors"
# MEMORIES_NAME (faast.hf.base): what a model learned, in folders written before named memories (format 1): one
# file, the 'default' memory.
# Since format 2: a manifest naming every memory, each in its own file under MEMORY_DIR.
MANIFEST_NAME = "faast_manifest.json"
MEMORY_DIR = "memories"
MANIFEST_FORMAT = "faast.hf.saved"
MANIFEST_VERSION = 2
_BASE_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")
FORMAT = "faast.hf.adapter"
FORMAT_VERSION = 2


def _adapter_shape(config: FaastConfig) -> dict:
    """What a saved adapter must share with the model it is loaded into (the rest may be overridden at load): the
    base model's shape, the middle layers' blocks and scorer (their trained tensors), whether there is an output
    layer."""
    middle = config.middle
    return {
        "model_type": config.model_type,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "middle.layers": [] if middle is None else middle.layers,
        "middle.scorer": None if middle is None else middle.scorer,
        "output layer": config.output is not None,
    }


def _middle_layers(model: SavedModel) -> dict[str, MemoryLayer]:
    """`model.memory_layers` by block key, each checked to be a MemoryLayer (an nn.ModuleDict types its entries as
    any module)."""
    layers = {}
    for key, layer in model.memory_layers.items():
        if not isinstance(layer, MemoryLayer):
            raise TypeError(f"model: memory_layers[{key!r}]: expected a MemoryLayer, got {type(layer).__name__}")
        layers[key] = layer
    return layers


def _adapter_tensors(model: SavedModel) -> dict[str, torch.Tensor]:
    """The trained parameters of `model`'s middle layers by file name (the live tensors)."""
    tensors = {}
    for key, layer in _middle_layers(model).items():
        tensors[f"layers.{key}.readout.weight"] = layer.readout.weight
        if layer.scorer is not None:
            tensors[f"layers.{key}.scorer.weight"] = layer.scorer.weight
    return tensors


def memory_file(directory: str | Path, name: str) -> Path:
    """Where save_pretrained writes memory `name` (a name checked by faast.hf.memory_store.check_name)."""
    return Path(directory) / MEMORY_DIR / f"{name}.safetensors"


def base_shape(model: SavedModel) -> dict:
    """What a saved model's memories need of the base model: type, hidden size, layer count, vocabulary."""
    config = model.faast_config
    vocab = input_embeddings(model.base_model).weight.shape[0]
    return {"model_type": config.model_type, "hidden_size": config.hidden_size,
            "num_hidden_layers": config.num_hidden_layers, "vocab_size": int(vocab)}  # fmt: skip


def write_manifest(model: SavedModel, directory: str | Path, written: dict[str, Path], selected: str | None) -> Path:
    """Write MANIFEST_NAME: the format version, the base model's shape, the selected memory and each memory's file
    (name, path, bytes, sha256 of the file), atomically, after the memory files; then remove memory files the
    manifest does not name (an earlier save's) and a format-1 memories file."""
    directory = Path(directory)
    entries = []
    for name, path in written.items():
        blob = path.read_bytes()
        entries.append({"name": name, "file": path.relative_to(directory).as_posix(), "bytes": len(blob),
                        "sha256": hashlib.sha256(blob).hexdigest()})  # fmt: skip
    manifest = {"format": MANIFEST_FORMAT, "format_version": MANIFEST_VERSION, "faast_version": __version__,
                "base": base_shape(model), "selected": selected, "memories": entries}  # fmt: skip
    path = write_text_atomic(directory / MANIFEST_NAME, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    keep = set(written.values())
    for stale in (directory / MEMORY_DIR).glob("*.safetensors") if (directory / MEMORY_DIR).is_dir() else ():
        if stale not in keep:
            stale.unlink()
    (directory / MEMORIES_NAME).unlink(missing_ok=True)
    return path


_MANIFEST_FIELDS = ("format", "format_version", "faast_version", "base", "selected", "memories")


def read_manifest(directory: str | Path) -> dict | None:
    """The manifest of a save_pretrained folder, checked field by field (ValueError naming the file and field); None
    for a folder written before manifests (format 1). A folder whose memories/ holds memory files but which has no
    manifest is damaged, not format 1 (format 1 never wrote memories/): ValueError naming the missing manifest and
    the files it would have named, rather than a load that silently drops what they learned."""
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        folder = Path(directory) / MEMORY_DIR
        orphans = sorted(p.name for p in folder.glob("*.safetensors")) if folder.is_dir() else []
        if orphans:
            raise ValueError(
                f"{directory}: {MANIFEST_NAME} is missing, but {MEMORY_DIR}/ holds memory files {orphans}; the "
                f"folder is damaged (save_pretrained writes the manifest last: restore it, or save the model again)"
            )
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not a readable faast manifest ({err}); the folder is damaged") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{path}: not a {MANIFEST_FORMAT} manifest")
    version = manifest.get("format_version")
    if type(version) is not int or version < 2:
        raise ValueError(f"{path}: format_version: expected an int >= 2, got {version!r}")
    if version > MANIFEST_VERSION:
        raise ValueError(f"{path}: format_version {version} was written by a newer faast; upgrade faast")
    unknown = sorted(set(manifest) - set(_MANIFEST_FIELDS))
    if unknown:
        # a field this faast does not know would be ignored, and whatever it says with it
        raise ValueError(f"{path}: unknown fields {unknown}; a format-{version} manifest has {list(_MANIFEST_FIELDS)}")
    base = manifest.get("base")
    if not isinstance(base, dict) or set(base) != set(_BASE_FIELDS):
        raise ValueError(f"{path}: base: expected the fields {list(_BASE_FIELDS)}, got {base!r}")
    entries = manifest.get("memories")
    if not isinstance(entries, list):
        raise ValueError(f"{path}: memories: expected a list, got {entries!r}")
    names = []
    for entry in entries:
        ok = isinstance(entry, dict) and set(entry) == {"name", "file", "bytes", "sha256"}
        if (
            not ok
            or not isinstance(entry["name"], str)
            or entry["file"] != f"{MEMORY_DIR}/{entry['name']}.safetensors"
        ):
            raise ValueError(f"{path}: memories: expected {{name, file: {MEMORY_DIR}/<name>.safetensors, bytes, "
                             f"sha256}} entries, got {entry!r}")  # fmt: skip
        if type(entry["bytes"]) is not int or not isinstance(entry["sha256"], str):
            raise ValueError(f"{path}: memories: {entry['name']!r}: bytes must be an int and sha256 a string")
        names.append(entry["name"])
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: memories: names repeat: {names}")
    if manifest.get("selected") not in (*names, None) or (names and manifest.get("selected") is None):
        raise ValueError(f"{path}: selected: expected one of {names}, got {manifest.get('selected')!r}")
    return manifest


def check_base(manifest: dict, model: SavedModel, directory: str | Path) -> None:
    """Refuse a base model whose type, hidden size, layer count or vocabulary differ from the saved one."""
    mine = base_shape(model)
    for name in _BASE_FIELDS:
        if manifest["base"][name] != mine[name]:
            raise ValueError(
                f"{directory}: saved for a base model with {name}={manifest['base'][name]!r}, this one has "
                f"{mine[name]!r}"
            )


def verified_memory_file(directory: str | Path, entry: dict) -> Path:
    """The file of a manifest entry, when its size and sha256 are the manifest's (else ValueError naming it)."""
    path = Path(directory) / entry["file"]
    if not path.is_file():
        raise ValueError(f"{directory}: memory {entry['name']!r}: {entry['file']} is missing")
    blob = path.read_bytes()
    if len(blob) != entry["bytes"] or hashlib.sha256(blob).hexdigest() != entry["sha256"]:
        raise ValueError(
            f"{directory}: memory {entry['name']!r}: {entry['file']} is not the file the manifest names "
            f"({len(blob)} bytes, expected {entry['bytes']}, or another sha256); the folder is damaged"
        )
    return path


def saved_ledger(path: str | Path) -> list:
    """The ledger saved with a memory file ([] for files written without one)."""
    _, metadata = read_verified(path)
    try:
        return json.loads(metadata.get("position", "{}")).get("ledger", [])
    except (ValueError, AttributeError):
        raise ValueError(f"{path}: the saved position is not a JSON object") from None


def save_pretrained(model: SavedModel, directory: str | Path) -> Path:
    """Write `model`'s FaastConfig (JSON) and its readout + scorer weights (safetensors, float32), each atomically
    (the memories and the manifest: FaastModel.save_pretrained)."""
    directory = Path(directory)
    metadata = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "faast_version": __version__,
        "config_version": str(CONFIG_VERSION),
        "config": model.faast_config.to_json(),
    }
    write_atomic(directory / WEIGHTS_NAME, _adapter_tensors(model), metadata)
    model.faast_config.save(directory / CONFIG_NAME)
    return directory


def load_adapter(model: Model, directory: str | Path) -> Model:
    """Load readout + scorer weights written by save_pretrained into `model` (all or nothing); returns it."""
    path = Path(directory) / WEIGHTS_NAME
    tensors, metadata = read_verified(path)
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} file (format={metadata.get('format')!r})")
    try:
        version = int(metadata.get("format_version", "0"))
        config_version = 1 if version < 2 else int(metadata["config_version"])
    except (KeyError, ValueError):
        raise ValueError(f"{path}: format_version / config_version: expected ints in the metadata") from None
    if version > FORMAT_VERSION:
        raise ValueError(f"{path}: written by a newer faast; upgrade faast")
    saved = _adapter_shape(FaastConfig.from_json(metadata["config"], version=config_version))
    mine = _adapter_shape(model.faast_config)
    for name, value in saved.items():
        if value != mine[name]:
            raise ValueError(f"{path}: saved for {name}={value!r}, this model has {mine[name]!r}")
    expected = _adapter_tensors(model)
    if set(tensors) != set(expected):
        raise ValueError(f"{path}: expected tensors {sorted(expected)}, found {sorted(tensors)}")
    for name, t in tensors.items():
        if t.shape != expected[name].shape or not t.is_floating_point():
            raise ValueError(
                f"{path}: tensor {name} has shape {list(t.shape)} {t.dtype}, expected "
                f"{list(expected[name].shape)} floating point"
            )
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{path}: tensor {name} holds NaN/Inf; refusing to load it")
    with torch.no_grad():
        for name, t in tensors.items():
            expected[name].copy_(t)
    return model


def save_fast_weights(model: SavedModel, path: str | Path, *, ledger: list | None = None) -> Path:
    """Write every piece of `model`'s learned state (its selected memory) to one safetensors file, atomically (see
    the module docstring); `ledger`: what the memory learned (faast.hf.memory_store.Ledger.to_json), kept with it."""
    extra: dict[str, object] = {} if ledger is None else {"ledger": ledger}
    layer = model.output_memory_layer
    if isinstance(layer, ResidualOutputLayer):
        if layer.step == "auto" and (step := layer.chosen_step()) is not None:
            extra["output_step"] = step
        tuned_weight = layer.space == "probability" and layer.weight == "auto"
        if tuned_weight and (weight := layer.chosen_weight()) is not None:
            extra["output_weight"] = weight
        if layer.extra_key_size and (width := layer.chosen_key_width()) is not None:
            extra["output_key_width"] = width
    return save_state(path, per_layer_holder(model, copy=True), extra)


def load_fast_weights(model: Model, path: str | Path) -> Model:
    """Load what save_fast_weights wrote into `model` (the layers must match; all or nothing); returns it.

    Also reads a checkpoint of the model in the bank layout (faast.checkpoint on the FaastModel itself, memories
    `memory_bank` and `output_memory_layer.memory`), ignoring its stream position.
    """
    model.module_memories.prepare_load(path)  # sizes the memories of modules of unknown width
    check = partial(_check_output_settings, path)
    saved = _saved_memories(path)
    with tempfile.TemporaryDirectory() as scratch:
        lacks_sums = saved is not None and _CURVATURE in saved and any(n not in saved for n in _OPTIONAL_OUTPUT_SUMS)
        if saved is not None and (_has_legacy_output_sums(saved) or lacks_sums):
            path = _upgrade_output_sums(path, Path(scratch) / Path(path).name)
        if saved is not None and sorted(saved) == sorted(name for name, _ in model.learned_state()):
            _restore_output_settings(model, load_checkpoint(path, _bank_holder(model), check))
            return model
        slots = _per_layer_memories(model, copy=False)
        # validates every memory of the file (and the saved step) before copying any
        _restore_output_settings(model, load_checkpoint(path, _per_layer_holder(model, slots), check))
    if model.memory_bank is not None:
        model.memory_bank.load_state_dict(
            {name: torch.stack([getattr(m, name) for m in slots.values()]) for name in model.memory_bank.state_dict()}
        )
    return model


def per_layer_holder(model: SavedModel, *, copy: bool) -> nn.Module:
    """A module holding `model`'s learned state in the per-layer file layout: one FastWeights(d, d) per middle layer
    at `memory_layers.<block>.memory` (copies of the bank's slots when `copy`, else empty ones to load into), the
    output layer and the module memories."""
    return _per_layer_holder(model, _per_layer_memories(model, copy=copy))


def _per_layer_memories(model: SavedModel, *, copy: bool) -> dict[str, FastWeights]:
    """One FastWeights(d, d) per middle layer, by block key, with the bank's solve settings: copies of the bank's
    slots when `copy`, else empty ones to load into."""
    bank, layers = model.memory_bank, _middle_layers(model)
    if bank is None:  # FaastModel builds its bank exactly when it has middle layers
        if layers:
            raise ValueError(f"model: middle layers {sorted(layers)} but no memory_bank holding their statistics")
        return {}
    memories = {}
    for key, layer in layers.items():
        memory = FastWeights(
            bank.dim_key, bank.dim_value, alpha=bank.alpha, rtol=bank.rtol, ridge=bank.ridge,
            compute_dtype=bank.compute_dtype, device=bank.device,
        )  # fmt: skip
        if copy:
            memory.load_state_dict(layer.memory.state_dict())
        memories[key] = memory
    return memories


def _per_layer_holder(model: SavedModel, memories: dict[str, FastWeights]) -> nn.Module:
    """per_layer_holder for these per-layer memories."""
    holder = nn.Module()
    layers = nn.ModuleDict()
    for key, memory in memories.items():
        slot = nn.Module()
        slot.memory = memory
        layers[key] = slot
    holder.memory_layers = layers
    if model.output_memory_layer is not None:
        holder.output_memory_layer = model.output_memory_layer
    holder.module_memories = model.module_memories
    return holder


def _bank_holder(model: SavedModel) -> nn.Module:
    """A module holding `model`'s learned state under the names of the bank layout (FaastModel.learned_state)."""
    holder = nn.Module()
    if model.memory_bank is not None:
        holder.memory_bank = model.memory_bank
    if model.output_memory_layer is not None:
        holder.output_memory_layer = model.output_memory_layer
    holder.module_memories = model.module_memories
    return holder


def _saved_memories(path: str | Path) -> dict | None:
    """The memories of a faast.Checkpoint file's header ({name: {format, config, ...}}), or None when the header
    cannot say; the full read (load_checkpoint) then reports what is wrong with the file."""
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
        memories = json.loads(metadata["memories"])
        return memories if isinstance(memories, dict) else None
    except Exception:  # noqa: BLE001 - any unreadable header: let the verified read explain it
        return None


# The residual output layer's sums were FastWeights before they were Accumulators: Σ μμᵀ in curvature's `gram`, Σ p
# in token_mass's `cross` [1, V]. name -> (the FastWeights tensor that held the sum, the Accumulator's sum).
_LEGACY_OUTPUT_SUMS = {
    "output_memory_layer.curvature": ("gram", "gram"),
    "output_memory_layer.token_mass": ("cross", "probability"),
}


# Files written before the residual output layer kept a sum one of its biases reads (the gradient sum:
# ResidualOutput.bias; the target counts: ResidualOutput.token_bias) load with an empty one: the layer then reads
# without that bias and says why (ResidualOutputLayer.last_tuning['bias_off'], ['token_bias_off']).
# name -> (the sum's name, the saved tensor whose first dimension sizes it).
_CURVATURE = "output_memory_layer.curvature"
_OPTIONAL_OUTPUT_SUMS = {
    "output_memory_layer.gradient_sum": ("gradient", f"{_CURVATURE}.gram"),
    "output_memory_layer.target_count": ("targets", "output_memory_layer.token_mass.probability"),
}


def _has_legacy_output_sums(saved: dict) -> bool:
    return any(saved.get(name, {}).get("format", FastWeights.FORMAT) == FastWeights.FORMAT
               and name in saved for name in _LEGACY_OUTPUT_SUMS)  # fmt: skip


def _upgrade_output_sums(path: str | Path, target: Path) -> Path:
    """Write to `target` the file at `path` with the residual output layer's curvature and token mass in the
    Accumulator layout, and an empty gradient sum and target count where it has none (read verified; every other
    memory as it was); returns `target`."""
    tensors, metadata = read_verified(path)
    memories = json.loads(metadata["memories"])
    for name, (old, new) in _LEGACY_OUTPUT_SUMS.items():
        entry = memories.get(name)
        if entry is None or entry.get("format", FastWeights.FORMAT) != FastWeights.FORMAT:
            continue
        saved = {k[len(name) + 1 :]: tensors.pop(k) for k in [k for k in tensors if k.startswith(f"{name}.")]}
        if old not in saved or "count" not in saved:
            raise ValueError(f"{path}: memory {name} lacks its {old!r} or 'count' tensor")
        total = saved[old].reshape(-1) if new == "probability" else saved[old]
        upgraded = Accumulator({new: tuple(total.shape)})
        tensors[f"{name}.{new}"], tensors[f"{name}.count"] = total, saved["count"]
        memories[name] = {"format": upgraded.FORMAT, "config": upgraded.config(), "has_prior": False}
    for name, (field, sizer) in _OPTIONAL_OUTPUT_SUMS.items():
        if name not in memories and sizer in tensors:
            empty = Accumulator({field: (tensors[sizer].shape[0],)})
            for key, tensor in empty.state_dict().items():
                tensors[f"{name}.{key}"] = tensor
            memories[name] = {"format": empty.FORMAT, "config": empty.config(), "has_prior": False}
    write_atomic(target, tensors, {**metadata, "memories": json.dumps(memories, sort_keys=True)})
    return target


def _check_output_settings(path: str | Path, position: dict) -> None:
    """Refuse a file whose saved output-layer step, weight or key width is out of range."""
    step = position.get("output_step")
    if step is not None and not (type(step) in (int, float) and math.isfinite(step) and step >= 0):
        raise ValueError(f"{path}: output_step: expected a finite number >= 0, got {step!r}")
    weight = position.get("output_weight")
    if weight is not None and not (type(weight) in (int, float) and 0 <= weight <= 1):
        raise ValueError(f"{path}: output_weight: expected a number in [0, 1], got {weight!r}")
    width = position.get("output_key_width")
    if width is not None and not (type(width) is int and width > 0):
        raise ValueError(f"{path}: output_key_width: expected an int > 0, got {width!r}")


def _restore_output_settings(model: SavedModel, position: dict) -> None:
    """Hand the residual output layer the step, weight and key width saved with its statistics (None in files
    without them); the positions it held out before the load are not in the loaded statistics."""
    layer = model.output_memory_layer
    if isinstance(layer, ResidualOutputLayer):
        layer.restore_step(position.get("output_step"), position.get("output_weight"),
                           position.get("output_key_width"))  # fmt: skip
        layer.discard_held_out()
