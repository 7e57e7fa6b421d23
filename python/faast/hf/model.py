"""apply_faast: attach memory layers to a frozen Hugging Face causal LM, and the FaastModel it returns.

Memory layers are forward pre-hooks on the model's own modules (targets.py), so no modeling code is copied and any
transformers version whose module layout matches the table works. The returned FaastModel wraps the base model:
calls and `generate` go to the base (with the hooks active), and it adds learn / reset / disable / save / load.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .. import _persist
from .._version import __version__
from ..checkpoint import load_checkpoint, save_state
from ._tokens import overlapping_windows, pad_rows
from .config import FaastConfig
from .layers import MemoryLayer, OutputMemoryLayer
from .targets import get_submodule, target_for

_log = logging.getLogger("faast.hf")

CONFIG_NAME = "faast_config.json"
WEIGHTS_NAME = "faast_adapter.safetensors"
FORMAT = "faast.hf.adapter"
FORMAT_VERSION = 1


@dataclass
class LearnStats:
    """What a learn call consumed: tokens fed (real, unpadded; a text cut into w overlapping windows counts its w - 1
    shared tokens twice), pairs added per memory layer (each adjacent pair of the text once), wall time."""

    tokens: int = 0
    pairs: int = 0
    batches: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def __iadd__(self, other: LearnStats) -> LearnStats:
        self.tokens += other.tokens
        self.pairs += other.pairs
        self.batches += other.batches
        self.seconds += other.seconds
        return self


@dataclass
class _LearnContext:
    pair_mask: torch.Tensor
    next_embeddings: torch.Tensor | None
    differentiable: bool


class FaastModel(nn.Module):
    """A causal LM with FAAST memory layers. Build it with `apply_faast(model, config)`.

    Attributes:
        base_model: the wrapped (frozen) transformers model; its modules carry the hooks.
        faast_config: the FaastConfig, with the model's shape filled in.
        memory_layers: nn.ModuleDict block index (str) -> MemoryLayer (`.memory`, `.readout`, `.scorer`).
        output_memory_layer: OutputMemoryLayer or None (`.memory`).
    Other attributes (config, device, generation_config, ...) are the base model's.
    """

    def __init__(self, base_model: nn.Module, config: FaastConfig):
        super().__init__()
        target = target_for(base_model)
        blocks = get_submodule(base_model, target.blocks, "transformer blocks")
        final_norm = get_submodule(base_model, target.final_norm, "final norm")
        self._backbone_path = target.backbone
        get_submodule(base_model, target.backbone, "decoder backbone")
        hidden = int(base_model.config.hidden_size)
        embeddings = base_model.get_input_embeddings()
        if config.output_layer and embeddings.embedding_dim != hidden:
            raise ValueError(
                f"model: the output memory layer needs input embeddings of the hidden size {hidden}, got "
                f"{embeddings.embedding_dim}; use FaastConfig(output_layer=False)"
            )
        num_params = sum(p.numel() for p in base_model.parameters())
        indices = config.block_indices(len(blocks), num_params)
        self.faast_config = FaastConfig.from_dict(
            {
                **config.to_dict(),
                "layers": indices,
                "model_type": base_model.config.model_type,
                "hidden_size": hidden,
                "num_hidden_layers": len(blocks),
                "faast_version": __version__,
            }
        )
        device = next(base_model.parameters()).device
        self.base_model = base_model
        for p in base_model.parameters():
            p.requires_grad_(False)
        self.memory_layers = nn.ModuleDict(
            {str(i): MemoryLayer(hidden, self.faast_config, i, device=device) for i in indices}
        )
        self.output_memory_layer = (
            OutputMemoryLayer(hidden, hidden, self.faast_config, device=device) if config.output_layer else None
        )
        self._disabled = 0
        self._learn: _LearnContext | None = None
        self._handles = [
            blocks[i].register_forward_pre_hook(self._block_hook(layer), with_kwargs=True)
            for i, layer in ((int(k), v) for k, v in self.memory_layers.items())
        ]
        if self.output_memory_layer is not None:
            self._handles.append(final_norm.register_forward_pre_hook(self._output_hook, with_kwargs=True))

    # ------------------------------------------------------------------ delegation to the base model

    def __getattr__(self, name: str):  # noqa: ANN204 - any attribute of the base model
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "base_model":
                raise
            return getattr(self._modules["base_model"], name)

    def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201 - the base model's signature
        return self.base_model(*args, **kwargs)

    def generate(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201 - the base model's signature
        return self.base_model.generate(*args, **kwargs)

    def faast_layers(self) -> Iterator[MemoryLayer | OutputMemoryLayer]:
        """Every memory layer: the middle ones in block order, then the output layer."""
        yield from self.memory_layers.values()
        if self.output_memory_layer is not None:
            yield self.output_memory_layer

    # ------------------------------------------------------------------ hooks

    def _block_hook(self, layer: MemoryLayer):  # noqa: ANN202 - a hook closure
        def hook(module: nn.Module, args: tuple, kwargs: dict):  # noqa: ANN202, ARG001
            if self._disabled:
                return None
            hidden = args[0] if args else kwargs["hidden_states"]
            if self._learn is not None:
                layer.learn(hidden, self._learn.pair_mask, differentiable=self._learn.differentiable)
                return None
            out = layer(hidden)
            if args:
                return (out, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": out}

        return hook

    def _output_hook(self, module: nn.Module, args: tuple, kwargs: dict):  # noqa: ANN202, ARG002
        if self._disabled:
            return None
        hidden = args[0] if args else kwargs["hidden_states"]
        if self._learn is not None:
            self.output_memory_layer.learn(hidden, self._learn.next_embeddings, self._learn.pair_mask)
            return None
        out = self.output_memory_layer(hidden)
        if args:
            return (out, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": out}

    @contextlib.contextmanager
    def disable_faast(self) -> Iterator[None]:
        """Inside, the memory layers neither read nor learn: outputs are the base model's, bit for bit."""
        self._disabled += 1
        try:
            yield
        finally:
            self._disabled -= 1

    def remove_faast(self) -> nn.Module:
        """Detach the hooks for good and return the base model (its parameters stay frozen)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        return self.base_model

    # ------------------------------------------------------------------ learning

    def _learn_batch(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, *, differentiable: bool = False
    ) -> LearnStats:
        input_ids, mask = _check_batch(input_ids, attention_mask, self.base_model)
        started = time.perf_counter()
        pair_mask = mask[:, :-1] & mask[:, 1:]
        # Positions count real tokens only, so a left-padded row learns exactly what the unpadded text gives.
        positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
        next_embeddings = None
        if self.output_memory_layer is not None:
            next_embeddings = self.base_model.get_input_embeddings()(input_ids[:, 1:])
        backbone = self.base_model.get_submodule(self._backbone_path)
        self._learn = _LearnContext(pair_mask, next_embeddings, differentiable)
        try:
            with torch.set_grad_enabled(differentiable), _eval_mode(self.base_model):
                backbone(input_ids=input_ids, attention_mask=mask.long(), position_ids=positions, use_cache=False)
        finally:
            self._learn = None
        return LearnStats(
            tokens=int(mask.sum()), pairs=int(pair_mask.sum()), batches=1, seconds=time.perf_counter() - started
        )

    def learn(
        self,
        inputs: torch.Tensor | str | Iterable,
        attention_mask: torch.Tensor | None = None,
        *,
        tokenizer: object | None = None,
        max_length: int = 1024,
        batch_size: int = 8,
        progress: bool | None = None,
    ) -> LearnStats:
        """Stream statistics from text into every memory layer; no keys are kept and hidden states are unchanged.

        Args:
            inputs: input_ids [B, T] (int64) with an optional attention_mask [B, T] (left or right padding: a pair
                counts only if both tokens are real); or a text, or an iterable of texts, of token-id lists, of
                input_ids tensors, or of tokenised batches (mappings with input_ids and optionally attention_mask).
                Texts and token-id lists are tokenised
                with `tokenizer`, split into windows of `max_length` tokens that overlap by one token (so no pair is
                lost) and learned `batch_size` windows at a time; an iterable is consumed lazily, so a corpus never
                has to fit in memory.
            progress: show a tqdm bar with tokens/s (default: when learning from an iterable and stderr is a tty).

        Returns LearnStats (tokens, pairs per layer, batches, seconds, tokens_per_second).
        """
        if isinstance(inputs, torch.Tensor):
            with torch.no_grad():
                return self._learn_batch(inputs, attention_mask)
        if attention_mask is not None:
            raise ValueError("attention_mask: only valid with an input_ids tensor; batches carry their own masks")
        if isinstance(inputs, str):
            inputs = [inputs]
        if isinstance(inputs, Mapping) or (
            isinstance(inputs, list | tuple) and inputs and all(isinstance(t, int) for t in inputs)
        ):
            inputs = [inputs]  # one tokenised batch, or one text as token ids
        batches = _batches(inputs, tokenizer, max_length, batch_size)
        stats = LearnStats()
        bar = _progress_bar(progress)
        try:
            with torch.no_grad():
                for ids, mask in batches:
                    stats += self._learn_batch(ids, mask)
                    if bar is not None:
                        bar.update(int(mask.sum()) if mask is not None else ids.numel())
                        bar.set_postfix_str(f"{stats.tokens_per_second:,.0f} tok/s", refresh=False)
        finally:
            if bar is not None:
                bar.close()
        return stats

    def reset_fast_weights(self) -> FaastModel:
        """Forget everything learned (the readout and scorer stay)."""
        for layer in self.faast_layers():
            layer.memory.reset()
        return self

    # ------------------------------------------------------------------ persistence

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write the FaastConfig (JSON) and the readout + scorer weights (safetensors, fp32), atomically.

        Nothing of the base model is written; load with faast.hf.from_pretrained(base_model, directory). The
        learned fast weights are state of their own: save_fast_weights.
        """
        directory = Path(directory)
        tensors = {}
        for key, layer in self.memory_layers.items():
            tensors[f"layers.{key}.readout.weight"] = layer.readout.weight
            if layer.scorer is not None:
                tensors[f"layers.{key}.scorer.weight"] = layer.scorer.weight
        metadata = {
            "format": FORMAT,
            "format_version": str(FORMAT_VERSION),
            "faast_version": __version__,
            "config": self.faast_config.to_json(),
        }
        _persist.write_atomic(directory / WEIGHTS_NAME, tensors, metadata)
        self.faast_config.save(directory / CONFIG_NAME)
        return directory

    def load_adapter(self, directory: str | Path) -> FaastModel:
        """Load readout + scorer weights written by save_pretrained into this model (all or nothing)."""
        path = Path(directory) / WEIGHTS_NAME
        tensors, metadata = _persist.read_verified(path)
        if metadata.get("format") != FORMAT:
            raise ValueError(f"{path}: not a {FORMAT} file (format={metadata.get('format')!r})")
        if int(metadata.get("format_version", "0")) > FORMAT_VERSION:
            raise ValueError(f"{path}: written by a newer faast; upgrade faast")
        saved = FaastConfig.from_json(metadata["config"])
        mine = self.faast_config
        for name in ("model_type", "hidden_size", "num_hidden_layers", "layers", "scorer", "output_layer"):
            if getattr(saved, name) != getattr(mine, name):
                raise ValueError(
                    f"{path}: saved for {name}={getattr(saved, name)!r}, this model has {getattr(mine, name)!r}"
                )
        expected = {}
        for key, layer in self.memory_layers.items():
            expected[f"layers.{key}.readout.weight"] = layer.readout.weight
            if layer.scorer is not None:
                expected[f"layers.{key}.scorer.weight"] = layer.scorer.weight
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
        return self

    def save_fast_weights(self, path: str | Path) -> Path:
        """Write every memory layer's statistics to one safetensors file, atomically (loads back bit-exact)."""
        return save_state(path, self._memories_module())

    def load_fast_weights(self, path: str | Path) -> FaastModel:
        """Load statistics written by save_fast_weights (the layers must match; all or nothing)."""
        load_checkpoint(path, self._memories_module())
        return self

    def _memories_module(self) -> nn.Module:
        holder = nn.Module()
        holder.memory_layers = self.memory_layers
        if self.output_memory_layer is not None:
            holder.output_memory_layer = self.output_memory_layer
        return holder

    def fast_weight_bytes(self) -> int:
        """Bytes of learned state (float64 statistics of every memory layer): independent of tokens learned."""
        return sum(b.numel() * b.element_size() for layer in self.faast_layers() for b in layer.memory.buffers())


# ---------------------------------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    # Learning reads the frozen model's activations: no dropout even while a readout is being trained.
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


def _check_batch(input_ids: object, attention_mask: object, model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids: expected an int64 tensor [batch, seq], got {_describe(input_ids)}")
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.dim() != 2 or input_ids.numel() == 0:
        raise ValueError(f"input_ids: expected a non-empty [batch, seq] tensor, got shape {list(input_ids.shape)}")
    vocab = model.get_input_embeddings().num_embeddings
    if bool((input_ids < 0).any()) or bool((input_ids >= vocab).any()):
        raise ValueError(
            f"input_ids: token ids must lie in [0, {vocab}), got [{int(input_ids.min())}, " f"{int(input_ids.max())}]"
        )
    device = model.get_input_embeddings().weight.device
    if input_ids.device != device:
        raise ValueError(f"input_ids: on {input_ids.device}, the model is on {device}")
    if attention_mask is None:
        mask = torch.ones_like(input_ids, dtype=torch.bool)
    else:
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"attention_mask: expected a tensor [batch, seq] or None, got {_describe(attention_mask)}")
        if attention_mask.dim() == 1:
            attention_mask = attention_mask.unsqueeze(0)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask: expected shape {list(input_ids.shape)} like input_ids, got "
                f"{list(attention_mask.shape)}"
            )
        if attention_mask.device != input_ids.device:
            raise ValueError(f"attention_mask: on {attention_mask.device}, input_ids on {input_ids.device}")
        if attention_mask.dtype != torch.bool and bool(((attention_mask != 0) & (attention_mask != 1)).any()):
            raise ValueError("attention_mask: expected 0/1 (or bool) entries")
        mask = attention_mask.bool()
    return input_ids.long(), mask


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {list(x.shape)}"
    return type(x).__name__


def _batches(
    inputs: Iterable, tokenizer: object | None, max_length: int, batch_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """(input_ids, attention_mask) batches from texts, id tensors or tokenised mappings, lazily."""
    if not isinstance(max_length, int) or max_length < 2:
        raise ValueError(f"max_length: expected an int >= 2, got {max_length!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
    pending: list[list[int]] = []
    for n, item in enumerate(inputs):
        if isinstance(item, Mapping):
            if "input_ids" not in item:
                raise ValueError(f"inputs[{n}]: a tokenised batch needs 'input_ids', got keys {sorted(item)}")
            yield (
                torch.as_tensor(item["input_ids"]),
                (None if item.get("attention_mask") is None else torch.as_tensor(item["attention_mask"])),
            )
            continue
        if isinstance(item, torch.Tensor):
            yield item, None
            continue
        if isinstance(item, str):
            if tokenizer is None:
                raise ValueError("tokenizer: required to learn from texts")
            ids = tokenizer(item, add_special_tokens=False)["input_ids"]
        elif isinstance(item, list | tuple) and all(isinstance(t, int) for t in item):
            ids = item
        else:
            raise TypeError(
                f"inputs[{n}]: expected a text, a list of token ids, an input_ids tensor or a mapping, got "
                f"{type(item).__name__}"
            )
        for window in overlapping_windows(ids, max_length):
            pending.append(window)
            if len(pending) == batch_size:
                yield pad_rows(pending)
                pending = []
    if pending:
        yield pad_rows(pending)


def _progress_bar(progress: bool | None):  # noqa: ANN202 - tqdm or None
    import sys

    if progress is None:
        progress = sys.stderr.isatty()
    if not progress:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        _log.info("faast: install tqdm for a progress bar")
        return None
    return tqdm(unit="tok", unit_scale=True, desc="faast learn")


# ---------------------------------------------------------------------------------------------------- entry points


def apply_faast(model: nn.Module, config: FaastConfig | None = None) -> FaastModel:
    """Attach FAAST memory layers to a transformers causal LM (gpt2, llama, qwen2) and freeze its parameters.

    Args:
        model: a *ForCausalLM model; it is modified in place (hooks on its blocks and final norm).
        config: FaastConfig (default: FaastConfig(), the paper's placement).

    Returns a FaastModel wrapping `model`: call it or `generate` as the base model, plus learn, reset_fast_weights,
    disable_faast, save_pretrained, save_fast_weights / load_fast_weights.
    """
    if isinstance(model, FaastModel):
        raise ValueError("model: FAAST is already applied to this model")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a transformers causal LM (nn.Module), got {type(model).__name__}")
    if config is None:
        config = FaastConfig()
    if not isinstance(config, FaastConfig):
        raise TypeError(f"config: expected a faast.hf.FaastConfig, got {type(config).__name__}")
    return FaastModel(model, config)


def from_pretrained(base_model: nn.Module, directory: str | Path) -> FaastModel:
    """Apply the FaastConfig saved in `directory` to `base_model` and load its readout and scorer weights."""
    directory = Path(directory)
    path = directory / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"directory: no {CONFIG_NAME} in {directory} (write one with save_pretrained)")
    config = FaastConfig.load(path)
    model = apply_faast(base_model, config)
    for name in ("model_type", "hidden_size", "num_hidden_layers"):
        if getattr(config, name) is not None and getattr(config, name) != getattr(model.faast_config, name):
            model.remove_faast()
            raise ValueError(
                f"{directory}: saved for {name}={getattr(config, name)!r}, the base model has "
                f"{getattr(model.faast_config, name)!r}"
            )
    try:
        model.load_adapter(directory)
    except BaseException:
        model.remove_faast()
        raise
    return model
