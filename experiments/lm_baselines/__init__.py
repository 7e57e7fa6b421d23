"""The methods the LM experiments compare FAAST against; experiment code, not part of the faast package.

- `backprop`: a linear projection h + h·A at FAAST's layers and peft's LoRA, trained by `fit_causal_lm`, and
  `kv_cache_bytes` (the memory in-context learning adds);
- `knnlm`: the kNN-LM datastore (Khandelwal et al., 2020).

The experiment scripts run as `python experiments/<name>.py`, which puts experiments/ on sys.path, so they import
this package as `lm_baselines`; the tests put experiments/ on sys.path themselves. It uses only faast's public names.
"""

from .backprop import (
    LORA_MODULES,
    FitStats,
    LinearProjection,
    apply_lora,
    fit_causal_lm,
    kv_cache_bytes,
    lora_rank_for,
)
from .knnlm import KNNLM, KNNConfig

__all__ = [
    "KNNLM",
    "LORA_MODULES",
    "FitStats",
    "KNNConfig",
    "LinearProjection",
    "apply_lora",
    "fit_causal_lm",
    "kv_cache_bytes",
    "lora_rank_for",
]
