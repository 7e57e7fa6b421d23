"""faast.classify: classifiers over frozen embeddings with the scikit-learn estimator API.

FAASTClassifier learns closed-form fast weights from (embedding, label) pairs in one streaming pass; the baselines
share its API and features so that comparisons are like for like; `episodes` implements the few-shot protocol.
"""

from .baselines import (
    KNNMemoryClassifier,
    LinearAttentionClassifier,
    LinearProbeClassifier,
    SoftmaxAttentionClassifier,
    ZeroShotClassifier,
    validation_split,
)
from .episodes import EvalResult, evaluate_episodes, evaluate_full, mean_ci, sample_episode, wilson_ci
from .faast_classifier import FAASTClassifier

__all__ = [
    "EvalResult",
    "FAASTClassifier",
    "KNNMemoryClassifier",
    "LinearAttentionClassifier",
    "LinearProbeClassifier",
    "SoftmaxAttentionClassifier",
    "ZeroShotClassifier",
    "evaluate_episodes",
    "evaluate_full",
    "mean_ci",
    "sample_episode",
    "validation_split",
    "wilson_ci",
]
