"""Where faast attaches to a Hugging Face causal LM: a per-model-type table, and discovery for types not in it.

A memory layer is a forward pre-hook on a block (it rewrites the block's input hidden states); the output layer
hooks the final norm (the 'embedding' layer rewrites the norm's input, the 'residual' layer its output). No modeling
code is copied, so supporting an architecture is one `Target` entry in TARGETS giving three module paths:

    backbone    the decoder without the LM head (learning runs only this), e.g. "model"
    blocks      the nn.ModuleList of decoder blocks, e.g. "model.layers"
    final_norm  the norm applied to the last block's output, whose output the LM head reads, e.g. "model.norm"

and how the logits follow from the LM head (the residual output layer computes p = softmax(h̃ Hᵀ + b) itself, so it
must see the logits the model samples from):

    logit_multiplier / logit_divisor  a config attribute the logits are multiplied / divided by (cohere's
                                      logit_scale, granite's logits_scaling): folded into the head the residual
                                      layer reads (ScaledHead, from residual_head), so its statistics stay exact.
    logit_softcap                     a config attribute c; when set the logits are c·tanh(z/c) (gemma2, gemma3_text).
                                      Not linear in h̃: the residual output layer is refused for such a model (the
                                      'embedding' output layer and the middle layers do not read the logits).

Every entry is checked on a tiny model built in-process (tests/test_hf_archs.py): faast disabled gives the base
logits bit for bit, learned pair counts are exact under left and right padding, KV-cache generation equals
generation without a cache, and the residual layer's logits equal the model's.

A model type not in the table goes through `discover_target` (logged once per type): the backbone is the model's
`base_model_prefix` attribute, the blocks the nn.ModuleList under it with `config.num_hidden_layers` entries (the one
holding the most parameters if several), and the final norm the norm-like module outside the blocks that a
three-token trace forward shows is applied to the last block's output. The trace also checks that the blocks run
once each, in order, and whether the logits are the LM head applied to the norm's output; when they are not, the
residual output layer is refused for that model. Anything not found is refused with a message naming it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_log = logging.getLogger("faast.hf")


@dataclass(frozen=True)
class Target:
    """Module paths (dotted, from the *ForCausalLM model) and the logits' relation to the LM head."""

    backbone: str  # the decoder without the LM head: learning runs only this
    blocks: str  # nn.ModuleList of transformer blocks
    final_norm: str  # the norm after the last block; the LM head reads its output
    logit_multiplier: str | None = None  # config attribute: logits = head(h̃) · config.<it>
    logit_divisor: str | None = None  # config attribute: logits = head(h̃) / config.<it>
    logit_softcap: str | None = None  # config attribute c: when set, logits = c·tanh(head(h̃)/c)
    logits_from_head: bool = True  # False: discovery saw logits that are not the (scaled) head of the norm's output
    discovered: bool = False  # found by discover_target, not taken from TARGETS


def _decoder(
    backbone: str = "model", blocks: str = "layers", final_norm: str = "norm", *,
    logit_multiplier: str | None = None, logit_divisor: str | None = None, logit_softcap: str | None = None,
) -> Target:  # fmt: skip
    return Target(
        backbone=backbone, blocks=f"{backbone}.{blocks}", final_norm=f"{backbone}.{final_norm}",
        logit_multiplier=logit_multiplier, logit_divisor=logit_divisor, logit_softcap=logit_softcap,
    )  # fmt: skip


_LLAMA = _decoder()  # model.layers, model.norm: Llama's layout, shared by most decoder LMs
_GPT2 = _decoder("transformer", "h", "ln_f")

TARGETS: dict[str, Target] = {
    "bloom": _GPT2,
    "codegen": _GPT2,
    "cohere": _decoder(logit_multiplier="logit_scale"),
    "cohere2": _decoder(logit_multiplier="logit_scale"),
    "exaone4": _LLAMA,
    "falcon": _GPT2,
    "gemma": _LLAMA,  # scales its input embeddings by sqrt(d): the input side only, the logits are lm_head(h̃)
    "gemma2": _decoder(logit_softcap="final_logit_softcapping"),
    "gemma3_text": _decoder(logit_softcap="final_logit_softcapping"),  # Gemma3ForCausalLM (text only)
    "glm": _LLAMA,
    "glm4": _LLAMA,
    "gpt2": _GPT2,
    "gpt_bigcode": _GPT2,
    "gpt_neox": _decoder("gpt_neox", "layers", "final_layer_norm"),
    "gpt_oss": _LLAMA,
    "gptj": _GPT2,
    "granite": _decoder(logit_divisor="logits_scaling"),
    "granitemoe": _decoder(logit_divisor="logits_scaling"),
    "helium": _LLAMA,
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "mixtral": _LLAMA,
    "mpt": _decoder("transformer", "blocks", "norm_f"),
    "nemotron": _LLAMA,
    "olmo": _LLAMA,
    "olmo2": _LLAMA,
    "olmo3": _LLAMA,
    "olmoe": _LLAMA,
    "opt": _decoder("model", "decoder.layers", "decoder.final_layer_norm"),
    "phi": _decoder(final_norm="final_layernorm"),
    "phi3": _LLAMA,
    "qwen2": _LLAMA,
    "qwen2_moe": _LLAMA,
    "qwen3": _LLAMA,
    "qwen3_moe": _LLAMA,
    "seed_oss": _LLAMA,
    "smollm3": _LLAMA,
    "stablelm": _LLAMA,
    "starcoder2": _LLAMA,
}


def target_for(model: PreTrainedModel) -> Target:
    """The table entry for `model.config.model_type`, or `discover_target(model)` for a type not in the table."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in TARGETS:
        return TARGETS[model_type]
    return discover_target(model)


def get_submodule(model: PreTrainedModel, path: str, what: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise ValueError(
            f"model: expected the {what} at '{path}' for model type {model.config.model_type!r}, but "
            f"{type(model).__name__} has none (pass the *ForCausalLM model)"
        ) from None


# ---------------------------------------------------------------------------------------------------- the logits


class LMHead(Protocol):
    """What the residual output layer (faast.hf.output) reads of the LM head: `weight` H [V, d], logits = h̃ Hᵀ + b.
    It also reads `bias` b [V] and `scale` where the head has them (getattr: a head without a bias has none). An
    nn.Linear head and a ScaledHead are LMHeads; a head typed only as nn.Module (get_output_embeddings()) becomes one
    once its `weight` is checked to be a tensor [V, d]."""

    @property
    def weight(self) -> torch.Tensor:
        """H [V, d], any floating dtype."""


class ScaledHead:
    """The LM head as the logits see it: `weight` [V, d] and `bias` [V] (or None) times a constant `scale` (an LMHead).

    Read-only views for the residual output layer (faast.hf.output reads `.weight` and `.bias`); each read forms the
    product (in float32, or float64 for a float64 head) from the live head, so moving or re-casting the model needs
    no refresh. Not an nn.Module: the model's head stays the only owner of its parameters.
    """

    def __init__(self, head: nn.Module, scale: float):
        self.head, self.scale = head, float(scale)

    def _scaled(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.promote_types(t.dtype, torch.float32)) * self.scale

    @property
    def weight(self) -> torch.Tensor:
        return self._scaled(cast(torch.Tensor, self.head.weight))  # an LM head's weight parameter

    @property
    def bias(self) -> torch.Tensor | None:
        bias = getattr(self.head, "bias", None)
        return None if bias is None else self._scaled(bias)


def logit_scale(model: PreTrainedModel, target: Target) -> float:
    """The constant the model multiplies `lm_head(h̃)` by to get its logits (1.0 for most types)."""
    scale = 1.0
    for name, invert in ((target.logit_multiplier, False), (target.logit_divisor, True)):
        if name is None:
            continue
        value = getattr(model.config, name, None)
        if not isinstance(value, int | float) or isinstance(value, bool) or value == 0:
            raise ValueError(f"model: config.{name} must be a non-zero number for model type "
                             f"{model.config.model_type!r}, got {value!r}")  # fmt: skip
        scale = scale / value if invert else scale * value
    return scale


def residual_head(model: PreTrainedModel, target: Target) -> nn.Module | ScaledHead | None:
    """The LM head the residual output layer fits: the model's output embedding (None when it has none), wrapped in
    ScaledHead when the type scales its logits. A model whose logits are not linear in the final norm's output
    (softcapping, or an unknown transform found by discovery) is refused: the layer's p and its Newton step would be
    those of another model."""
    model_type = model.config.model_type
    fix = "use FaastConfig(output=EmbeddingOutput()) or output=None"
    cap = None if target.logit_softcap is None else getattr(model.config, target.logit_softcap, None)
    if cap is not None:
        raise ValueError(
            f"model: model type {model_type!r} softcaps its logits (config.{target.logit_softcap}={cap!r}, logits = "
            f"c·tanh(z/c)); the residual output layer assumes logits linear in the final norm's output; {fix}"
        )
    if not target.logits_from_head:
        raise ValueError(
            f"model: the logits of model type {model_type!r} (discovered, not in faast.hf.targets.TARGETS) are not "
            f"the LM head applied to the final norm's output; the residual output layer needs them to be; {fix}"
        )
    head = model.get_output_embeddings()
    scale = logit_scale(model, target)
    return head if head is None or scale == 1.0 else ScaledHead(head, scale)


# ---------------------------------------------------------------------------------------------------- discovery

_DISCOVERY_LOGGED: set[str | None] = set()  # model types; None for a config without one


def _is_norm(module: nn.Module) -> bool:
    # Covers torch's norms and every transformers *Norm class (LlamaRMSNorm, OlmoLayerNorm, ...), which do not
    # subclass a common base.
    norms = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)
    return isinstance(module, norms) or "norm" in type(module).__name__.lower()


def _first_tensor(x: object) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, tuple | list) and x and isinstance(x[0], torch.Tensor):
        return x[0]
    return getattr(x, "last_hidden_state", None)


def discover_target(model: PreTrainedModel) -> Target:
    """Find the backbone, block list and final norm of a causal LM whose model type is not in TARGETS.

    The backbone is the submodule named by `model.base_model_prefix`; the blocks are the nn.ModuleList under it with
    exactly `config.num_hidden_layers` entries (the one holding the most parameters if several); the final norm is
    the first norm-like module outside the blocks that a trace forward (3 tokens, no grad, no cache, eval mode) shows
    applied to the last block's output. The trace also checks that every block runs once, in order, and records
    whether the logits equal the LM head applied to the norm's output (`logits_from_head`).

    Returns a Target with discovered=True. Raises ValueError naming the attribute it could not find or check. Logs
    once per model type (logger "faast.hf") that discovery was used.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    name = type(model).__name__

    def refuse(reason: str) -> ValueError:
        return ValueError(
            f"model: faast.hf supports model types {sorted(TARGETS)}, got {model_type!r} ({name}), and discovery "
            f"failed: {reason}; add an entry to faast.hf.targets.TARGETS to support it"
        )

    if config is None or not isinstance(model, nn.Module):
        raise refuse("the model has no `config` (pass a transformers *ForCausalLM model)")
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(text_config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers < 1:
        raise refuse(f"config.num_hidden_layers is {layers!r}, expected the number of decoder blocks")
    if not isinstance(getattr(config, "hidden_size", None), int):
        raise refuse("config.hidden_size is missing (the width of the decoder's hidden states)")
    prefix = getattr(model, "base_model_prefix", None)
    backbone = getattr(model, prefix, None) if isinstance(prefix, str) and prefix else None
    if not isinstance(backbone, nn.Module):
        raise refuse(f"no backbone: base_model_prefix is {prefix!r} and the model has no submodule by that name")

    lists = [(path, m) for path, m in backbone.named_modules() if isinstance(m, nn.ModuleList)]
    matching = [(path, m) for path, m in lists if len(m) == layers]
    if not matching:
        found = {path: len(m) for path, m in lists}
        raise refuse(f"no block list: no nn.ModuleList under '{prefix}' has config.num_hidden_layers={layers} "
                     f"entries (found {found or 'none'})")  # fmt: skip
    sizes = [sum(p.numel() for p in m.parameters()) for _, m in matching]
    best = max(sizes)
    if sizes.count(best) > 1:
        tied = [path for (path, _), size in zip(matching, sizes, strict=True) if size == best]
        raise refuse(f"ambiguous block list: {tied} under '{prefix}' all have {layers} entries and equal size")
    block_path, blocks = matching[sizes.index(best)]
    inside = {id(m) for m in blocks.modules()}
    norms = [(path, m) for path, m in backbone.named_modules() if _is_norm(m) and id(m) not in inside]
    if not norms:
        raise refuse(f"no final norm: no norm module under '{prefix}' outside '{prefix}.{block_path}'")

    norm_path, from_head = _trace(model, blocks, norms, refuse)
    assert isinstance(prefix, str)  # for the type checker: a backbone was found under it
    target = Target(
        backbone=prefix, blocks=f"{prefix}.{block_path}", final_norm=f"{prefix}.{norm_path}",
        logits_from_head=from_head, discovered=True,
    )  # fmt: skip
    if model_type not in _DISCOVERY_LOGGED:
        _DISCOVERY_LOGGED.add(model_type)
        _log.warning(
            "faast: model type %r is not in faast.hf.targets.TARGETS; discovered backbone=%r, blocks=%r, "
            "final_norm=%r%s", model_type, target.backbone, target.blocks, target.final_norm,
            "" if from_head else " (logits are not the LM head of the norm's output: no residual output layer)",
        )  # fmt: skip
    return target


def _trace(
    model: PreTrainedModel, blocks: nn.ModuleList, norms: list, refuse: Callable[[str], ValueError]
) -> tuple[str, bool]:
    """Run 3 tokens through `model` with hooks on the blocks and on the candidate norms [(path, module)]: (the final
    norm's path, whether the logits equal the LM head applied to its output). `refuse(reason)` makes the error."""
    calls: list[int] = []
    seen: dict[str, torch.Tensor | str | None] = {}  # "last" and "out": tensors (or None); "norm": a path
    handles = []

    def after_block(i: int) -> Callable[..., None]:  # a forward hook
        def hook(module: nn.Module, args: tuple, output: object) -> None:  # noqa: ARG001
            calls.append(i)
            if i == len(blocks) - 1:
                seen["last"] = _first_tensor(output)

        return hook

    def at_norm(path: str) -> Callable[..., None]:  # a forward hook with kwargs
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> None:  # noqa: ARG001
            hidden = args[0] if args else kwargs.get("hidden_states")
            # The first norm to read the last block's output, bit for bit, is the final norm.
            last = seen.get("last")
            if "norm" not in seen and isinstance(last, torch.Tensor) and isinstance(hidden, torch.Tensor):
                if hidden.shape == last.shape and torch.equal(hidden, last):
                    seen["norm"], seen["out"] = path, _first_tensor(output)

        return hook

    for i, block in enumerate(blocks):
        handles.append(block.register_forward_hook(after_block(i)))
    for path, norm in norms:
        handles.append(norm.register_forward_hook(at_norm(path), with_kwargs=True))
    embeddings = model.get_input_embeddings()
    vocab = getattr(embeddings, "num_embeddings", None) or int(model.config.vocab_size)
    ids = torch.arange(3, device=cast(torch.Tensor, embeddings.weight).device).remainder(vocab).unsqueeze(0)
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = _first_tensor(getattr(model(input_ids=ids, use_cache=False), "logits", None))
    except Exception as e:  # noqa: BLE001 - any failure of the trace is a refusal that says what failed
        raise refuse(f"the trace forward (3 tokens) failed with {type(e).__name__}: {e}") from e
    finally:
        model.train(was)
        for h in handles:
            h.remove()
    if calls != list(range(len(blocks))):
        raise refuse(f"the blocks did not run once each in order in a forward pass (ran {calls})")
    if "norm" not in seen:
        raise refuse("no final norm: no norm module reads the last block's output")
    with torch.no_grad():
        # seen["out"]: the final norm's output, a tensor for every norm module (typed loosely by `seen`).
        from_head = _logits_from_head(logits, cast(torch.Tensor, seen["out"]), model.get_output_embeddings())
    return cast(str, seen["norm"]), from_head


def _logits_from_head(logits: torch.Tensor | None, out: torch.Tensor, head: nn.Module | None) -> bool:
    """Whether logits [B, T, V] equal head(out) for the final norm's output out [B, T, d], to float32 rounding."""
    weight = getattr(head, "weight", None)
    if logits is None or not isinstance(weight, torch.Tensor) or out.shape[-1] != weight.shape[-1]:
        return False
    bias = getattr(head, "bias", None)
    expected = out.float() @ weight.float().T + (0 if bias is None else bias.float())
    if expected.shape != logits.shape:
        return False
    tol = 1e-4 * float(expected.abs().max().clamp_min(1e-30))
    return torch.allclose(logits.float(), expected, rtol=1e-4, atol=tol)
