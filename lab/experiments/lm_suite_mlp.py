"""Memories on the upper blocks' MLPs as a domain-suite setting (issue 74, item 4): a setting's field
"mlp": {"blocks": [ℓ, ...], "step": η[, "ridge": μ]} puts a faast module memory (FaastConfig.target_modules) on the
down projection of each block ℓ's MLP, read beside the output layer the rest of the setting describes.

Keys: the down projection's input a [d_ff] (the MLP's gated activation). Values: η times the gradient of the next
token's log-likelihood with respect to the last block's output r (the final norm's input), in closed form through
the final RMSNorm and the head, so learning needs no backward pass. With h̃ = g ⊙ r / ρ, ρ = sqrt(mean(r²) + ε),
p = softmax(H h̃) and y the next token:

    u = g ⊙ (H[y] − pᵀH),    ∂ log p_y / ∂r = u / ρ − r (r·u) / (d ρ³)

A block below the last takes the same value: its output reaches r through the residual stream, and the blocks above
it are passed over (no backward pass through them). Each memory is W = pinv_ε(A)·V over the learned rows, or
(AᵀA + μI)⁻¹AᵀV with "ridge" μ: a number, or "auto" for the one generalised cross-validation chooses at each solve
(FaastConfig.regulariser), read as f(a) + a·W. The keys and values come from a capture pass of their own over each
learned part, with every memory off (the base model's activations, as faast's memories learn); its time and each
setting's module learning count in that setting's learn time. The module memories are the public target_modules API:
`learn_module` adds the rows, `module_memories` holds them.

"step": [η₁, η₂, ...] (a list) tunes the step at each solve on documents the fit did not see: the learned documents
are dealt into two folds in turn, each block's memory is fitted on each fold alone, and the held-out positions (per
document its end, the share FAAST's step tuning holds out: lm_baselines.tuning.tuning_split) of each fold's documents
are scored by the whole model as it reads (output layer included) with the memories fitted on the other fold, at step
0 (no MLP memories) and at each ηᵢ. Only T scales with the step (FastWeights.scale_values), so one eigendecomposition
per fold and block serves every candidate. The two folds' statistics then add, at the step of the lowest held-out NLL;
0 leaves the memories empty. So a memory that only recalls its own documents, and would not help on new ones, is
turned off. A document cut between curve points stays one (`add`'s continues), so that its pieces never fall in both
folds. The memories stay empty with fewer than two documents, too little text to hold any out, or a fold of fewer
rows than `faast_min_fit` asks for keys this wide (the output layer's own rule, 4 rows per key dimension: 6,144 for
SmolLM2's MLPs).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence

MLP = "mlp"  # a setting's field: {"blocks": [...], "step": η, "ridge": μ (optional)}


@dataclasses.dataclass(frozen=True)
class MlpSpec:
    """The MLP memories of a setting: the blocks whose down projections get one, the values' step η (> 0) and the
    solve's ridge (None: the truncated pseudo-inverse; a number >= 0 or "auto": Regulariser(ridge=))."""

    blocks: tuple[int, ...]
    step: float | tuple[float, ...]
    ridge: float | str | None = None

    @property
    def tuned(self) -> bool:
        """Whether the step is chosen at each solve among 0 and the listed steps (the module docstring)."""
        return isinstance(self.step, tuple)

    def to_dict(self) -> dict:
        step = list(self.step) if isinstance(self.step, tuple) else self.step
        return {"blocks": list(self.blocks), "step": step, **({"ridge": self.ridge} if self.ridge is not None
                                                              else {})}  # fmt: skip

    def learn_key(self) -> str:
        """What a shared pass and capture depend on: the blocks and the ridge (the memories' configuration)."""
        return f"{list(self.blocks)}|{self.ridge}"


def split_mlp(name: str, fields: Mapping) -> tuple[dict, MlpSpec | None]:
    """A setting's fields as (the others, its MlpSpec or None). A ValueError names the setting."""
    fields = dict(fields)
    spec = fields.pop(MLP, None)
    if spec is None:
        return fields, None
    if not isinstance(spec, Mapping) or not {"blocks", "step"} <= set(spec) <= {"blocks", "step", "ridge"}:
        raise ValueError(f"--settings: setting {name!r}: 'mlp' expects {{\"blocks\": [block, ...], \"step\": η}} and "
                         f"optionally \"ridge\", got {spec!r}")  # fmt: skip
    blocks, step = spec["blocks"], spec["step"]
    if (not isinstance(blocks, list) or not blocks or len(set(blocks)) != len(blocks)
            or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in blocks)):  # fmt: skip
        raise ValueError(f"--settings: setting {name!r}: 'mlp' blocks: expected a non-empty list of distinct block "
                         f"indices >= 0, got {blocks!r}")  # fmt: skip

    def positive(x: object) -> bool:
        return not isinstance(x, bool) and isinstance(x, int | float) and x > 0 and math.isfinite(x)

    if isinstance(step, list):
        if not step or not all(positive(x) for x in step) or len(set(step)) != len(step):
            raise ValueError(f"--settings: setting {name!r}: 'mlp' step: expected a number > 0 or a non-empty list of "
                             f"distinct numbers > 0 (tuned), got {step!r}")  # fmt: skip
        step = tuple(sorted(float(x) for x in step))
    elif not positive(step):
        raise ValueError(f"--settings: setting {name!r}: 'mlp' step: expected a number > 0 or a list of them (tuned), "
                         f"got {step!r}")  # fmt: skip
    else:
        step = float(step)
    ridge = spec.get("ridge")
    if ridge is not None and ridge != "auto" and (isinstance(ridge, bool) or not isinstance(ridge, int | float)
                                                  or not (ridge >= 0 and math.isfinite(ridge))):  # fmt: skip
        raise ValueError(f"--settings: setting {name!r}: 'mlp' ridge: expected a number >= 0 or \"auto\", got "
                         f"{ridge!r}")  # fmt: skip
    return fields, MlpSpec(tuple(sorted(blocks)), step, ridge if ridge in (None, "auto") else float(ridge))


def module_name(block: int) -> str:
    """The qualified name of block `block`'s MLP down projection in a Llama-type causal LM (SmolLM2)."""
    return f"model.layers.{block}.mlp.down_proj"


def check_blocks(base: object, specs: Mapping[str, MlpSpec]) -> list[int]:
    """Every block the settings name, sorted; a ValueError names a setting whose block the model lacks."""
    blocks = int(base.config.num_hidden_layers)
    for name, spec in specs.items():
        missing = [b for b in spec.blocks if b >= blocks]
        if missing:
            raise ValueError(f"--settings: setting {name!r}: 'mlp' blocks {missing} are not in the model's "
                             f"{blocks} blocks")  # fmt: skip
    return sorted({b for s in specs.values() for b in s.blocks})


class MlpCapture:
    """The learned text's keys (per block) and values (η = 1), float32 rows in learning order, and the seconds their
    capture passes took."""

    def __init__(self, base: object, blocks: Sequence[int], window: int, batch_size: int) -> None:
        self.base, self.blocks, self.window, self.batch_size = base, list(blocks), window, batch_size
        self.keys: dict[int, list] = {b: [] for b in self.blocks}
        self.values: list = []
        self.documents: list[list[int]] = []  # the captured token lists, in order: len − 1 rows each
        self.seconds = 0.0
        self.choice: dict | None = None  # the last tuned learn's choice (`learn`)

    def add(self, model: object, part: Sequence[Sequence[int]], continues: bool = False) -> None:
        """Capture `part` (token lists) in windows of `window` tokens overlapping by one, every memory of `model`
        (the FaastModel over this base) off. continues: the part's first list is the rest of the last one captured,
        repeating its last token (faast.hf.tokens.split_continuing), and stays one document with it."""
        import torch

        from faast.hf.tokens import overlapping_windows, pad_rows

        started = time.perf_counter()
        base = self.base
        decoder, norm = base.get_decoder(), base.get_decoder().norm
        head = base.get_output_embeddings().weight.detach()
        scale, eps = norm.weight.detach(), float(norm.variance_epsilon)
        seen: dict[object, torch.Tensor] = {}
        handles = [base.get_submodule(module_name(b)).register_forward_pre_hook(
            lambda _m, args, b=b: seen.__setitem__(b, args[0].detach())) for b in self.blocks]  # fmt: skip
        handles.append(norm.register_forward_pre_hook(lambda _m, args: seen.__setitem__("r", args[0].detach())))
        rows = [w for ids in part for w in overlapping_windows(ids, self.window)]
        for i, ids in enumerate(part):
            if i == 0 and continues and self.documents:  # its rows follow the document's: one document
                self.documents[-1].extend(ids[1:])
            else:
                self.documents.append(list(ids))
        try:
            with torch.no_grad(), model.disable_faast():
                for i in range(0, len(rows), self.batch_size):
                    ids, mask = pad_rows(rows[i : i + self.batch_size])
                    decoder(input_ids=ids, attention_mask=mask.long(), use_cache=False)
                    pair = mask[:, :-1] & mask[:, 1:]
                    r = seen["r"][:, :-1][pair].float()
                    self.values.append(log_likelihood_gradient(r, ids[:, 1:][pair], head, scale, eps))
                    for b in self.blocks:
                        self.keys[b].append(seen[b][:, :-1][pair].float())
        finally:
            for handle in handles:
                handle.remove()
        self.seconds += time.perf_counter() - started

    def learn(self, model: object, spec: MlpSpec | None) -> float:
        """Empty every module memory of `model`, then learn `spec`'s blocks from the rows captured so far with
        values η·∂ log p_y/∂r (None: every module memory stays empty); a tuned step is chosen first (the module
        docstring) and `choice` says how. Returns the seconds it took, the tuning's included."""
        import torch

        started = time.perf_counter()
        self.choice = None
        for b in self.blocks:
            model.module_memories.entry(module_name(b)).memory.reset()
        if spec is not None and self.values:
            if spec.tuned:
                self._learn_tuned(model, spec)
            else:
                values = torch.cat(self.values) * spec.step
                for b in spec.blocks:
                    keys = torch.cat(self.keys[b])
                    with torch.no_grad():
                        own = self.base.get_submodule(module_name(b))(keys)
                    model.learn_module(keys, targets=own + values, name=module_name(b))
        return time.perf_counter() - started

    def _learn_tuned(self, model: object, spec: MlpSpec) -> None:
        """Choose spec's step among 0 and spec.step by the held-out NLL of documents the fit did not see (the
        module docstring), then learn every row with it."""
        import torch

        from faast.hf import ResidualOutput
        from faast_lab.experiments.lm_baselines.tuning import TuningSplit, faast_min_fit, held_out_nll, tuning_split

        docs = self.documents
        counts = [max(0, len(ids) - 1) for ids in docs]
        rows = sum(int(v.shape[0]) for v in self.values)
        if sum(counts) != rows:  # the rows are each document's len − 1 pairs, in order (overlapping_windows)
            raise RuntimeError(f"the capture holds {rows} rows, its documents {sum(counts)} positions")
        folds = [[i for i, n in enumerate(counts) if n > 0][f::2] for f in (0, 1)]
        try:  # the held-out positions: tail_plan's share of each document's end (no gaps: the fit skips the document)
            plan = tuning_split(docs, ResidualOutput().tune_tokens, 0).plan
        except ValueError:
            plan = [(0, 0)] * len(docs)
        held = [sum(plan[i][0] for i in fold) for fold in folds]
        width = int(self.keys[spec.blocks[0]][0].shape[-1])
        fits = [sum(counts[i] for i in fold) for fold in folds]
        if min(held) == 0 or min(fits) < faast_min_fit(width):  # the memories stay empty (the module docstring)
            self.choice = {"step": 0.0, "tuned": False, "held_tokens": 0, "documents": len(folds[0] + folds[1]),
                           "grid": []}  # fmt: skip
            return
        document = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(counts))
        values = torch.cat(self.values)
        entries = [model.module_memories.entry(module_name(b)) for b in spec.blocks]
        # fitted[f]: each block's memory learned on fold f's rows alone, at step 1. FastWeights.update takes the
        # residual values η·g as they are; learn_module would form (f(a) + η·g) − f(a) and round it in float32.
        mine = [torch.isin(document, torch.tensor(fold)) for fold in folds]
        fitted: list[list] = [[], []]
        for e, b in zip(entries, spec.blocks, strict=True):
            keys = torch.cat(self.keys[b])  # once per block: 32K rows of 1,536 floats
            for f in (0, 1):
                fitted[f].append(e.memory.empty_like().update(keys[mine[f]], values[mine[f]]))
        scored = [TuningSplit([docs[i] for i in fold], [(plan[i][0], 0) for i in fold]) for fold in folds]
        own = [e.swap_memory(None) for e in entries]

        def score(off: bool = False) -> float:
            """Mean held-out NLL: each fold's documents read with the memories fitted on the other fold (off: with
            no MLP memories)."""
            nll, count = 0.0, 0
            for f in (0, 1):
                for e, memory in zip(entries, fitted[1 - f], strict=True):
                    e.swap_memory(None if off else memory)
                part = held_out_nll(model, scored[f], self.window, self.batch_size)
                nll, count = nll + part[0], count + part[1]
            return nll / count

        try:
            grid = [{"step": 0.0, "nll": score(off=True)}]
            current = 1.0
            for step in spec.step:
                for memory in fitted[0] + fitted[1]:
                    memory.scale_values(step / current)
                current = step
                grid.append({"step": step, "nll": score()})
        finally:
            for e, memory in zip(entries, own, strict=True):
                e.swap_memory(memory)
        best = min(grid, key=lambda g: g["nll"])["step"]  # the first (smallest step) of equal NLLs
        if best > 0:  # every row at the best step: the two folds' statistics add
            for e, first, second in zip(entries, *fitted, strict=True):
                e.memory.merge(first.scale_values(best / current)).merge(second.scale_values(best / current))
        self.choice = {"step": best, "tuned": True, "held_tokens": sum(held), "documents": len(folds[0] + folds[1]),
                       "grid": grid}  # fmt: skip


def log_likelihood_gradient(r: object, targets: object, head: object, scale: object, eps: float) -> object:
    """∂ log p_y / ∂r [n, d] float32 for the final norm's inputs r [n, d] and the next tokens `targets` [n]: through
    RMSNorm(scale, eps) and the head [V, d], in closed form (the module docstring)."""
    import torch

    rho = (r.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    hidden = scale * r / rho
    p = torch.softmax(hidden @ head.T, -1)
    u = scale * (head[targets] - p @ head)
    return u / rho - r * (r * u).sum(-1, keepdim=True) / (r.shape[-1] * rho**3)
