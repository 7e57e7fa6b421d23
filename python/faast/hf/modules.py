"""Memories on any module, the PEFT way: FaastConfig(target_modules=...) (docs/design.md §6.6).

Each module the configuration names (an nn.Linear, GPT-2's Conv1D, or any module mapping x [..., d_in] to a tensor
[..., d_out]) gets a `FastWeights(d_in, d_out)` and a forward hook; no modeling code is copied and the module itself
is not replaced. Keys are the module's input x; values are what its output should have been, as the user gives it
at learn time: y - f(x) for the residual fit (the module then returns f(x) + x·W), or y itself with
module_fit='replace' (the module returns x·W). An empty memory, or a disabled one, leaves the module's output
untouched, bit for bit.

`ModuleMemories` holds the memories and hooks; `FaastModel` (a supported causal LM) carries one, and
`FaastModuleModel` wraps any other model (e.g. a BERT classifier) with nothing else attached.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._version import __version__
from ..checkpoint import load_checkpoint, save_state
from ..memory import FastWeights
from .base import CONFIG_NAME, MEMORIES_NAME, WRAPPED_BASE_MODELS, FaastModelBase, eval_mode, freeze
from .config import FaastConfig
from .inputs import describe
from .layers import memory_options
from .targets import TARGETS

IGNORE_INDEX = -100  # integer targets: rows labelled -100 are not learned (the transformers convention)
PREFIX = "module_memories"  # their names in a fast-weights file: module_memories.<module path with '/'>.memory


def match_target_modules(model: nn.Module, target_modules: list[str] | str) -> list[str]:
    """Qualified names of the modules of `model` that `target_modules` selects, in `named_modules` order.

    A list matches a module whose name equals an entry or ends with "." + an entry; a string is a regular expression
    that must match the whole name (PEFT's rule). Raises ValueError when nothing matches.
    """
    if isinstance(target_modules, str):
        names = [n for n, _ in model.named_modules() if n and re.fullmatch(target_modules, n)]
    else:
        names = [
            n for n, _ in model.named_modules() if n and any(n == t or n.endswith("." + t) for t in target_modules)
        ]
    if not names:
        raise ValueError(
            f"target_modules: {target_modules!r} matches no module of {type(model).__name__} (names look like "
            f"{[n for n, _ in model.named_modules() if n][:6]})"
        )
    return names


def module_dims(module: nn.Module) -> tuple[int, int] | None:
    """(d_in, d_out) of a module when its attributes say so (nn.Linear, in_features/out_features, GPT-2's Conv1D
    nx/nf); None when only a forward pass can tell (the memory is then sized at its first learn)."""
    for names in (("in_features", "out_features"), ("nx", "nf")):
        d_in, d_out = (getattr(module, n, None) for n in names)
        if all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in (d_in, d_out)):
            return cast("tuple[int, int]", (d_in, d_out))
    return None


def _module_device(module: nn.Module, fallback: nn.Module) -> torch.device:
    for source in (module, fallback):
        for tensor in (*source.parameters(), *source.buffers()):
            return tensor.device
    return torch.device("cpu")


def _key(name: str) -> str:
    # nn.ModuleDict keys cannot hold '.'; '/' never occurs in a module's attribute name.
    return name.replace(".", "/")


class ModuleMemory(nn.Module):
    """The memory on one target module.

    Attributes:
        name: the module's qualified name in the model.
        fit: 'residual' or 'replace' (FaastConfig.module_fit).
        memory: FastWeights(d_in, d_out) with float64 statistics, or None until a module of unknown width is first
            learned (or loaded).
    """

    def __init__(self, name: str, dims: tuple[int, int] | None, config: FaastConfig, device: torch.device) -> None:
        super().__init__()
        self.name = name
        self.fit = config.module_fit
        self._options = memory_options(config)
        self.memory: FastWeights | None = None
        if dims is not None:
            self.ensure(*dims, device=device)
        self._weights: tuple[tuple, torch.Tensor | None] | None = None

    def extra_repr(self) -> str:
        return f"name={self.name!r}, fit={self.fit!r}"

    def ensure(self, dim_in: int, dim_out: int, *, device: torch.device) -> FastWeights:
        """The memory, created as FastWeights(dim_in, dim_out) when this module's width was unknown."""
        if self.memory is None:
            self.memory = FastWeights(dim_in, dim_out, **self._options, device=device)
        elif (self.memory.dim_key, self.memory.dim_value) != (dim_in, dim_out):
            raise ValueError(
                f"target module {self.name!r}: maps [..., {dim_in}] to [..., {dim_out}], its memory is "
                f"{self.memory.dim_key}x{self.memory.dim_value}"
            )
        return self.memory

    def swap_memory(self, memory: FastWeights | None) -> FastWeights | None:
        """Read and learn `memory` (another named memory's, same width; None: not sized yet) from now on; returns
        the memory read before (no copy)."""
        if memory is not None and self.memory is not None and memory.config() != self.memory.config():
            raise ValueError(f"target module {self.name!r}: memory: expected configuration {self.memory.config()}")
        previous, self.memory, self._weights = self.memory, memory, None
        return previous

    def weights(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        """W [d_in, d_out] in float64 for float64 outputs and float32 otherwise; None while the memory is empty.
        Cached until the statistics or the solve settings change (one emptiness check per change)."""
        if self.memory is None:
            return None
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        key = (*self.memory.solution_key, device, compute)
        if self._weights is None or self._weights[0] != key:
            w = self.memory.weights.to(device=device, dtype=compute) if bool(self.memory.count.gt(0).any()) else None
            self._weights = (key, w)
        return self._weights[1]

    def read(self, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor | None:
        """The module's new output from its input x [..., d_in] and own output [..., d_out]: f(x) + x·W
        (residual) or x·W (replace), in output's dtype with one rounding; None (keep f(x)) while empty."""
        w = self.weights(output.device, output.dtype)
        if w is None or self.memory is None:  # weights() is None while the memory is
            return None
        _check_pair(self.name, x, output, self.memory)
        projected = x.to(w.dtype) @ w
        if self.fit == "residual":
            projected = output.to(w.dtype) + projected
        return projected.to(output.dtype)

    def learn(
        self, x: torch.Tensor, output: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Add rows (x, y - f(x)) or (x, y) where mask is True.

        Args:
            x: the module's inputs [..., d_in], any floating dtype.
            output: the module's own outputs f(x) [..., d_out].
            targets: float [..., d_out], the outputs wanted, or integer class ids [...] (one-hot over d_out;
                -100: not learned).
            mask: bool [...] or None (every row with a target).
        Returns the number of rows learned (a 0-dim int64 tensor, left on the device).
        """
        memory = self.ensure(x.shape[-1], output.shape[-1], device=_memory_device(self, x))
        _check_pair(self.name, x, output, memory)
        rows = x.shape[:-1]
        compute = torch.float64 if output.dtype == torch.float64 else torch.float32
        if not isinstance(targets, torch.Tensor):
            raise TypeError(f"targets[{self.name!r}]: expected a tensor, got {type(targets).__name__}")
        if targets.device != x.device:
            raise ValueError(f"targets[{self.name!r}]: on {targets.device}, the module's input on {x.device}")
        if targets.is_floating_point():
            if tuple(targets.shape) != (*rows, memory.dim_value):
                raise ValueError(
                    f"targets[{self.name!r}]: expected float [..., d_out] = {[*rows, memory.dim_value]} or class ids "
                    f"{list(rows)}, got {list(targets.shape)}"
                )
            values, labelled = targets.to(compute), None
        elif targets.dtype in (torch.int64, torch.int32):
            if tuple(targets.shape) != tuple(rows):
                raise ValueError(
                    f"targets[{self.name!r}]: class ids must have the rows' shape {list(rows)}, got "
                    f"{list(targets.shape)}"
                )
            labelled = targets != IGNORE_INDEX
            if bool((labelled & ((targets < 0) | (targets >= memory.dim_value))).any()):
                raise ValueError(
                    f"targets[{self.name!r}]: class ids must lie in [0, {memory.dim_value}) or be {IGNORE_INDEX}"
                )
            values = nn.functional.one_hot(torch.where(labelled, targets, 0).long(), memory.dim_value).to(compute)
        else:
            raise TypeError(f"targets[{self.name!r}]: expected a float or int64 tensor, got {targets.dtype}")
        if mask is not None:
            if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != tuple(rows):
                raise ValueError(f"mask[{self.name!r}]: expected a bool tensor {list(rows)}, got {describe(mask)}")
        keep = labelled if mask is None else (mask if labelled is None else mask & labelled)
        if self.fit == "residual":
            values = values - output.to(compute)
        if keep is not None:
            # where, not a product: unlearned rows (padding) may hold NaN
            values = torch.where(keep.unsqueeze(-1), values, values.new_zeros(()))
            x = torch.where(keep.unsqueeze(-1), x, x.new_zeros(()))
        memory.update(x.detach(), values.detach(), mask=keep)
        return keep.sum() if keep is not None else torch.tensor(rows.numel())


def _memory_device(entry: ModuleMemory, x: torch.Tensor) -> torch.device:
    return entry.memory.device if entry.memory is not None else x.device


def _check_pair(name: str, x: object, output: object, memory: FastWeights) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"target module {name!r}: expected a floating tensor input, got {describe(x)}")
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"target module {name!r}: expected its forward to return a tensor, got {describe(output)}")
    if x.shape[-1] != memory.dim_key or output.shape[-1] != memory.dim_value or x.shape[:-1] != output.shape[:-1]:
        raise ValueError(
            f"target module {name!r}: expected input [..., {memory.dim_key}] and output [..., {memory.dim_value}] "
            f"with the same rows, got {list(x.shape)} and {list(output.shape)}"
        )


def _first_input(args: tuple, kwargs: dict) -> object:
    if args:
        return args[0]
    return next(iter(kwargs.values()), None)


class ModuleMemories(nn.ModuleDict):
    """The memories on a model's target modules (keys: qualified names with '/' for '.') and their forward hooks.

    Args:
        model: the model whose modules are hooked (not registered here: its weights are not this module's).
        config: FaastConfig with target_modules (None attaches nothing), module_fit, regulariser, compute_dtype.
        enabled: asked on every forward; False passes every target module's output through (disable_faast).
    """

    def __init__(self, model: nn.Module, config: FaastConfig, *, enabled: Callable[[], bool] | None = None) -> None:
        super().__init__()
        names = [] if config.target_modules is None else match_target_modules(model, config.target_modules)
        self.__dict__["_model"] = model
        self._enabled = enabled
        self._passthrough = 0
        self._captured: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        self._handles: list[RemovableHandle] = []
        for name in names:
            module = model.get_submodule(name)
            self[_key(name)] = ModuleMemory(name, module_dims(module), config, _module_device(module, model))
            self._handles.append(module.register_forward_hook(self._hook(name), with_kwargs=True))

    @property
    def by_key(self) -> Mapping[str, ModuleMemory]:
        """The memories by key, typed: this nn.ModuleDict holds only ModuleMemory."""
        return cast("Mapping[str, ModuleMemory]", self)

    @property
    def names(self) -> list[str]:
        """The target modules' qualified names."""
        return [entry.name for entry in self.by_key.values()]

    def entry(self, name: str | None = None) -> ModuleMemory:
        """The memory of target module `name` (its qualified name, or a suffix naming one; None: the only one)."""
        entries = list(self.by_key.values())
        if name is None:
            if len(entries) != 1:
                raise ValueError(f"name: {len(entries)} target modules {self.names}; say which one to learn")
            return entries[0]
        found = [e for e in entries if e.name == name] or [e for e in entries if e.name.endswith("." + name)]
        if len(found) != 1:
            raise ValueError(f"name: expected one of the target modules {self.names}, got {name!r}")
        return found[0]

    def _hook(self, name: str) -> Callable[[nn.Module, tuple, dict, object], torch.Tensor | None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: object) -> torch.Tensor | None:  # noqa: ARG001
            # a module's forward takes and returns tensors; ModuleMemory checks them (_check_pair) before using them
            x, out = cast(torch.Tensor, _first_input(args, kwargs)), cast(torch.Tensor, output)
            if self._captured is not None:
                self._captured.setdefault(name, []).append((x, out))
                return None
            if self._passthrough or (self._enabled is not None and not self._enabled()):
                return None
            return self.by_key[_key(name)].read(x, out)

        return hook

    @contextlib.contextmanager
    def passthrough(self) -> Iterator[None]:
        """Inside, every target module returns its own output (the LM layers learn from the base activations)."""
        self._passthrough += 1
        try:
            yield
        finally:
            self._passthrough -= 1

    def learn_inputs(
        self, inputs: torch.Tensor, targets: torch.Tensor, *, name: str | None = None, mask: torch.Tensor | None = None
    ) -> int:
        """Learn target module `name` from its inputs [..., d_in] directly: f(inputs) is computed by the module itself
        (in eval mode, without its memory); targets and mask as ModuleMemory.learn. Returns the rows learned."""
        entry = self.entry(name)
        if not isinstance(inputs, torch.Tensor) or not inputs.is_floating_point():
            raise TypeError(f"inputs: expected a floating tensor [..., d_in], got {describe(inputs)}")
        module = self.__dict__["_model"].get_submodule(entry.name)
        with torch.no_grad(), self.passthrough(), eval_mode(module):
            output = module(inputs)
            return int(entry.learn(inputs, output, targets, mask))

    def learn_forward(
        self,
        run: Callable[[], object],
        targets: torch.Tensor | Mapping[str, torch.Tensor],
        mask: torch.Tensor | Mapping[str, torch.Tensor] | None = None,
    ) -> int:
        """Run `run()` (the model's forward pass, eval mode and no_grad are the caller's), capture each target
        module's input and own output, and learn them against `targets` (one tensor for a single target module, or a
        mapping name -> tensor; names as `entry` takes them). Statistics are added after the pass, so an error inside
        it learns nothing. Returns the rows learned, summed over modules."""
        wanted = _per_module("targets", targets, self)
        masks = {} if mask is None else _per_module("mask", mask, self)
        unknown = sorted(set(masks) - set(wanted))
        if unknown:
            raise ValueError(f"mask: given for {unknown}, which have no targets")
        self._captured = captured = dict[str, list[tuple[torch.Tensor, torch.Tensor]]]()
        try:
            with self.passthrough():
                run()
        finally:
            self._captured = None
        plan = []
        for name in wanted:
            calls = captured.get(name, [])
            if len(calls) != 1:
                raise ValueError(
                    f"targets[{name!r}]: the module ran {len(calls)} times in this forward pass, expected once "
                    "(learn_module takes its inputs directly)"
                )
            plan.append((self.by_key[_key(name)], *calls[0], wanted[name], masks.get(name)))
        return int(sum(entry.learn(x, out, y, m) for entry, x, out, y, m in plan))

    def current_states(self) -> dict[str, FastWeights | None]:
        """The memories read now, per target module key (None: not sized yet)."""
        return {key: e.memory for key, e in self.by_key.items()}

    def new_states(self) -> dict[str, FastWeights | None]:
        """Empty memories of every target module's shape (None where the width is not known yet): a named memory."""
        return {key: None if e.memory is None else e.memory.empty_like() for key, e in self.by_key.items()}

    def swap_states(self, states: dict[str, FastWeights | None]) -> dict[str, FastWeights | None]:
        """Read and learn `states` (from new_states) from now on; returns the memories read before (no copies)."""
        if set(states) != set(self.keys()):
            raise ValueError(f"states: expected the target modules {sorted(self.keys())}, got {sorted(states)}")
        return {key: self.by_key[key].swap_memory(states[key]) for key in self.keys()}

    def named_memories(self, prefix: str = PREFIX) -> list[tuple[str, FastWeights]]:
        """(name in a fast-weights file, memory) for every memory created so far."""
        return [(f"{prefix}.{key}.memory", e.memory) for key, e in self.by_key.items() if e.memory is not None]

    def solve(self) -> None:
        for entry in self.by_key.values():
            if entry.memory is not None:
                entry.memory.weights  # noqa: B018 - solving is the point; the memory caches it

    def prepare_load(self, path: str | Path, prefix: str = PREFIX) -> None:
        """Create the memories a fast-weights file holds for modules whose width was unknown (never learned)."""
        try:
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                saved = json.loads((f.metadata() or {})["memories"])
        except Exception:  # noqa: BLE001 - an unreadable header: the verified read that follows explains it
            return
        for key, entry in self.by_key.items():
            config = saved.get(f"{prefix}.{key}.memory", {}).get("config")
            if entry.memory is None and config is not None:
                device = _module_device(self.__dict__["_model"].get_submodule(entry.name), self.__dict__["_model"])
                entry.ensure(int(config["dim_key"]), int(config["dim_value"]), device=device)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _per_module(what: str, given: object, memories: ModuleMemories) -> dict[str, Any]:
    # values: what the caller gave per module (ModuleMemory.learn checks each)
    if isinstance(given, Mapping):
        return {memories.entry(name).name: value for name, value in given.items()}
    if isinstance(given, torch.Tensor):
        return {memories.entry(None).name: given}
    raise TypeError(f"{what}: expected a tensor or a mapping module name -> tensor, got {type(given).__name__}")


def wants_module_model(model: nn.Module, config: FaastConfig) -> bool:
    """Whether apply_faast attaches module memories only (FaastModuleModel): target_modules are set, no middle
    layers are asked for and the model is not a language model (no entry in faast.hf.targets and no output
    embeddings, e.g. an encoder classifier). A causal LM gets a FaastModel, which carries module memories too."""
    if config.target_modules is None or config.middle is not None:
        return False
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    get_head = getattr(model, "get_output_embeddings", None)
    return model_type not in TARGETS and (get_head is None or get_head() is None)


class FaastModuleModel(FaastModelBase):
    """Any model with memories on its target modules and nothing else; built by apply_faast (wants_module_model).

    Attributes:
        base_model: the wrapped model (frozen); calls go to it with the hooks active.
        faast_config: the FaastConfig (output and middle recorded None: no LM layers are attached).
        module_memories: ModuleMemories.
    """

    def __init__(self, base_model: nn.Module, config: FaastConfig) -> None:
        super().__init__(base_model)
        if config.target_modules is None:
            raise ValueError("config: FaastModuleModel needs FaastConfig(target_modules=...)")
        self.faast_config = dataclasses.replace(
            config, output=None, middle=None, regulariser=dataclasses.replace(config.regulariser),
            model_type=getattr(getattr(base_model, "config", None), "model_type", None), faast_version=__version__,
        )  # fmt: skip
        freeze(base_model)
        self._disabled = 0
        self.module_memories = ModuleMemories(base_model, self.faast_config, enabled=lambda: self._disabled == 0)

    def learn(
        self,
        *args: object,
        targets: torch.Tensor | Mapping[str, torch.Tensor] | None = None,
        mask: torch.Tensor | Mapping[str, torch.Tensor] | None = None,
        **batch: object,
    ) -> int:
        """Learn from one batch: `model.learn(**batch)` with the batch's `labels` as the target module's targets.

        Runs the base model once (eval mode, no grad, without labels, so no loss is computed) and pairs each target
        module's input with its targets: e.g. for a sequence classifier's `classifier`, the pooled input [B, d] with
        labels [B] (class ids, one-hot over the head's outputs; -100 not learned) or float targets [B, num_labels].
        targets: instead of labels, a tensor or a mapping module name -> tensor. Returns the rows learned.
        """
        labels = batch.pop("labels", None)
        if targets is None:
            targets = cast("torch.Tensor | Mapping[str, torch.Tensor] | None", labels)  # learn_modules checks it
        if targets is None:
            raise ValueError("targets: nothing to learn against (give labels in the batch, or targets=)")
        return self.learn_modules(*args, targets=targets, mask=mask, **batch)

    def learn_modules(
        self,
        *args: object,
        targets: torch.Tensor | Mapping[str, torch.Tensor],
        mask: torch.Tensor | Mapping[str, torch.Tensor] | None = None,
        **model_inputs: object,
    ) -> int:
        """Run the base model on `model_inputs` and learn each target module from its captured inputs (see
        ModuleMemories.learn_forward). Returns the rows learned."""
        with torch.no_grad(), eval_mode(self.base_model):
            return self.module_memories.learn_forward(lambda: self.base_model(*args, **model_inputs), targets, mask)

    def learn_module(
        self,
        inputs: torch.Tensor,
        *,
        targets: torch.Tensor,
        name: str | None = None,
        mask: torch.Tensor | None = None,
    ) -> int:
        """Learn one target module from its inputs [..., d_in] and targets (float [..., d_out] or class ids [...]).
        name: the module (None: the only target module). Returns the rows learned."""
        return self.module_memories.learn_inputs(inputs, targets, name=name, mask=mask)

    def solve(self) -> FaastModuleModel:
        """Solve every module memory now (otherwise the first forward pass after learning does)."""
        self.module_memories.solve()
        return self

    def fast_weights(self) -> list[FastWeights]:
        return [memory for _, memory in self.module_memories.named_memories()]

    def reset_fast_weights(self) -> FaastModuleModel:
        """Forget everything learned."""
        for memory in self.fast_weights():
            memory.reset()
        return self

    @contextlib.contextmanager
    def disable_faast(self) -> Iterator[None]:
        """Inside, every target module returns the base model's output, bit for bit."""
        self._disabled += 1
        try:
            yield
        finally:
            self._disabled -= 1

    def remove_faast(self) -> nn.Module:
        """Detach the hooks for good and return the base model (its parameters stay frozen)."""
        self.module_memories.remove_hooks()
        WRAPPED_BASE_MODELS.discard(self.base_model)
        return self.base_model

    def _holder(self) -> nn.Module:
        holder = nn.Module()
        holder.module_memories = self.module_memories
        return holder

    def save_fast_weights(self, path: str | Path) -> Path:
        """Write the module memories' statistics to one safetensors file, atomically (loads back bit-exact); the
        same layout as FaastModel.save_fast_weights (memories `module_memories.<module path>.memory`)."""
        return save_state(path, self._holder())

    def load_fast_weights(self, path: str | Path) -> FaastModuleModel:
        """Load statistics written by save_fast_weights (the memories must match; all or nothing)."""
        self.module_memories.prepare_load(path)
        load_checkpoint(path, self._holder())
        return self

    def save_pretrained(self, directory: str | Path, *, memories: bool = True) -> Path:
        """Write the FaastConfig (JSON) and, with memories=True, what the module memories learned (save_fast_weights'
        file), each atomically; memories=False removes such a file left by an earlier save. Module memories have no
        trained weights. faast.hf.from_pretrained(base_model, directory) rebuilds the model."""
        directory = Path(directory)
        if memories:
            self.save_fast_weights(directory / MEMORIES_NAME)
        elif (directory / MEMORIES_NAME).exists():
            (directory / MEMORIES_NAME).unlink()
        self.faast_config.save(directory / CONFIG_NAME)
        return directory

    def load_adapter(self, directory: str | Path) -> FaastModuleModel:
        """Check that `directory` was saved for the same target modules (there are no weights to load)."""
        saved = FaastConfig.load(Path(directory) / CONFIG_NAME)
        for name in ("target_modules", "module_fit"):
            if getattr(saved, name) != getattr(self.faast_config, name):
                raise ValueError(
                    f"{directory}: saved for {name}={getattr(saved, name)!r}, this model has "
                    f"{getattr(self.faast_config, name)!r}"
                )
        return self
