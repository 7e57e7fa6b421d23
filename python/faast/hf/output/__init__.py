"""faast.hf.output: the residual output memory (docs/design.md §6.3), its policy in one place.

    layer.py      ResidualOutputLayer: the statistics, the Newton step W, the solution η·W and how the model reads it
    step.py       StepChoice: the step η, weight λ and key width chosen on the held-out tail, built per solve
    tuning.py     the held-out NLL's 1-D searches (step, mixture weight, golden section)
    diagnosis.py  why a tuned step is what it is (MemoryOffWarning) and the long texts' step shrink
    bias.py       the mean-gradient and token biases
    head.py       the LM head's products: logits, gradients, the Fisher's sums, their dtype and pooling
    read.py       the keys' extra states and the probability-space mixture read at the head
    state.py      OutputState: what one named memory holds for the layer
    policy.py     OutputPolicy: every tuned constant of the above (ResidualOutput.policy)

Every rule above reads its numbers from the OutputPolicy it is given (the layer passes its own); an experiment varies
them by passing one, never by rebinding a module's names.

ResidualOutputLayer (layer.py) is imported on first use: layer.py reads faast.hf.config, whose ResidualOutput holds an
OutputPolicy from this package, so importing it here eagerly would close an import circle at run time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .diagnosis import MemoryOffWarning
from .head import READ_CHUNK, HeadBuffers
from .policy import DEFAULT_POLICY, REMOVED_FIELDS, OutputPolicy
from .read import MIX_ROWS, key_state
from .state import OutputState, checked_restored
from .step import StepChoice, StepSettings

if TYPE_CHECKING:
    from .layer import ResidualOutputLayer


def __getattr__(name: str) -> object:
    if name == "ResidualOutputLayer":
        from .layer import ResidualOutputLayer

        return ResidualOutputLayer
    raise AttributeError(f"module 'faast.hf.output' has no attribute {name!r}")


__all__ = [
    "DEFAULT_POLICY",
    "MIX_ROWS",
    "READ_CHUNK",
    "REMOVED_FIELDS",
    "HeadBuffers",
    "MemoryOffWarning",
    "OutputPolicy",
    "OutputState",
    "ResidualOutputLayer",
    "StepChoice",
    "StepSettings",
    "checked_restored",
    "key_state",
]
