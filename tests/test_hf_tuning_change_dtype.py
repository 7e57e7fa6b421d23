"""The dtype the residual output layer's step tuning forms the logits' change z1 in (StepChoice.change_weight,
docs/design.md §6.3): the head products' (head_dtype; 'auto' bfloat16 where the CPU multiplies it natively). z1
against a float64 hand computation, and the step tuned on a bfloat16 z1 against the one tuned on float32 products
from the same statistics. The row passes on a bfloat16 z1 are checked against float64
with the float32 ones (test_step_search, test_key_width_sample)."""

from __future__ import annotations

import pytest
import torch

from faast.hf import FaastConfig, ResidualOutput, apply_faast
from hf_models import tiny_model
from test_hf_residual import noisy_phrase
from tolerances import BF16_CHANGE_STEP_REL, ELEMENTWISE, assert_close

CPU = torch.device("cpu")


def learned(x, key_layers="auto", **learn):  # noqa: ANN001, ANN003, ANN201 - test helper
    """A tiny llama that learned x with float32 head products, not yet solved: the solve's dtype is set after."""
    output = ResidualOutput(tune_tokens=4096, head_dtype="float32", key_layers=key_layers)
    model = apply_faast(tiny_model("llama"), FaastConfig(output=output, learn_dtype="model"))
    model.learn(x, **learn)
    return model


@pytest.mark.parametrize("setting, fastest, want", [
    ("auto", "torch.bfloat16", torch.bfloat16), ("auto", "torch.float32", torch.float32),
    ("auto", "torch.int8", torch.float32), ("float32", "torch.bfloat16", torch.float32),
    ("bfloat16", "torch.float32", torch.bfloat16),
])  # fmt: skip
def test_the_change_is_formed_in_the_head_products_dtype(timed, setting, fastest, want):
    """'auto' on a CPU: the head products measured fastest (int8 logits keep the change in float32)."""
    timed.times = {"torch.float32": 1.0, "torch.bfloat16": 1.0, "torch.int8": 1.0, fastest: 0.1}
    layer = learned(noisy_phrase()).output_memory_layer
    layer.head_dtype = setting
    weight = layer.step_choice().change_weight()
    assert weight.dtype == want and weight.shape == layer.head.weight.shape
    assert_close(weight, layer.head.weight.to(want), torch.float32)  # the cast, nothing else


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_tail_logits_change_equals_a_float64_hand_computation(dtype):
    layer = learned(noisy_phrase()).output_memory_layer
    layer.head_dtype = str(dtype).split(".")[-1]
    choice = layer.step_choice()
    keys, ys, _, s_tail, t_tail, n_tail, _, _ = choice.tail_statistics()
    memory = layer.memory
    w = layer.newton(memory.gram - s_tail, memory.cross - t_tail, memory.count - n_tail, layer.damped_curvature())
    z0, z1, target0, target1 = choice.tail_logits(keys, ys, w)
    head = layer.head.weight.double()
    want = (keys.double() @ w) @ head.T
    assert z1.dtype == dtype and z0.dtype == target0.dtype == target1.dtype == torch.float32
    # bfloat16: the change [m, d] and H round to bfloat16 before the product, and z1 once more after it.
    atol, rtol = ELEMENTWISE[dtype]
    scale = float(want.abs().max())
    torch.testing.assert_close(z1.double(), want, atol=atol * scale, rtol=rtol)
    assert torch.equal(target1, z1.gather(-1, ys[:, None]).squeeze(-1).float())
    assert_close(z0, keys[:, : layer.hidden_size].double() @ head.T, torch.float32)


def test_a_bfloat16_change_tunes_the_float32_products_step():
    # The same statistics solved twice: z1 from float32 products, then from bfloat16 ones.
    steps = {}
    for dtype in ("float32", "bfloat16"):
        layer = learned(noisy_phrase()).output_memory_layer
        layer.head_dtype = dtype
        layer.solution(CPU, torch.float32)
        steps[dtype] = layer.last_tuning
    want, got = steps["float32"], steps["bfloat16"]
    assert want["step"] > 0 and got["key_width"] == want["key_width"]
    assert abs(got["step"] - want["step"]) <= BF16_CHANGE_STEP_REL * want["step"]
    assert abs(got["held_out_gain"] - want["held_out_gain"]) <= BF16_CHANGE_STEP_REL * want["held_out_gain"]
