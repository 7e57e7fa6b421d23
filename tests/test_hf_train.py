"""Readout and scorer training (faast.hf.train) and its data pipeline (faast.hf.corpus), on tiny models."""

from __future__ import annotations

import math

import pytest
import torch

from faast.hf import EmbeddingOutput, FaastConfig, MemoryLayer, MiddleLayers, Regulariser, apply_faast, corpus
from faast.hf.train import TrainConfig, end_training_step, lr_factor, train_readout, training_step
from hf_models import VOCAB, CharTokenizer, tiny_model
from tolerances import rel


def fixed_batch(seed=0, batch=4, seq=24):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(3, VOCAB, (batch, seq), generator=g)
    # Learn the first half of each row, predict the second: the memory must carry the information.
    return {"learn_ids": x, "input_ids": x.roll(1, dims=0), "attention_mask": torch.ones_like(x)}


def test_gradients_flow_through_t_with_the_filtered_inverse_constant():
    torch.manual_seed(0)
    d, alpha, gamma = 8, 0.5, 0.9
    layer = MemoryLayer(
        d, FaastConfig(middle=MiddleLayers(dropout=0.0), regulariser=Regulariser(alpha=alpha)), index=0
    )
    with torch.no_grad():
        layer.readout.weight.normal_(0, 0.3)
        layer.scorer.weight.normal_(0, 0.3)
    h_old, h_new = torch.randn(2, 9, d), torch.randn(3, 7, d)
    pair_old = torch.ones(2, 8, dtype=torch.bool)
    pair_new = torch.ones(3, 6, dtype=torch.bool)
    pair_new[0, 4:] = False
    layer.learn(h_old, pair_old)
    layer.memory.apply_discount(gamma)
    layer.learn(h_new, pair_new, differentiable=True)
    layer.begin_training_step()
    q = torch.randn(5, d)
    layer(q).square().sum().backward()

    # The same quantities written out in float64: S_eps^+ from an eigendecomposition, T(a) with the new rows' scores
    # differentiable and the old rows' (already learned) constant.
    a = layer.scorer.weight.detach().double().clone().requires_grad_(True)
    p = layer.readout.weight.detach().double().clone().requires_grad_(True)

    def rows(h, pair):
        k, v = h[:, :-1].double().reshape(-1, d), h[:, 1:].double().reshape(-1, d)
        keep = pair.reshape(-1)
        return k[keep], v[keep]

    k0, v0 = rows(h_old, pair_old)
    k1, v1 = rows(h_new, pair_new)
    s0 = torch.sigmoid(torch.cat([k0, v0], -1) @ a.detach().mT)
    s1 = torch.sigmoid(torch.cat([k1, v1], -1) @ a.mT)
    gram = gamma * k0.mT @ k0 + k1.mT @ k1
    cross = gamma * k0.mT @ (s0 * v0) + k1.mT @ (s1 * v1)
    count = gamma * k0.shape[0] + k1.shape[0]
    lam, vecs = torch.linalg.eigh(gram)
    keep = lam > count ** (-2 * alpha) * lam[-1]
    inv = torch.where(keep, 1 / lam, torch.zeros_like(lam))
    w = vecs @ (inv.unsqueeze(-1) * (vecs.mT @ cross))
    out = q.double() + (q.double() @ w) @ p.mT
    out.square().sum().backward()
    assert rel(layer.readout.weight.grad, p.grad) < 1e-5
    assert rel(layer.scorer.weight.grad, a.grad) < 1e-5
    assert layer.scorer.weight.grad.abs().sum() > 0


def test_a_training_run_decreases_the_loss_on_a_fixed_batch():
    # The output layer the trainer's command line trains beside by default (the paper's, as for the shipped readout).
    # The residual output layer tunes its step on the stream, and a stream that learns the same batch every step
    # repeats its texts' ends, so its fold rule turns its memory of the batch on mid-run: the loss would then measure
    # that memory, not the readout being trained.
    config = FaastConfig(middle=MiddleLayers(num_layers=2, dropout=0.0), output=EmbeddingOutput())
    model = apply_faast(tiny_model("llama"), config)
    batch = fixed_batch()
    scorer_before = [layer.scorer.weight.detach().clone() for layer in model.memory_layers.values()]
    history = train_readout(model, [batch] * 25, TrainConfig(steps=25, lr=1e-2, warmup_steps=2, log_every=5))
    losses = [r["loss"] for r in history]
    assert len(losses) == 25
    assert sum(losses[-5:]) / 5 < losses[0] - 0.05
    for layer, before in zip(model.memory_layers.values(), scorer_before, strict=True):
        assert torch.count_nonzero(layer.readout.weight) > 0
        assert not torch.equal(layer.scorer.weight, before)  # the scorer learns through T
    assert all(not p.requires_grad for p in model.base_model.parameters())  # the base stayed frozen
    assert all(layer.training_weights is None for layer in model.memory_layers.values())


def test_training_in_bf16_keeps_fp32_master_weights():
    model = apply_faast(
        tiny_model("qwen2").to(torch.bfloat16), FaastConfig(middle=MiddleLayers(num_layers=1, dropout=0.0))
    )
    history = train_readout(model, [fixed_batch()] * 8, TrainConfig(steps=8, lr=1e-2, warmup_steps=1))
    layer = next(iter(model.memory_layers.values()))
    assert layer.readout.weight.dtype == torch.float32
    assert all(math.isfinite(r["loss"]) for r in history)
    assert torch.count_nonzero(layer.readout.weight) > 0


def test_readout_training_keeps_the_models_precision_whatever_learn_dtype_says():
    # learn_dtype is for learn() only: a training step's differentiable pass is never autocast.
    losses = {}
    for learn_dtype in ("model", "bfloat16"):
        model = apply_faast(
            tiny_model("llama"), FaastConfig(middle=MiddleLayers(num_layers=1, dropout=0.0), learn_dtype=learn_dtype)
        )
        loss = training_step(model, fixed_batch(), discount=1.0)
        loss.backward()
        layer = next(iter(model.memory_layers.values()))
        losses[learn_dtype] = (loss.detach(), layer.readout.weight.grad.clone())
        end_training_step(model)
    assert torch.equal(losses["model"][0], losses["bfloat16"][0])
    assert torch.equal(losses["model"][1], losses["bfloat16"][1])


def test_resuming_from_a_checkpoint_gives_the_uninterrupted_result(tmp_path):
    batches = [fixed_batch(seed=s) for s in range(6)]
    config = dict(steps=6, lr=1e-2, warmup_steps=1, checkpoint_every=3)

    straight = apply_faast(tiny_model("gpt2"), FaastConfig(middle=MiddleLayers(num_layers=2)))
    train_readout(straight, batches, TrainConfig(**config, checkpoint_dir=str(tmp_path / "a")))

    crashed = apply_faast(tiny_model("gpt2"), FaastConfig(middle=MiddleLayers(num_layers=2)))

    def stream(start):  # dies after the step-3 checkpoint
        for i, b in enumerate(batches[start:], start):
            if i == 4:
                raise KeyboardInterrupt
            yield b

    with pytest.raises(KeyboardInterrupt):
        train_readout(crashed, stream, TrainConfig(**config, checkpoint_dir=str(tmp_path / "b")))
    resumed = apply_faast(tiny_model("gpt2"), FaastConfig(middle=MiddleLayers(num_layers=2)))
    history = train_readout(
        resumed, lambda start: iter(batches[start:]), TrainConfig(**config, checkpoint_dir=str(tmp_path / "b"))
    )
    assert [r["step"] for r in history] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(straight.faast_layers(), resumed.faast_layers(), strict=True):
        assert torch.equal(a.memory.gram, b.memory.gram)
        if hasattr(a, "readout"):
            assert torch.equal(a.readout.weight, b.readout.weight)
            assert torch.equal(a.scorer.weight, b.scorer.weight)
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["step-00000003", "step-00000006"]


def test_schedule_and_config_checks():
    config = TrainConfig(steps=100, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(0, config) == pytest.approx(0.1)
    assert lr_factor(9, config) == pytest.approx(1.0)
    assert lr_factor(10, config) == pytest.approx(1.0)
    assert lr_factor(55, config) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(100, config) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="discount"):
        TrainConfig(discount=0)
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0)
    with pytest.raises(TypeError, match="faast.hf.FaastModel"):
        train_readout(tiny_model("gpt2"), [], TrainConfig())


def test_window_pairs_are_consecutive_windows_of_one_document(tmp_path):
    (tmp_path / "a.txt").write_text("abcdefghijklmnopqrstuvwxyz" * 2)
    (tmp_path / "b.txt").write_text("0123")
    (tmp_path / "c.bin").write_bytes(b"\xff\xfe\x00")
    docs = list(corpus.read_text_files([str(tmp_path / "*")]))
    assert [p.split("/")[-1] for p, _ in docs] == ["a.txt", "b.txt"]  # not UTF-8: skipped
    tok = CharTokenizer()
    pairs = list(corpus.window_pairs(docs, tok, 8))
    ids = tok("abcdefghijklmnopqrstuvwxyz" * 2)["input_ids"]
    assert pairs[0].learn == ids[:8] and pairs[0].target == ids[8:16]
    assert pairs[1].learn == ids[16:24] and pairs[1].target == ids[24:32]
    batch = corpus.collate(pairs)
    assert batch["input_ids"].shape == (3, 8) and batch["learn_mask"].sum() == 24
    with pytest.raises(FileNotFoundError, match="matches no file"):
        list(corpus.read_text_files([str(tmp_path / "*.md")]))
    shuffled = list(corpus.shuffled(range(100), 10, seed=0))
    assert sorted(shuffled) == list(range(100)) and shuffled != list(range(100))


def test_domain_pairs_learn_from_other_documents_of_the_same_domain():
    tok = CharTokenizer()
    groups = [[("a1", "a" * 40), ("a2", "b" * 40), ("a3", "c" * 40)], [("x1", "x" * 40), ("x2", "y" * 40)]]
    stream = corpus.domain_pairs(groups, tok, 8, steps_per_domain=3, batch_size=2, seed=0)
    batches = [next(stream) for _ in range(12)]
    letter = {tok(ch)["input_ids"][0]: ch for ch in "abcxy"}
    for phase in range(4):
        domains = set()
        for batch in batches[3 * phase : 3 * phase + 3]:
            for pair in batch:
                learned, predicted = letter[pair.learn[0]], letter[pair.target[0]]
                assert learned != predicted  # never the document being predicted
                assert len(pair.learn) == len(pair.target) == 8
                domains.add("abc".find(learned) >= 0)
                assert ("abc".find(learned) >= 0) == ("abc".find(predicted) >= 0)  # same domain
        assert len(domains) == 1  # the domain holds for steps_per_domain batches
    again = corpus.domain_pairs(groups, tok, 8, steps_per_domain=3, batch_size=2, seed=0)
    assert [[(p.learn, p.target) for p in next(again)] for _ in range(12)] == [
        [(p.learn, p.target) for p in b] for b in batches
    ]
    with pytest.raises(ValueError, match="two or more documents"):
        next(corpus.domain_pairs([[("only", "text")]], tok, 8))
