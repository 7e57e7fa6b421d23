"""faast.classify: classifiers over frozen embeddings with the scikit-learn estimator API, and what feeds them.

FAASTClassifier learns closed-form fast weights from (embedding, label) pairs in one streaming pass; the baselines
share its API and features so that comparisons are like for like; `episodes` implements the few-shot protocol (its
`sample_episode` is the one few-shot sampler). The rest feeds them: `data` (the shipped Debian-sections text task),
`sentence_encoder` and `clip_encoder` (frozen encoders, cached), `debian_task` (the Debian task embedded once) and
`readout` (one-hot values and accuracy for hand-driven FastWeights). The CIFAR-10 and mini-ImageNet readers belong to
the vision benchmark (lab/benchmarks/vision_data.py), not to the package.
transformers is imported only when an encoder is built.
"""

from .baselines import (
    KNNMemoryClassifier,
    LinearAttentionClassifier,
    LinearProbeClassifier,
    SoftmaxAttentionClassifier,
    ZeroShotClassifier,
    validation_split,
)
from .clip_encoder import ClipEncoder
from .data import DEBIAN_SECTIONS, TextClassificationData, load_debian_sections
from .debian_task import ZERO_SHOT_TEMPLATE, EmbeddedTask, cache_dir, embed_debian_sections
from .episodes import Episode, EvalResult, evaluate_episodes, evaluate_full, mean_ci, sample_episode, wilson_ci
from .faast_classifier import FAASTClassifier
from .readout import accuracy, one_hot
from .sentence_encoder import SentenceEncoder

__all__ = [
    "DEBIAN_SECTIONS",
    "ZERO_SHOT_TEMPLATE",
    "ClipEncoder",
    "EmbeddedTask",
    "Episode",
    "EvalResult",
    "FAASTClassifier",
    "KNNMemoryClassifier",
    "LinearAttentionClassifier",
    "LinearProbeClassifier",
    "SentenceEncoder",
    "SoftmaxAttentionClassifier",
    "TextClassificationData",
    "ZeroShotClassifier",
    "accuracy",
    "cache_dir",
    "embed_debian_sections",
    "evaluate_episodes",
    "evaluate_full",
    "load_debian_sections",
    "mean_ci",
    "one_hot",
    "sample_episode",
    "validation_split",
    "wilson_ci",
]
