"""faast.classify: the estimator protocol, FAASTClassifier against float64 hand computations, every baseline against
a hand computation, the episode sampler, the interval formulas and bad inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from faast.classify import (
    FAASTClassifier,
    KNNMemoryClassifier,
    LinearAttentionClassifier,
    LinearProbeClassifier,
    SoftmaxAttentionClassifier,
    ZeroShotClassifier,
    accuracy,
    evaluate_episodes,
    evaluate_full,
    mean_ci,
    one_hot,
    sample_episode,
    validation_split,
    wilson_ci,
)
from tolerances import REORDER_REL, rel

C, D = 4, 10


def unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


@pytest.fixture
def task():
    g = torch.Generator().manual_seed(3)
    E = torch.randn(C, D, generator=g, dtype=torch.float64)
    y = torch.arange(37) % C
    X = E[y] + 0.8 * torch.randn(37, D, generator=g, dtype=torch.float64)
    return X, y, E


def ridge_truth(K, Y, mu, prior=None):
    """float64 ridge towards `prior`: W = W0 + (KᵀK + μI)⁻¹ Kᵀ (Y − K W0), by a direct solve."""
    W0 = torch.zeros(K.shape[1], Y.shape[1], dtype=torch.float64) if prior is None else prior
    A = K.T @ K + mu * torch.eye(K.shape[1], dtype=torch.float64)
    return W0 + torch.linalg.solve(A, K.T @ (Y - K @ W0))


# ---------------------------------------------------------------------------------------------------- FAASTClassifier


def test_one_hot_ridge_matches_a_direct_solve(task):
    X, y, _ = task
    clf = FAASTClassifier(ridge=0.3).fit(X, y)
    truth = ridge_truth(unit(X), torch.nn.functional.one_hot(y, C).double(), 0.3)
    assert rel(clf.weights_, truth) <= 1e-10
    assert torch.allclose(clf.decision_function(X).double(), unit(X) @ truth, atol=1e-5)


def test_auto_prior_is_ridge_towards_scaled_zero_shot(task):
    X, y, E = task
    clf = FAASTClassifier(label_embeddings=E, ridge=0.7).fit(X, y)
    K, Y, En = unit(X), torch.nn.functional.one_hot(y, C).double(), unit(E)
    scale = torch.trace(Y.T @ K @ En.T) / torch.trace(En @ K.T @ K @ En.T)  # argmin_s ||Y - s K Eᵀ||²
    assert clf.prior_scale_ == pytest.approx(float(scale), rel=1e-12)
    assert rel(clf.weights_, ridge_truth(K, Y, 0.7, prior=scale * En.T)) <= 1e-10


def test_auto_prior_gcv_tends_to_zero_shot_with_little_data_and_to_the_data_with_plenty(task):
    _, _, E = task
    g = torch.Generator().manual_seed(9)
    few_y = torch.arange(C)
    few = unit(E) + 0.9 * torch.randn(C, D, generator=g, dtype=torch.float64)  # one noisy example per class
    one_shot = FAASTClassifier(label_embeddings=E).fit(few, few_y)
    zero_shot = ZeroShotClassifier(label_embeddings=E).fit(few, few_y)
    queries = torch.randn(50, D, generator=g, dtype=torch.float64)
    assert (one_shot.predict(queries) == zero_shot.predict(queries)).mean() >= 0.9
    many_y = torch.arange(4000) % C
    many = unit(E)[many_y] @ torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))[0]  # rotated
    many = many + 0.05 * torch.randn(4000, D, generator=g, dtype=torch.float64)
    full = FAASTClassifier(label_embeddings=E).fit(many, many_y)
    assert (
        full.score(many, many_y) > 0.95 > ZeroShotClassifier(label_embeddings=E).fit(many, many_y).score(many, many_y)
    )


def test_paper_prior_interpolates_with_identity(task):
    X, y, E = task
    n0 = 25.0
    clf = FAASTClassifier(label_embeddings=E, prior_count=n0, ridge=None, alpha=1.0).fit(X, y)
    K, V = unit(X), unit(E)[y]
    W_star = torch.linalg.pinv(K, rtol=1.0 / K.shape[0]) @ V
    n = K.shape[0]
    W = (n0 * torch.eye(D, dtype=torch.float64) + n * W_star) / (n0 + n)
    assert rel(clf.weights_, W) <= 1e-9
    expected = unit(K @ W) @ unit(E).T  # cosine of the output with every label embedding
    assert torch.allclose(clf.decision_function(X).double(), expected, atol=1e-5)


@pytest.mark.parametrize("prior_count", ["auto", 10.0])
def test_no_rows_with_a_prior_is_zero_shot(task, prior_count):
    X, y, E = task
    clf = FAASTClassifier(label_embeddings=E, prior_count=prior_count).partial_fit(X[:1], y[:1])
    clf.memory_.reset()
    np.testing.assert_array_equal(clf.predict(X), ZeroShotClassifier(label_embeddings=E).fit(X, y).predict(X))


@pytest.mark.parametrize("kwargs", [{}, {"label_embeddings": "E"}, {"label_embeddings": "E", "prior_count": 5.0}])
def test_partial_fit_equals_fit(task, kwargs):
    X, y, E = task
    kwargs = {k: (E if v == "E" else v) for k, v in kwargs.items()}
    whole = FAASTClassifier(**kwargs, classes=list(range(C))).fit(X, y)
    parts = FAASTClassifier(**kwargs, classes=list(range(C)))
    for rows in (slice(0, 5), slice(5, 6), slice(6, 37)):
        parts.partial_fit(X[rows], y[rows])
    assert rel(parts.weights_, whole.weights_) <= REORDER_REL * 1e3  # solved from reordered sums
    np.testing.assert_array_equal(parts.predict(X), whole.predict(X))


def test_string_labels_and_shapes(task):
    X, y, _ = task
    names = np.array(["admin", "games", "net", "web"])[y.numpy()]
    clf = FAASTClassifier().fit(X, names)
    assert clf.classes_.tolist() == ["admin", "games", "net", "web"]
    assert clf.predict(X).shape == (37,) and clf.predict(X).dtype.kind == "U"
    proba = clf.predict_proba(X)
    assert proba.shape == (37, C) and torch.allclose(proba.sum(-1), torch.ones(37))
    assert clf.decision_function(X).shape == (37, C)
    assert 0.0 <= clf.score(X, names) <= 1.0 and clf.n_features_in_ == D


def test_get_set_params_and_sklearn_clone(task):
    sklearn_base = pytest.importorskip("sklearn.base")
    X, y, E = task
    clf = FAASTClassifier(label_embeddings=E, alpha=0.5, logit_scale=3.0)
    params = clf.get_params()
    assert params["alpha"] == 0.5 and params["logit_scale"] == 3.0 and params["label_embeddings"] is E
    clone = sklearn_base.clone(clf)
    assert clone is not clf and clone.get_params()["alpha"] == 0.5 and not hasattr(clone, "classes_")
    clf.set_params(ridge=0.1)
    assert clf.ridge == 0.1
    with pytest.raises(ValueError, match="ridg: not a parameter of FAASTClassifier"):
        clf.set_params(ridg=0.1)


def test_save_load_is_exact_and_pickle_free(task, tmp_path):
    X, y, E = task
    for kwargs in ({"label_embeddings": E}, {"classes": [0, 1, 2, 3]}, {"label_embeddings": E, "prior_count": 7.0}):
        clf = FAASTClassifier(**kwargs).fit(X, y)
        path = clf.save(tmp_path / "clf.safetensors")
        assert path.read_bytes()[:1] != b"\x80"  # not a pickle
        loaded = FAASTClassifier.load(path)
        assert torch.equal(loaded.decision_function(X), clf.decision_function(X))
        assert loaded.classes_.tolist() == clf.classes_.tolist()


def test_bad_inputs(task):
    X, y, E = task
    with pytest.raises(ValueError, match=r"y: unknown label 7; the classes are \[0, 1, 2, 3\]"):
        FAASTClassifier().fit(X, y).partial_fit(X[:1], [7])
    with pytest.raises(ValueError, match="X: expected 10 features per sample"):
        FAASTClassifier().fit(X, y).predict(X[:, :9])
    with pytest.raises(ValueError, match=r"y: classes \[3\] have no examples"):
        FAASTClassifier(classes=[0, 1, 2, 3]).fit(X[y < 3], y[y < 3])
    with pytest.raises(ValueError, match="y: expected 37 labels"):
        FAASTClassifier().fit(X, y[:5])
    with pytest.raises(ValueError, match="X: expected at least one sample"):
        FAASTClassifier().fit(X[:0], y[:0])
    with pytest.raises(ValueError, match="X: expected finite values"):
        FAASTClassifier().fit(torch.where(torch.arange(D) == 2, float("nan"), X), y)
    with pytest.raises(ValueError, match="label_embeddings: expected one row per class"):
        FAASTClassifier(label_embeddings=E[:3], classes=[0, 1, 2, 3]).fit(X, y)
    with pytest.raises(ValueError, match="label_embeddings: expected width 10"):
        FAASTClassifier(label_embeddings=E[:, :8]).fit(X, y)
    with pytest.raises(ValueError, match="classes: required on the first partial_fit"):
        FAASTClassifier().partial_fit(X, y)
    with pytest.raises(RuntimeError, match="not fitted"):
        FAASTClassifier().predict(X)
    with pytest.raises(ValueError, match="prior_count: expected 'auto' or a finite number"):
        FAASTClassifier(prior_count=-1.0).fit(X, y)
    with pytest.raises(ValueError, match="logit_scale: expected a positive number"):
        FAASTClassifier(logit_scale=0).fit(X, y)


# ---------------------------------------------------------------------------------------------------- baselines


def test_zero_shot_is_cosine(task):
    X, y, E = task
    clf = ZeroShotClassifier(label_embeddings=E).fit(X, y)
    assert torch.allclose(clf.decision_function(X).double(), unit(X) @ unit(E).T, atol=1e-6)


def test_knn_votes_by_hand():
    keys = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.8, 0.2], [0.0, 1.0], [0.1, 0.9]])
    labels = ["a", "b", "b", "c", "c"]
    clf = KNNMemoryClassifier(k=3).fit(keys, labels)
    # Nearest 3 of (1, 0.05): rows 0, 1, 2 -> votes a:1, b:2.
    assert clf.predict(torch.tensor([[1.0, 0.05]])).tolist() == ["b"]
    # k = min(n, k): with k=10 all 5 vote: b 2, c 2, a 1; the tie goes to the class with more summed similarity.
    wide = KNNMemoryClassifier(k=10).fit(keys, labels)
    scores = wide.decision_function(torch.tensor([[0.0, 1.0]])).double()[0]
    sims = unit(keys) @ torch.tensor([0.0, 1.0])
    expected = torch.tensor([1 + sims[0] / 11, 2 + (sims[1] + sims[2]) / 11, 2 + (sims[3] + sims[4]) / 11])
    assert torch.allclose(scores, expected.double(), atol=1e-6)
    assert wide.predict(torch.tensor([[0.0, 1.0]])).tolist() == ["c"]


def test_softmax_attention_by_hand(task):
    X, y, E = task
    clf = SoftmaxAttentionClassifier(label_embeddings=E, temperature=0.2).fit(X, y)
    K = unit(X)
    out = torch.softmax(K @ K.T / 0.2, dim=-1) @ unit(E)[y]
    assert torch.allclose(clf.decision_function(X).double(), unit(out) @ unit(E).T, atol=1e-5)
    onehot = SoftmaxAttentionClassifier(temperature=0.2).fit(X, y)
    expected = torch.softmax(K @ K.T / 0.2, dim=-1) @ torch.nn.functional.one_hot(y, C).double()
    assert torch.allclose(onehot.decision_function(X).double(), expected, atol=1e-5)


def test_linear_attention_by_hand(task):
    X, y, _ = task
    K, V = unit(X), torch.nn.functional.one_hot(y, C).double()
    km, vm = K.mean(0), V.mean(0)
    phi = torch.nn.functional.elu(K - km) + 1
    positive = (phi @ phi.T) @ V / (phi @ phi.T).sum(-1, keepdim=True) - vm
    clf = LinearAttentionClassifier().fit(X, y)
    assert torch.allclose(clf.decision_function(X).double(), positive, atol=1e-5)
    centred = ((K - km) @ (K - km).T / K.shape[0]) @ (V - vm)
    clf = LinearAttentionClassifier(centered=True).fit(X, y)
    assert torch.allclose(clf.decision_function(X).double(), centred, atol=1e-5)
    assert bool((((K - km) @ (K - km).T) < 0).any())  # centring does give negative weights


def test_validation_split_never_empties_a_class():
    codes = torch.tensor([0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 2])
    train, val = validation_split(codes, 0.125, torch.Generator().manual_seed(0))
    assert sorted(torch.cat([train, val]).tolist()) == list(range(11))
    assert set(codes[train].tolist()) == {0, 1, 2}  # every class keeps a training example
    assert codes[val].tolist().count(0) == 1 and 1 not in codes[val].tolist()


def test_linear_probe_learns_and_starts_from_zero_shot(task):
    X, y, E = task
    probe = LinearProbeClassifier(label_embeddings=E, epochs=0).fit(X, y)
    np.testing.assert_array_equal(probe.predict(X), ZeroShotClassifier(label_embeddings=E).fit(X, y).predict(X))
    trained = LinearProbeClassifier(epochs=200, lr=0.05, logit_scale=10.0, validation_fraction=0).fit(X, y)
    assert trained.score(X, y) >= 0.9  # the data are linearly separable (the ridge fit scores 1.0)


# ---------------------------------------------------------------------------------------------------- protocol


def test_episode_sampler_is_disjoint_balanced_and_seeded():
    labels = torch.arange(200) % 5
    g = torch.Generator().manual_seed(1)
    ep = sample_episode(labels, ways=3, shots=4, queries=6, generator=g)
    assert ep.classes.numel() == 3
    assert not set(ep.support.tolist()) & set(ep.query.tolist())
    for c in ep.classes.tolist():
        assert (labels[ep.support] == c).sum() == 4 and (labels[ep.query] == c).sum() == 6
    again = sample_episode(labels, ways=3, shots=4, queries=6, generator=torch.Generator().manual_seed(1))
    assert torch.equal(ep.support, again.support) and torch.equal(ep.query, again.query)
    with pytest.raises(ValueError, match="class 0 has 40 examples, an episode needs 41"):
        sample_episode(labels, ways=None, shots=1, queries=40, generator=g)


def test_separate_query_pool():
    ep = sample_episode(torch.arange(20) % 2, ways=None, shots=3, queries=5, generator=torch.Generator(),
                        query_labels=torch.arange(10) % 2)  # fmt: skip
    assert ep.support.numel() == 6 and ep.query.numel() == 10


def test_support_only_episode_is_the_one_few_shot_sampler():
    """queries=0: `shots` distinct examples of every class, seeded; what the classification demo draws (the
    benchmarks draw support and queries together through evaluate_episodes)."""
    labels = torch.arange(90) % 6
    ep = sample_episode(labels, ways=None, shots=5, queries=0, generator=torch.Generator().manual_seed(2))
    assert ep.query.numel() == 0 and ep.support.unique().numel() == 30
    assert torch.bincount(labels[ep.support], minlength=6).tolist() == [5] * 6
    again = sample_episode(labels, ways=None, shots=5, queries=0, generator=torch.Generator().manual_seed(2))
    other = sample_episode(labels, ways=None, shots=5, queries=0, generator=torch.Generator().manual_seed(3))
    assert torch.equal(ep.support, again.support) and not torch.equal(ep.support, other.support)
    with pytest.raises(ValueError, match="class 0 has 15 examples, an episode needs 16"):
        sample_episode(labels, ways=None, shots=16, queries=0, generator=torch.Generator())
    with pytest.raises(ValueError, match="queries >= 0"):
        sample_episode(labels, ways=None, shots=1, queries=-1, generator=torch.Generator())
    with pytest.raises(ValueError, match="queries and episodes: expected >= 1"):
        evaluate_episodes(lambda classes: None, torch.zeros(90, 2), labels, ways=None, shots=1, queries=0, episodes=1)


def test_one_hot_and_accuracy_against_hand_computations():
    labels = torch.tensor([2, 0, 1, 2])
    values = one_hot(labels, 4)
    assert values.dtype == torch.float32 and values.shape == (4, 4)
    assert values.tolist() == [[0, 0, 1, 0], [1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0]]
    scores = torch.tensor([[0.1, 0.2, 0.9], [0.5, 0.5, 0.0], [0.3, 0.2, 0.1], [0.0, 0.0, 0.0]])
    # Rows: right, tie -> class 0 (right), wrong, all-zero tie -> class 0 (wrong).
    assert accuracy(scores, torch.tensor([2, 0, 1, 1])) == 0.5
    with pytest.raises(ValueError, match="labels: expected an int64 tensor of shape"):
        one_hot(torch.tensor([0.0, 1.0]), 2)
    with pytest.raises(ValueError, match="scores, labels: expected shapes"):
        accuracy(scores, torch.tensor([0, 1]))


def test_interval_formulas():
    values = [0.5, 0.7, 0.9, 0.6]
    mean, half = mean_ci(values)
    assert mean == pytest.approx(0.675) and half == pytest.approx(1.959963984540054 * np.std(values, ddof=1) / 2)
    p, low, high = wilson_ci(45, 50)
    z = 1.959963984540054
    centre = (0.9 + z * z / 100) / (1 + z * z / 50)
    width = z * math.sqrt(0.9 * 0.1 / 50 + z * z / 10000) / (1 + z * z / 50)
    assert (p, low, high) == pytest.approx((0.9, centre - width, centre + width))
    assert wilson_ci(0, 10)[1] == 0.0 and wilson_ci(10, 10)[2] == pytest.approx(1.0)


def test_evaluate_episodes_and_full(task):
    X, y, E = task
    make = lambda classes: FAASTClassifier(label_embeddings=E[classes], classes=classes.tolist())  # noqa: E731
    r = evaluate_episodes(make, X, y, ways=3, shots=2, queries=3, episodes=4, seed=5)
    assert len(r.accuracies) == 4 and r.accuracy == pytest.approx(np.mean(r.accuracies))
    assert r.accuracies == evaluate_episodes(make, X, y, ways=3, shots=2, queries=3, episodes=4, seed=5).accuracies
    full = evaluate_full(make, X, y, X, y)
    assert full.accuracy == FAASTClassifier(label_embeddings=E).fit(X, y).score(X, y)
