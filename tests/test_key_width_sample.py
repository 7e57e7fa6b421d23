"""The residual output layer's key width chosen on a sample of the held-out rows (faast.hf.output.StepChoice.choose
with OutputPolicy.width_sample_min_rows rows or more): each width's recorded NLL against a float64 hand computation on
the sampled rows, and the chosen width then tuned on every row exactly as a layer offered that width alone would tune
it; and the blocked logsumexp the tuning reads its rows with."""

import dataclasses

import pytest
import torch

from faast.hf import FaastConfig, OutputPolicy, ResidualOutput, apply_faast
from faast.hf.output import StepChoice, tuning
from hf_models import tiny_model
from test_hf_residual import noisy_phrase, reference_statistics, tail_split, width_nll
from tolerances import HELD_OUT_NLL_REL, REORDER_REL, STEP_SEARCH_REL, assert_close, rel

CPU = torch.device("cpu")


@pytest.mark.parametrize("change_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 7), (63, 50), (64, 96), (130, 33)])
@pytest.mark.parametrize("eta", [None, 0.0, 0.37])
def test_row_logsumexp_equals_a_float64_reference_on_odd_shapes(shape, eta, change_dtype):
    # z1 in bfloat16 too (the head products' dtype): it widens exactly, so the reference reads the rounded values.
    g = torch.Generator().manual_seed(shape[0])
    z0, z1 = torch.randn(*shape, generator=g) * 4, torch.randn(*shape, generator=g).to(change_dtype)
    got = tuning.row_logsumexp(z0) if eta is None else tuning.row_logsumexp(z0, z1, eta)
    want = torch.logsumexp(z0.double() + (0.0 if eta is None else eta) * z1.double(), -1)
    assert got.shape == (shape[0],) and got.dtype == torch.float32
    assert_close(got, want, torch.float32)


@pytest.mark.parametrize("n", [1, 4, 5, 161])
def test_sample_first_puts_every_stride_th_row_first_and_keeps_every_row_once(n):
    order, m = tuning.sample_first(n, CPU)
    stride = OutputPolicy().search_sample_stride
    assert m == len(range(0, n, stride))
    assert order[:m].tolist() == list(range(0, n, stride))
    assert sorted(order.tolist()) == list(range(n))


@pytest.mark.parametrize("weight", ["auto", 0.5])
def test_the_key_width_is_chosen_on_a_sample_and_the_chosen_width_is_then_tuned_on_every_row(weight, monkeypatch):
    # noisy_phrase: 792 positions, 160 held out (all in the tuning sample), 312 fitted: enough for both widths (32,
    # 64). With width_sample_min_rows at 64 the widths are compared on every 4th held-out row (40 rows).
    x = noisy_phrase()
    output = ResidualOutput(tune_tokens=4096, head_dtype="float32", weight=weight,
                            policy=OutputPolicy(width_sample_min_rows=64))  # fmt: skip
    config = FaastConfig(output=output, learn_dtype="model")
    model = apply_faast(tiny_model("llama"), config)
    model.learn(x)
    layer = model.output_memory_layer
    m, _ = layer.solution(CPU, torch.float64)
    tuning_info = layer.last_tuning
    by_width = tuning_info["by_key_width"]
    assert sorted(by_width) == [32, 64]
    k, y, _, _, mu_gram, mass = reference_statistics(model, x, torch.ones_like(x, dtype=torch.bool))
    held, out = tail_split([99] * 8, 4096)
    assert tuning_info["held_out_tokens"] == held.numel() == 160
    sampled = held[:: output.policy.search_sample_stride]
    head = model.base_model.get_output_embeddings().weight.double()
    for width, chosen in by_width.items():
        assert chosen["rows"] == sampled.numel() == 40
        nll = width_nll(k, y, sampled, out, (mu_gram, mass), head, width, chosen)
        assert abs(nll - chosen["held_out_nll"]) < HELD_OUT_NLL_REL * nll, width
    width = min(by_width, key=lambda v: (by_width[v]["held_out_nll"], v))
    assert tuning_info["key_width"] == width == layer.chosen_key_width()
    # The chosen width on all 160 rows: what a layer offered that width alone, with no sample, tunes.
    monkeypatch.setattr(StepChoice, "widths", lambda self, fitted: [width])
    unsampled = dataclasses.replace(output, policy=OutputPolicy(width_sample_min_rows=10**6))
    alone = apply_faast(tiny_model("llama"), FaastConfig(output=unsampled, learn_dtype="model"))
    alone.learn(x)
    m_alone, _ = alone.output_memory_layer.solution(CPU, torch.float64)
    want = alone.output_memory_layer.last_tuning
    assert want["key_width"] == width and want["by_key_width"] == {}
    if weight == "auto":  # a grid and golden section: the same points whatever the start
        assert (tuning_info["step"], tuning_info["weight"]) == (want["step"], want["weight"])
    else:
        assert tuning_info["weight"] == want["weight"] == 0.5
        assert abs(tuning_info["step"] - want["step"]) <= STEP_SEARCH_REL * want["step"]
    assert tuning_info["held_out_gain"] == pytest.approx(want["held_out_gain"], rel=STEP_SEARCH_REL)
    assert m is not None and m.shape == (width, 32)
    assert rel(m / tuning_info["step"], m_alone / want["step"]) < REORDER_REL
