"""The methods the LM experiments compare FAAST against; experiment code, not part of the faast package.

- `backprop`: a linear projection h + h·A at FAAST's layers and peft's LoRA, trained by `fit_causal_lm`, and
  `kv_cache_bytes` (the memory in-context learning adds);
- `knnlm`: the kNN-LM datastore (Khandelwal et al., 2020);
- `stream`: the methods a stream is read with, chunk by chunk (lab/experiments/lm_stream.py): zero-shot, dynamic
  evaluation on LoRA or the last blocks, the neural cache and the kNN-LM over the stream, and FAAST's `read_stream`;
- `tuning`: the held-out tail FAAST tunes its step on (`tuning_split`, `held_out_nll`) and the baselines tuned on it
  the same way (`tune_lora`, `tune_knn`).

The experiment scripts (`python -m faast_lab.experiments.<name>`) and the lab's tests import it as
faast_lab.experiments.lm_baselines. It uses only faast's public names.
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
from .tuning import (
    KnnChoice,
    LoraChoice,
    TuningSplit,
    faast_min_fit,
    held_out_neighbours,
    held_out_nll,
    tune_knn,
    tune_lora,
    tuning_split,
)

__all__ = [
    "KNNLM",
    "LORA_MODULES",
    "FitStats",
    "KNNConfig",
    "KnnChoice",
    "LinearProjection",
    "LoraChoice",
    "TuningSplit",
    "apply_lora",
    "faast_min_fit",
    "fit_causal_lm",
    "held_out_neighbours",
    "held_out_nll",
    "kv_cache_bytes",
    "lora_rank_for",
    "tune_knn",
    "tune_lora",
    "tuning_split",
]
