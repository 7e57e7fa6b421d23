"""The forward hooks that put a FaastModel's memory layers into the base model, and the state they share.

Memory layers are forward (pre-)hooks on the model's own modules (faast/hf/targets.py: its blocks, final norm and LM
head), so no modeling code is copied. Outside learning a hook reads its layer (h + h·M). During a learning pass
(`ModelHooks.learning`) the hooks only capture: each middle layer's pairs go into the pass's BankCapture, and the
output layer's inputs into `LearnPass.output_rows`; the learning loop adds every statistic after the pass.

The residual output layer can read keys wider than h̃ (ResidualOutput.key_layers): the RMS-normalised inputs of
early blocks, taken by pre-hooks registered before the middle layers' hooks on the same block, so they see the input
before a middle layer changes it (hooks run in registration order).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import cast

import torch
from torch import nn

from .capture import BankCapture, next_token_pairs
from .layers import MemoryLayer, OutputMemoryLayer
from .lm import as_lm
from .output import ResidualOutputLayer, key_state
from .rows import RowMemories

PARTS = ("all", "middle", "output", "modules")


@dataclass
class LearnPass:
    """One learning forward pass: what the hooks need and what they capture.

    pair_mask: [B, T-1] bool, the pairs learned. next_embeddings: [B, T-1, d] the next tokens' input embeddings (the
    paper's output layer only). capture: the middle layers' BankCapture (None without middle layers). output_rows: set
    by the output layer's hook: (keys, values) for the paper's layer, (h̃ [B, T, d], None) for the residual one.
    """

    pair_mask: torch.Tensor
    next_embeddings: torch.Tensor | None
    capture: BankCapture | None
    output_rows: tuple[torch.Tensor, torch.Tensor | None] | None = None


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _with_hidden(args: tuple, kwargs: dict, hidden: torch.Tensor) -> tuple[tuple, dict]:
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


class ModelHooks:
    """The hooks of one FaastModel on its base model, and what they share: which parts are disabled, the learning
    pass in progress, and the key states of the current forward pass.

    Args:
        base_model: the transformers model (its modules get the hooks).
        blocks: its transformer blocks; final_norm: its final norm.
        middle_layers: block index -> MemoryLayer (read before that block).
        output_layer: the ResidualOutputLayer, the paper's OutputMemoryLayer, or None.
        key_blocks: the blocks whose inputs widen the residual output layer's keys (ResidualOutput.key_layers).
    """

    def __init__(
        self,
        base_model: nn.Module,
        blocks: nn.ModuleList,
        final_norm: nn.Module,
        middle_layers: dict[int, MemoryLayer],
        output_layer: ResidualOutputLayer | OutputMemoryLayer | None,
        key_blocks: list[int],
    ) -> None:
        self.output_layer = output_layer
        self.key_blocks = list(key_blocks)
        self._disabled = dict.fromkeys(PARTS, 0)
        self._pass: LearnPass | None = None
        self._key_states: list[torch.Tensor | None] = [None] * len(self.key_blocks)
        self._final_states: torch.Tensor | None = None
        self._rows: RowMemories | None = None  # a call with memory_names: each row reads its own memory
        self._handles = [
            blocks[i].register_forward_pre_hook(partial(self._key_hook, slot), with_kwargs=True)
            for slot, i in enumerate(self.key_blocks)
        ]
        self._handles += [
            blocks[i].register_forward_pre_hook(partial(self._block_hook, layer), with_kwargs=True)
            for i, layer in middle_layers.items()
        ]
        if isinstance(output_layer, ResidualOutputLayer):
            self._handles.append(final_norm.register_forward_hook(self._residual_hook))
            # Probability space mixes at the head's output (its input is the final norm's output, as the model
            # slices it, e.g. the last position only while generating).
            # apply_faast refuses a model without a head (faast.hf.targets), so there is one to hook.
            head = cast(nn.Module, as_lm(base_model).get_output_embeddings())
            self._handles.append(head.register_forward_hook(self._head_hook))
        elif output_layer is not None:
            self._handles.append(final_norm.register_forward_pre_hook(self._output_hook, with_kwargs=True))

    # ------------------------------------------------------------------ state

    def disabled(self, part: str) -> bool:
        """Whether `part` ('middle', 'output' or 'modules') is disabled now, by itself or by 'all'."""
        return self._disabled["all"] > 0 or self._disabled[part] > 0

    @contextlib.contextmanager
    def disable(self, which: str = "all") -> Iterator[None]:
        """Inside, the `which` part of the memory layers neither reads nor learns (nestable)."""
        if which not in PARTS:
            raise ValueError(f"which: expected 'all', 'middle' or 'output' (or 'modules'), got {which!r}")
        self._disabled[which] += 1
        try:
            yield
        finally:
            self._disabled[which] -= 1

    @contextlib.contextmanager
    def learning(self, learn_pass: LearnPass) -> Iterator[LearnPass]:
        """Inside, the hooks capture into `learn_pass` instead of reading the memories."""
        self._pass = learn_pass
        try:
            yield learn_pass
        finally:
            self._pass = None

    @contextlib.contextmanager
    def routing(self, rows: RowMemories) -> Iterator[None]:
        """Inside, each row of a forward pass reads the memory `rows` gives it (FaastModel's memory_names)."""
        if self._rows is not None:
            raise RuntimeError("memory_names: a call with memory_names is already running on this model")
        self._rows = rows
        try:
            yield
        finally:
            self._rows = None

    def remove(self) -> None:
        """Detach every hook for good."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def extra_keys(self, hidden: torch.Tensor, final: torch.Tensor | None = None) -> torch.Tensor | None:
        """The extra keys [B, T', d·len(key_blocks)] for hidden [B, T', d], the final norm's output as the head reads
        it (the model may keep only its last T' positions, e.g. one while generating): the last T' positions of the
        key states captured in this forward pass. They are used once: the next pass captures its own. final: the
        final norm's output of the pass [B, T, d], to check that the head reads its last T' positions (a model asked
        for other positions, e.g. logits_to_keep as an index tensor, is refused rather than read misaligned)."""
        if not self.key_blocks:
            return None
        states, self._key_states = self._key_states, [None] * len(self.key_blocks)
        rows = hidden.shape[-2] if hidden.dim() >= 2 else 1
        if final is not None and final.shape[-2] != rows and not torch.equal(final[..., final.shape[-2] - rows :, :],
                                                                             hidden):  # fmt: skip
            raise ValueError(
                "logits_to_keep: the output layer's wider keys (ResidualOutput.key_layers) align the head's rows "
                "with the last positions of the pass; ask for the last k positions (an int), or use "
                "ResidualOutput(key_layers=[])"
            )
        if any(s is None or s.shape[:-2] != hidden.shape[:-2] or s.shape[-2] < rows for s in states):
            got = [None if s is None else list(s.shape) for s in states]
            raise RuntimeError(
                f"faast: the output layer reads the inputs of blocks {self.key_blocks} of the same forward pass "
                f"(for hidden states of shape {list(hidden.shape)}), but captured {got}: call the model, not its "
                f"head alone"
            )
        captured = cast("list[torch.Tensor]", states)  # none is None: checked above
        return torch.cat([s[..., s.shape[-2] - rows :, :] for s in captured], -1)

    # ------------------------------------------------------------------ hooks

    def _block_hook(
        self,
        layer: MemoryLayer,
        module: nn.Module,  # noqa: ARG002
        args: tuple,
        kwargs: dict,
    ) -> tuple[tuple, dict] | None:
        if self.disabled("middle"):
            return None
        hidden = _hidden(args, kwargs)
        if self._pass is not None:
            # Capture only: the bank learns every layer at once after the pass.
            # Middle layers come with a bank, and a learning pass over a bank brings its capture.
            cast(BankCapture, self._pass.capture).add(layer.slot, hidden)
            return None
        if self._rows is not None:
            return _with_hidden(args, kwargs, self._rows.middle(layer, hidden))
        return _with_hidden(args, kwargs, layer(hidden))

    def _output_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:  # noqa: ARG002
        if self.disabled("output"):
            return None
        hidden = _hidden(args, kwargs)
        layer = cast(OutputMemoryLayer, self.output_layer)  # __init__ hooks this for an OutputMemoryLayer only
        if self._pass is not None:
            self._pass.output_rows = next_token_pairs(hidden, self._pass.pair_mask, self._pass.next_embeddings)
            return None
        if self._rows is not None:
            return _with_hidden(args, kwargs, self._rows.embedding_output(layer, hidden))
        return _with_hidden(args, kwargs, layer(hidden))

    def _key_hook(self, slot: int, module: nn.Module, args: tuple, kwargs: dict) -> None:  # noqa: ARG002
        if self.disabled("output"):
            return
        self._key_states[slot] = key_state(_hidden(args, kwargs))

    def _residual_hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:  # noqa: ARG002
        if self.disabled("output"):
            return None
        layer = cast(ResidualOutputLayer, self.output_layer)  # __init__ hooks this for a ResidualOutputLayer only
        if self._pass is not None:
            self._pass.output_rows = (output, None)  # the final norm's output h̃; targets come after the pass
            return None
        if layer.space == "probability":
            self._final_states = output if self.key_blocks else None  # _head_hook checks the rows it reads
            return None  # read at the head (_head_hook)
        if self._rows is not None:
            return self._rows.logit_output(layer, output, self.extra_keys(output))
        return layer(output, self.extra_keys(output))

    def _head_hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:  # noqa: ARG002
        if self.disabled("output") or self._pass is not None or not args:
            return None
        # __init__ hooks the head for a ResidualOutputLayer only.
        layer, hidden = cast(ResidualOutputLayer, self.output_layer), args[0]
        if layer.space != "probability":  # the correction was read after the final norm (_residual_hook)
            if self._rows is not None:
                return self._rows.logit_bias(layer, output)
            return layer.logit_bias(output)  # the token bias, or None: the logits stand
        final, self._final_states = self._final_states, None
        if self._rows is not None:
            wide = self._rows.needs_extra_keys(hidden.device, hidden.dtype)
        else:
            m, _ = layer.solution(hidden.device, hidden.dtype)
            wide = m is not None and m.shape[0] > layer.hidden_size
        extra = self.extra_keys(hidden, final) if wide else None
        self._key_states = [None] * len(self.key_blocks)  # used by this pass or not at all
        # The head's output is this pass's own: the read may write the mixture into it.
        if self._rows is not None:
            return self._rows.read_logits(layer, hidden, output, extra, overwrite=True)
        return layer.read_logits(hidden, output, extra, overwrite=True)
