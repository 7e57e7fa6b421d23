"""The LM evaluation pieces against direct computations on tiny models: label scoring (with and without a cached
prefix), in-context perplexity, the Wilson interval, stream splitting, the backprop linear projection, LoRA with a
matched parameter count, the KV-cache size, and the tuning harness of the baselines (FAAST's held-out tail, the
held-out NLL, the nested training schedule and LoRA's tuned learning rate)."""

from __future__ import annotations

import math

import pytest
import torch

from faast.hf.evaluate import continuation_log_probs, encode_prefix, perplexity, wilson_interval
from faast.hf.held_out import tail_plan
from faast.hf.tokens import split_by_tokens, split_continuing

# The backprop baselines are experiment code (lab/experiments/lm_baselines), imported as the experiment scripts do.
from faast_lab.experiments.lm_baselines import (
    LinearProjection,
    apply_lora,
    fit_causal_lm,
    held_out_nll,
    kv_cache_bytes,
    lora_rank_for,
    tune_lora,
    tuning_split,
)
from hf_models import KINDS, VOCAB, tiny_model
from tolerances import LM_LAYOUT_ABS


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


def test_split_continuing_says_which_parts_begin_with_the_rest_of_a_cut_text():
    texts = [ids(n, s) for s, n in enumerate([10, 1, 5, 33, 2])]
    # Cut inside text 0 (3), inside text 0 again (8), at the end of text 0 (10: the next part starts a new text),
    # inside text 3 (20), and at the end (51).
    split = split_continuing(texts, [3, 8, 10, 20, 51])
    assert [part for part, _ in split] == split_by_tokens(texts, [3, 8, 10, 20, 51])
    assert [continues for _, continues in split] == [False, True, True, False, True]
    assert split[2][0] == [texts[0][7:]]  # the last 2 tokens of text 0, from the shared token on


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


# Documents of the tuning tests: lengths with a 1-token one (no positions) and a short one; 880 positions in all, so
# tail_plan (tune_tokens 2048, min_fit 256) holds out 20% of each and leaves gaps before them.
LENGTHS = [120, 1, 100, 127, 90, 128, 110, 60, 128, 5, 21]


def test_tuning_split_holds_out_exactly_what_tail_plan_says():
    docs = [ids(n, 20 + i) for i, n in enumerate(LENGTHS)]
    counts = [max(0, n - 1) for n in LENGTHS]
    plan = tail_plan(counts, sum(counts), 2048, 256)
    assert any(g for _, g in plan) and sum(h for h, _ in plan) >= 128  # gaps and a tail, as the test means
    split = tuning_split(docs, tune_tokens=2048, min_fit=256)
    assert split.plan == plan and split.held_tokens == sum(h for h, _ in plan)
    assert split.fit_lengths() == [n - h - g for n, (h, g) in zip(LENGTHS, plan, strict=True)]
    assert split.fit_texts() == [d[: n - h - g] for d, n, (h, g) in zip(docs, LENGTHS, plan, strict=True)
                                 if n - h - g >= 2]  # fmt: skip
    assert split.fit_tokens == sum(max(0, n - h - g - 1) for n, (h, g) in zip(LENGTHS, plan, strict=True))
    # The rows score, document by document, exactly the targets of the last held_i positions (tokens L - h .. L - 1),
    # each in a contiguous slice of its document that fits the window, with at least window - stride tokens before
    # it (or the whole document before it).
    for window in (16, 128):
        rows, stride = iter(split.held_rows(window)), window // 2
        for doc, (held, _) in zip(docs, plan, strict=True):
            scored = []
            while len(scored) < held:
                row, n = next(rows)
                start = next(a for a in range(len(doc)) if doc[a : a + len(row)] == row)
                assert 1 <= n < len(row) <= window
                first = start + len(row) - n  # the first target's index in the document
                assert first - start >= min(first, window - stride)
                scored += range(first, start + len(row))
            assert scored == list(range(len(doc) - held, len(doc)))
        assert next(rows, None) is None
    with pytest.raises(ValueError, match="token_lists: 99 learned positions"):
        tuning_split([ids(100, 0)], tune_tokens=2048, min_fit=256)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_held_out_nll_equals_a_float64_computation_on_exactly_the_held_positions(kind):
    model = tiny_model(kind)
    docs = [ids(n, 40 + i) for i, n in enumerate(LENGTHS)]
    split = tuning_split(docs, tune_tokens=2048, min_fit=256)
    # A window as long as the longest document: every target's context is all of its document before it.
    nll, count = held_out_nll(model, split, window=128, batch_size=3)
    expected = 0.0
    for doc, (held, _) in zip(docs, split.plan, strict=True):
        if held:
            table = log_probs_of(model, doc)
            expected -= sum(float(table[t - 1, doc[t]]) for t in range(len(doc) - held, len(doc)))
    assert count == split.held_tokens
    assert nll == pytest.approx(expected, abs=LM_LAYOUT_ABS * count)
    # A short window: each row alone, unpadded, scores its last n tokens.
    nll, count = held_out_nll(model, split, window=16, batch_size=3)
    expected = 0.0
    for row, n in split.held_rows(16):
        table = log_probs_of(model, row)
        expected -= sum(float(table[t - 1, row[t]]) for t in range(len(row) - n, len(row)))
    assert count == split.held_tokens and nll == pytest.approx(expected, abs=LM_LAYOUT_ABS * count)


def test_epoch_warmup_nests_epochs_and_the_time_budget_and_callback_stop_training():
    model, data = tiny_model("llama", layers=3), [ids(91, 11), ids(61, 12)]
    # 6 + 4 windows of 16 tokens, one a step: 10 steps an epoch, so warmup 'epoch' is 1 step, 'total' 3 of 3 epochs.
    fit = {"window": 16, "batch_size": 1, "lr": 3e-2, "seed": 3}

    def run(epochs: int, warmup: str = "epoch", **extra: object) -> tuple[list, object, list]:
        projection = LinearProjection(model, [1, 2])
        after_first = []

        def snapshot(epoch: int) -> bool:
            if epoch == 1:
                after_first.extend(p.detach().clone() for p in projection.parameters())
            return False

        try:
            stats = fit_causal_lm(model, list(projection.parameters()), data, epochs=epochs, warmup=warmup,
                                  on_epoch=extra.pop("on_epoch", snapshot), **fit, **extra)  # fmt: skip
            return [p.detach().clone() for p in projection.parameters()], stats, after_first
        finally:
            projection.remove()

    one, stats, _ = run(1)
    assert stats.steps == stats.steps_per_epoch == 10 and stats.epochs == 1.0
    # warmup='epoch': the first epoch of a 3-epoch run is the 1-epoch run; warmup='total' (10% of all steps) is not.
    _, stats, first = run(3)
    assert stats.steps == 30 and all(torch.equal(a, b) for a, b in zip(one, first, strict=True))
    _, _, first_total = run(3, "total")
    assert not any(torch.equal(a, b) for a, b in zip(one, first_total, strict=True))
    # The callback stops the run; a zero time budget leaves one step, a large one all of them.
    assert run(5, on_epoch=lambda epoch: epoch == 2)[1].steps == 20
    for budget, steps in ((0.0, 1), (1e6, 20)):
        got = run(2, max_seconds=budget)[1]
        assert got.steps == steps and got.epochs == steps / 10
    with pytest.raises(ValueError, match="warmup: expected 'total' or 'epoch'"):
        run(1, "steps")


def test_the_step_callback_sees_every_step_across_epochs_and_stopping_there_equals_a_shorter_run():
    model, data = tiny_model("llama", layers=3), [ids(91, 11), ids(61, 12)]
    fit = {"window": 16, "batch_size": 1, "lr": 3e-2, "seed": 3, "warmup": "epoch"}  # 10 steps an epoch
    seen, at_13 = [], []

    def run(epochs: int, stop_at: int | None = None) -> tuple[list, object]:
        projection = LinearProjection(model, [1, 2])

        def on_step(step: int) -> bool:
            assert not model.training  # the callback scores the model as the final one is scored: eval mode
            seen.append(step)
            if step == 13:
                at_13.append([p.detach().clone() for p in projection.parameters()])
            return step == stop_at

        try:
            stats = fit_causal_lm(model, list(projection.parameters()), data, epochs=epochs, on_step=on_step, **fit)
            return [p.detach().clone() for p in projection.parameters()], stats
        finally:
            projection.remove()

    full, stats = run(2)
    assert seen == list(range(1, 21)) and stats.steps == 20
    # Stopped by the callback after step 13 (mid-epoch 2): the parameters the longer run had after its step 13.
    stopped, stats = run(3, stop_at=13)
    assert stats.steps == 13 and stats.epochs == 1.3 and seen[20:] == list(range(1, 14))
    assert all(torch.equal(a, b) for a, b in zip(stopped, at_13[0], strict=True))
    assert not any(torch.equal(a, b) for a, b in zip(stopped, full, strict=True))


def test_tuned_lora_chooses_the_learning_rate_that_learns_on_the_schedule_its_final_training_follows():
    pytest.importorskip("peft")
    model = tiny_model("llama")
    docs = [[5, 9, 13, 21] * 75 for _ in range(3)]  # strongly repetitive: a few steps of LoRA learn it
    split = tuning_split(docs, tune_tokens=128, min_fit=256)
    probe = torch.tensor([ids(20, 8)])
    with torch.no_grad():
        before = model(input_ids=probe).logits
    fit = {"rank": 2, "train_window": 32, "batch_size": 4}
    choice = tune_lora(model, split, lrs=(1e-9, 3e-2), max_epochs=2, window=64, **fit)
    grid = {(g["lr"], g["epochs"]): g["nll"] for g in choice.grid}
    assert list(grid) == [(1e-9, 1), (1e-9, 2), (3e-2, 1), (3e-2, 2)]
    # A vanishing lr leaves the base model's held-out NLL; the working one lowers it, more with the second epoch.
    assert grid[(1e-9, 2)] == pytest.approx(choice.base_nll, abs=1e-5)
    assert (choice.lr, choice.epochs) == (3e-2, 2) and choice.nll == min(grid.values())
    assert grid[(3e-2, 2)] < grid[(3e-2, 1)] < choice.base_nll - 0.1
    assert choice.held_tokens == split.held_tokens and choice.fit_tokens == split.fit_tokens and choice.tuning_s > 0
    with torch.no_grad():
        assert torch.equal(model(input_ids=probe).logits, before)  # every LoRA unloaded
    # The final training with the chosen lr for one epoch (same seed, same warmup rule) is the tuning's first epoch.
    torch.manual_seed(0)
    lora = apply_lora(model, 2)
    trainable = [p for p in lora.parameters() if p.requires_grad]
    fit_causal_lm(lora, trainable, split.fit_texts(), window=32, batch_size=4, lr=3e-2, epochs=1, warmup="epoch")
    nll, count = held_out_nll(lora, split, window=64, batch_size=4)
    lora.unload()
    assert math.isclose(nll / count, grid[(3e-2, 1)], rel_tol=1e-6)
