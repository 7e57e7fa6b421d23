"""Backprop baselines of the LM experiments, trained on the same learn data FAAST reads in one forward pass.

Experiment code, not part of the faast package (faast_lab.experiments.lm_baselines): lab/experiments/lm_ppl.py and
lab/experiments/lm_domains.py compare FAAST against these.

- `LinearProjection`: at FAAST's own layers, each block input h becomes h + h·A_l (A_l: d x d, zero-initialised, so it
  starts as the base model), trained by gradient descent on the causal-LM loss. It is what the fast weights'
  W·P would be if it were learned by backprop instead of solved in closed form.
- LoRA through peft (`apply_lora`), on the attention query/value projections of every block with the rank that
  matches a parameter budget (`lora_rank_for`), by default the linear projection's.
- `fit_causal_lm`: the training loop both use (AdamW over overlapping windows, fp32 master weights; by default
  one pass, optionally scored after each epoch or stopped at a wall-clock budget).
- `kv_cache_bytes`: the memory in-context learning adds (the prefix's key/value cache).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from faast.hf.targets import get_submodule, target_for
from faast.hf.tokens import overlapping_windows, pad_rows

# Attention projections LoRA adapts per model type (the LoRA paper's W_q, W_v; GPT-2 fuses q, k, v in c_attn).
LORA_MODULES: dict[str, tuple[str, ...]] = {
    "gpt2": ("c_attn",),
    "llama": ("q_proj", "v_proj"),
    "qwen2": ("q_proj", "v_proj"),
}


class LinearProjection(nn.Module):
    """h -> h + h·A_l at the inputs of the given blocks; A_l [d, d] float32, zero at start. `remove()` detaches it.

    The base model's parameters are not touched; only A is trainable.
    """

    def __init__(self, model: nn.Module, layers: Sequence[int]):
        super().__init__()
        blocks = get_submodule(model, target_for(model).blocks, "transformer blocks")
        if not layers:
            raise ValueError("layers: expected at least one block index, got none")
        bad = [i for i in layers if not 0 <= int(i) < len(blocks)]
        if bad:
            raise ValueError(f"layers: block indices must lie in [0, {len(blocks)}), got {bad}")
        hidden = int(model.config.hidden_size)
        device = next(model.parameters()).device
        self.layers = [int(i) for i in layers]
        self.weights = nn.ParameterDict(
            {str(i): nn.Parameter(torch.zeros(hidden, hidden, device=device)) for i in self.layers}
        )
        self._handles = [
            blocks[i].register_forward_pre_hook(self._hook(self.weights[str(i)]), with_kwargs=True)
            for i in self.layers
        ]

    @staticmethod
    def _hook(weight: nn.Parameter):  # noqa: ANN205 - a hook closure
        def hook(module: nn.Module, args: tuple, kwargs: dict):  # noqa: ANN202, ARG001
            hidden = args[0] if args else kwargs["hidden_states"]
            out = hidden + (hidden.float() @ weight).to(hidden.dtype)
            if args:
                return (out, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": out}

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())


def lora_rank_for(model: nn.Module, num_params: int, modules: Sequence[str] | None = None) -> int:
    """The LoRA rank r >= 1 whose trainable parameter count r·Σ(in + out) over `modules` is closest to num_params."""
    names = tuple(modules or LORA_MODULES.get(getattr(model.config, "model_type", None), ()))
    if not names:
        raise ValueError(
            f"modules: no LoRA target modules known for model type {model.config.model_type!r}; pass some"
        )
    per_rank = sum(
        sum(m.weight.shape) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in names and hasattr(m, "weight")
    )
    if per_rank == 0:
        raise ValueError(f"modules: none of {list(names)} found in {type(model).__name__}")
    return max(1, round(num_params / per_rank))


def apply_lora(model: nn.Module, rank: int, *, alpha: float | None = None, modules: Sequence[str] | None = None):  # noqa: ANN201
    """peft's LoRA (rank `rank`, scale alpha/r with alpha = 2r by default, no dropout) on `modules` of every block.

    Returns the PeftModel; `.unload()` gives back the unchanged base model. Needs `pip install peft`.
    """
    try:
        import peft
    except ImportError as err:
        raise ImportError("the LoRA baseline needs peft: `pip install peft` (or the 'experiments' extra)") from err
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank: expected an int >= 1, got {rank!r}")
    names = list(modules or LORA_MODULES[model.config.model_type])
    config = peft.LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=names, lora_dropout=0.0)
    was_training = model.training
    # peft returns its wrapper in train mode; left so, training and scoring would run the base model's dropout.
    return peft.get_peft_model(model, config).train(was_training)


@dataclass
class FitStats:
    """steps taken, tokens trained on (each window's predicted tokens), training seconds (the `on_epoch` and `on_step`
    callbacks' time left out), mean loss of the first and last 10% steps, and the optimizer steps one epoch takes."""

    steps: int
    tokens: int
    seconds: float
    first_loss: float
    last_loss: float
    steps_per_epoch: int = 0

    @property
    def epochs(self) -> float:
        """Epochs trained, fractional when a time budget stopped the training mid-epoch."""
        return self.steps / self.steps_per_epoch if self.steps_per_epoch else 0.0


def fit_causal_lm(
    model: nn.Module,
    params: Sequence[nn.Parameter],
    token_ids: Sequence[Sequence[int]],
    *,
    window: int = 1024,
    batch_size: int = 4,
    lr: float = 1e-3,
    epochs: int = 1,
    weight_decay: float = 0.0,
    seed: int = 0,
    autocast: torch.dtype | None = None,
    warmup: str = "total",
    on_epoch: Callable[[int], bool | None] | None = None,
    max_seconds: float | None = None,
    on_step: Callable[[int], bool | None] | None = None,
) -> FitStats:
    """Train `params` on the causal-LM loss over every adjacent pair of the texts (windows overlap by one token).

    AdamW with a linear warmup then constant lr; gradients clipped to norm 1. The rest of the model stays frozen and
    in eval mode (no dropout), as in the FAAST learn pass. `autocast` (e.g. torch.bfloat16): the forward pass runs
    under torch.autocast with that dtype (the parameters and AdamW's state keep theirs), the mixed-precision recipe a
    user would reach for to match FAAST's bfloat16 learning pass.

    warmup: 'total' warms up over the first 10% of all `epochs`' steps; 'epoch' over the first 10% of one epoch's
    steps, so training for E epochs is exactly the first E epochs of any longer run (the window order is drawn per
    epoch from one seeded generator either way): what per-epoch scoring and time-bounded training need.
    on_epoch(epoch): called after each full epoch (1-based) with the model still in eval mode; returning True stops
    the training there. Its time is not training time. on_step(step): the same after each optimizer step (1-based,
    counted across epochs), e.g. to score the model at every step count a time budget could end on. max_seconds:
    stop before a step that, at the mean step time so far, would end past this much training time (at least one step
    is taken); `epochs` is then an upper bound.
    """
    if autocast is not None and autocast not in (torch.bfloat16, torch.float16):
        raise ValueError(f"autocast: expected None, torch.bfloat16 or torch.float16, got {autocast!r}")
    if warmup not in ("total", "epoch"):
        raise ValueError(f"warmup: expected 'total' or 'epoch', got {warmup!r}")
    params = list(params)
    if not params:
        raise ValueError("params: expected trainable parameters, got none")
    windows = [w for ids in token_ids for w in overlapping_windows(ids, window)]
    if not windows:
        raise ValueError("token_ids: expected at least one text of >= 2 tokens, got none")
    per_epoch = math.ceil(len(windows) / batch_size)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    warmup_steps = max(1, (per_epoch if warmup == "epoch" else epochs * per_epoch) // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup_steps))
    device = params[0].device
    rng = random.Random(seed)
    losses, tokens = [], 0
    was_training = model.training
    model.eval()
    trained = 0.0  # training seconds: wall clock less the callbacks
    try:
        for epoch in range(1, epochs + 1):
            order = list(range(len(windows)))
            rng.shuffle(order)
            for start in range(0, len(order), batch_size):
                if max_seconds is not None and losses and trained * (len(losses) + 1) / len(losses) > max_seconds:
                    return _stats(losses, tokens, trained, per_epoch)
                began = time.perf_counter()
                ids, mask = pad_rows([windows[i] for i in order[start : start + batch_size]])
                ids, mask = ids.to(device), mask.to(device)
                labels = ids.masked_fill(~mask, -100)
                with torch.enable_grad():
                    with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
                        loss = model(input_ids=ids, attention_mask=mask.long(), labels=labels, use_cache=False).loss
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                schedule.step()
                losses.append(float(loss.detach()))  # waits for the step: its time is all in `trained`
                tokens += int((mask[:, 1:] & mask[:, :-1]).sum())
                trained += time.perf_counter() - began
                if on_step is not None and on_step(len(losses)):
                    return _stats(losses, tokens, trained, per_epoch)
            if on_epoch is not None and on_epoch(epoch):
                break
    finally:
        model.train(was_training)
    return _stats(losses, tokens, trained, per_epoch)


def _stats(losses: list[float], tokens: int, seconds: float, per_epoch: int) -> FitStats:
    tenth = max(1, len(losses) // 10)
    return FitStats(steps=len(losses), tokens=tokens, seconds=seconds, first_loss=sum(losses[:tenth]) / tenth,
                    last_loss=sum(losses[-tenth:]) / tenth, steps_per_epoch=per_epoch)  # fmt: skip


def kv_cache_bytes(model: nn.Module, tokens: int) -> int:
    """Bytes of the key/value cache a `tokens`-long prefix occupies (all layers, the model's parameter dtype)."""
    config = model.config
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    element = next(model.parameters()).element_size()
    return 2 * int(config.num_hidden_layers) * kv_heads * head_dim * tokens * element
