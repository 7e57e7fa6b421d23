"""The LM evaluation pieces against direct computations on tiny models: label scoring (with and without a cached
prefix), in-context perplexity, the Wilson interval, stream splitting, the backprop linear projection, LoRA with a
matched parameter count and the KV-cache size."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from faast.hf.evaluate import continuation_log_probs, encode_prefix, perplexity, wilson_interval
from faast.hf.tokens import split_by_tokens
from hf_models import KINDS, VOCAB, tiny_model
from tolerances import LM_LAYOUT_ABS

# The backprop baselines are experiment code (experiments/lm_baselines), imported as the experiment scripts do.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
from lm_baselines import LinearProjection, apply_lora, fit_causal_lm, kv_cache_bytes, lora_rank_for  # noqa: E402


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def log_probs_of(model, sequence):  # noqa: ANN001, ANN201
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([sequence])).logits[0].double()
    return torch.log_softmax(logits, -1)


@pytest.mark.parametrize("kind", KINDS)
def test_continuation_log_probs_equal_the_softmax_of_the_whole_sequence(kind):
    model = tiny_model(kind)
    prompt, continuations = ids(9, 0), [[5], [7, 8, 9], [5, 11]]
    got = continuation_log_probs(model, prompt, continuations)
    for i, c in enumerate(continuations):
        table = log_probs_of(model, prompt + c)
        expected = sum(float(table[len(prompt) - 1 + j, t]) for j, t in enumerate(c))
        assert float(got[i]) == pytest.approx(expected, abs=LM_LAYOUT_ABS)
    # A cached prefix gives what the prefix and prompt give as one sequence.
    prefix = encode_prefix(model, ids(14, 1))
    cached = continuation_log_probs(model, prompt, continuations, prefix=prefix)
    whole = continuation_log_probs(model, prefix.ids + prompt, continuations)
    torch.testing.assert_close(cached, whole, atol=LM_LAYOUT_ABS, rtol=0)
    # The cache is copied, not extended: scoring twice gives the same numbers.
    torch.testing.assert_close(continuation_log_probs(model, prompt, continuations, prefix=prefix), cached)
    with pytest.raises(ValueError, match="continuations"):
        continuation_log_probs(model, prompt, [[]])


def test_perplexity_with_a_context_scores_the_same_tokens_given_the_context():
    model = tiny_model("llama")
    windows, context = [ids(10, 2), ids(7, 3)], ids(12, 4)
    plain = perplexity(model, windows, batch_size=2)
    with_context = perplexity(model, windows, batch_size=2, context=context)
    assert with_context.tokens == plain.tokens == 9 + 6
    nll = 0.0
    for w in windows:
        table = log_probs_of(model, context + w)
        nll -= sum(float(table[len(context) + j - 1, w[j]]) for j in range(1, len(w)))
    assert with_context.nll == pytest.approx(nll, abs=LM_LAYOUT_ABS * plain.tokens)
    assert with_context.nll != pytest.approx(plain.nll, abs=1e-3)


def test_wilson_interval_matches_published_values():
    # Newcombe (1998), Statistics in Medicine 17:857, Table I, method 3 (score interval without continuity correction).
    for (k, n), (low, high) in {(81, 263): (0.2553, 0.3662), (15, 148): (0.0624, 0.1605), (0, 20): (0.0, 0.1611),
                                (1, 29): (0.0061, 0.1718)}.items():  # fmt: skip
        got = wilson_interval(k, n)
        assert got == pytest.approx((low, high), abs=5e-5)
    assert wilson_interval(10, 10)[1] == 1.0
    with pytest.raises(ValueError, match="successes, trials"):
        wilson_interval(3, 0)


def test_splitting_a_stream_keeps_every_adjacent_pair_exactly_once():
    texts = [ids(n, s) for s, n in enumerate([10, 1, 5, 33, 2])]
    points = [3, 12, 20, 51]  # the last is the whole stream, as the curve uses it
    parts = split_by_tokens(texts, points)
    pairs = sorted((i, a, b) for i, t in enumerate(texts) for a, b in zip(t, t[1:], strict=False))
    got = []
    for part in parts:
        for piece in part:
            owner = next(i for i, t in enumerate(texts) if any(t[j : j + len(piece)] == piece for j in range(len(t))))
            got += [(owner, a, b) for a, b in zip(piece, piece[1:], strict=False)]
    assert sorted(got) == pairs
    # Each part holds the tokens up to its threshold: the first part is the first 3 tokens of the first text.
    assert parts[0] == [texts[0][:3]] and parts[1][0] == texts[0][2:]
    with pytest.raises(ValueError, match="thresholds"):
        split_by_tokens(texts, [5, 3])


@pytest.mark.parametrize("kind", KINDS)
def test_linear_projection_starts_as_the_base_model_and_learns(kind):
    model = tiny_model(kind)
    batch = torch.tensor([ids(20, 5)])
    with torch.no_grad():
        before = model(input_ids=batch).logits
    frozen = {n: p.clone() for n, p in model.named_parameters()}
    projection = LinearProjection(model, [1, 3])
    with torch.no_grad():
        assert torch.equal(model(input_ids=batch).logits, before)  # A = 0
    data = [ids(40, 6), ids(40, 7)]
    stats = fit_causal_lm(model, list(projection.parameters()), data, window=16, batch_size=2, lr=3e-2, epochs=8)
    assert stats.steps == 8 * 3 and stats.tokens == 8 * 2 * 39
    assert stats.last_loss < stats.first_loss - 0.05
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters())
    assert projection.nbytes() == 2 * 32 * 32 * 4
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=batch).logits, before)
        projection.remove()
        assert torch.equal(model(input_ids=batch).logits, before)
    with pytest.raises(ValueError, match="block indices"):
        LinearProjection(model, [0, 4])


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_lora_rank_matches_a_parameter_budget_and_unloads_to_the_base_model(kind):
    pytest.importorskip("peft")
    model = tiny_model(kind)
    # Per rank: GPT-2 c_attn (32 -> 96) in 4 blocks = 4 * 128; Llama q (32 -> 32) + v (32 -> 16) in 4 blocks = 4 * 112.
    per_rank = {"gpt2": 4 * 128, "llama": 4 * 112}[kind]
    budget = 2 * 32 * 32
    rank = lora_rank_for(model, budget)
    assert rank == round(budget / per_rank)
    batch = torch.tensor([ids(20, 8)])
    with torch.no_grad():
        before = model(input_ids=batch).logits
    lora = apply_lora(model, rank)
    trainable = [p for p in lora.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == rank * per_rank
    stats = fit_causal_lm(lora, trainable, [ids(40, 9)], window=16, batch_size=2, lr=1e-2, epochs=10)
    assert stats.last_loss < stats.first_loss
    with torch.no_grad():
        assert not torch.allclose(lora(input_ids=batch).logits, before)
        base = lora.unload()
        assert torch.equal(base(input_ids=batch).logits, before)


def test_lora_under_bfloat16_autocast_runs_its_products_in_bfloat16_and_keeps_float32_parameters():
    pytest.importorskip("peft")
    seen = []
    results = {}
    for autocast in (None, torch.bfloat16):
        lora = apply_lora(tiny_model("llama"), 2)
        proj = lora.get_base_model().model.layers[0].self_attn.q_proj
        handle = proj.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
        trainable = [p for p in lora.parameters() if p.requires_grad]
        stats = fit_causal_lm(lora, trainable, [ids(40, 9)], window=16, batch_size=2, lr=1e-2, epochs=3,
                              autocast=autocast)  # fmt: skip
        handle.remove()
        assert {p.dtype for p in trainable} == {torch.float32}
        results[autocast] = (set(seen), stats.last_loss)
        seen.clear()
    assert results[None][0] == {torch.float32} and results[torch.bfloat16][0] == {torch.bfloat16}
    assert results[None][1] != results[torch.bfloat16][1]
    with pytest.raises(ValueError, match="autocast: expected None, torch.bfloat16 or torch.float16"):
        fit_causal_lm(lora, trainable, [ids(40, 9)], autocast=torch.float32)


@pytest.mark.parametrize("kind", KINDS)
def test_kv_cache_bytes_equal_the_cache_a_forward_pass_keeps(kind):
    model = tiny_model(kind)
    with torch.no_grad():
        cache = model(input_ids=torch.tensor([ids(11, 10)]), use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert kv_cache_bytes(model, 11) == held
