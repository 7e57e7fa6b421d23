"""The learning pass's linears in int8 (FaastConfig.learn_dtype='int8', faast/hf/int8_pass.py): `Int8Pass` against a
float64 hand computation of the same int8 numbers, which linears it takes and which it leaves in float32, its kept int8
weights, what learn() learns under it, that 'auto' takes the mode measured fastest, and the errors where it cannot
run."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from faast.hf import FaastConfig, MiddleLayers, ResidualOutput, apply_faast, int8_pass
from faast.hf import learning as learning_module
from faast.hf.output import head as head_module
from hf_models import KINDS, tiny_model
from test_hf_residual import STAT_REL, full_keys, ids, reference_statistics
from test_int8 import _pin
from tolerances import INT8_PASS_REL, assert_close, rel

WIDEST = 12


def weights(rows: int = 7, width: int = WIDEST, seed: int = 0):  # noqa: ANN201
    """x [2, 5, width] with column 3 planted 20× the others, weight [rows, width], bias [rows]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, width, generator=g)
    x[..., 3] *= 20
    return x, torch.randn(rows, width, generator=g), torch.randn(rows, generator=g)


@pytest.mark.parametrize("outliers", [0, 2, WIDEST])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_linear_in_the_pass_is_the_product_of_its_int8_numbers(monkeypatch, outliers, with_bias):
    """By hand in float64: the `outliers` input columns of largest magnitude exactly, every other entry as its int8
    number times its row's and the weight row's scales, plus the bias; over a [2, 5, k] input (rows flattened). The
    torch._int_mm kernel's arithmetic (fbgemm's 7-bit inputs: tests/test_int8.py)."""
    _pin(monkeypatch, "torch.int_mm")
    x, weight, bias = weights()
    bias = bias if with_bias else None
    mode = int8_pass.Int8Pass(int8_pass.Int8Weights(), widest=WIDEST, outliers=outliers)
    with mode:
        got = F.linear(x, weight, bias)
    assert mode.calls == 1 and got.dtype == torch.float32 and got.shape == (2, 5, 7)
    rows = x.reshape(-1, WIDEST).double()
    columns = rows.abs().amax(0).topk(outliers).indices
    if outliers:
        assert 3 in columns.tolist()
    rest = rows.clone()
    rest[:, columns] = 0
    row_scale = rest.abs().amax(1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127  # all kept: 0
    w = weight.double()
    w_scale = w.abs().amax(1) / 127
    expected = (torch.round(rest / row_scale) @ torch.round(w / w_scale[:, None]).T) * row_scale * w_scale
    expected += rows[:, columns] @ w[:, columns].T
    if bias is not None:
        expected += bias.double()
    assert_close(got.reshape(-1, 7), expected, torch.float32)
    # ... and within the declared tolerance of the true float64 product
    true = rows @ w.T + (0 if bias is None else bias.double())
    assert rel(got.reshape(-1, 7), true) < INT8_PASS_REL


def test_the_pass_leaves_wide_inputs_other_dtypes_and_gradients_in_their_own_products():
    x, weight, bias = weights()
    wide, wide_weight, _ = weights(width=WIDEST + 1)
    mode = int8_pass.Int8Pass(int8_pass.Int8Weights(), widest=WIDEST, outliers=0)
    leaf = weight.clone().requires_grad_(True)
    with mode:
        assert torch.equal(F.linear(wide, wide_weight), wide @ wide_weight.T)  # wider than the hidden size
        exact64 = F.linear(x.double(), weight.double(), bias.double())
        assert exact64.dtype == torch.float64
        assert torch.equal(exact64, torch.addmm(bias.double(), x.double().reshape(-1, WIDEST), weight.double().T)
                           .view(2, 5, 7))  # fmt: skip
        trained = F.linear(x, leaf)  # a gradient is asked for: float32, and it flows
        assert trained.requires_grad and torch.equal(trained.detach(), x @ weight.T)
        assert mode.calls == 0
        with torch.no_grad():
            assert not torch.equal(F.linear(x, leaf), x @ weight.T)  # no gradient asked for: int8
        assert mode.calls == 1
        assert torch.equal(torch.matmul(x, weight.T), x @ weight.T)  # only F.linear is taken
    trained.sum().backward()
    assert leaf.grad is not None and mode.calls == 1


def test_the_int8_weights_are_formed_once_per_kept_call_and_again_after_an_in_place_change(monkeypatch):
    _pin(monkeypatch, "torch.int_mm")  # its int8 weight is q and the row scales alone (fbgemm adds a packed copy)
    formed = []

    class Counted(int8_pass.Int8Weight):
        def __init__(self, weight):  # noqa: ANN001
            formed.append(weight.data_ptr())
            super().__init__(weight)

    monkeypatch.setattr(int8_pass, "Int8Weight", Counted)
    x, weight, _ = weights()
    held = int8_pass.Int8Weights()
    mode = int8_pass.Int8Pass(held, widest=WIDEST, outliers=0)
    with mode:
        F.linear(x, weight)
        F.linear(x, weight)
    assert len(formed) == 2 and held.held_bytes() == 0  # outside kept(): formed each call, nothing kept
    with held.kept(), mode:
        first = F.linear(x, weight)
        assert torch.equal(F.linear(x, weight), first) and len(formed) == 3
        assert held.held_bytes() == weight.numel() + 4 * weight.shape[0]
        weight.mul_(2)  # in place: a new version, formed again
        assert torch.allclose(F.linear(x, weight), 2 * first, rtol=1e-5, atol=1e-5) and len(formed) == 4
    assert held.held_bytes() == 0


def int8_model(kind: str, learn_dtype: str = "int8", **output):  # noqa: ANN201
    return apply_faast(
        tiny_model(kind), FaastConfig(output=ResidualOutput(step=0.3, **output), learn_dtype=learn_dtype)
    )


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "gpt2"])  # GPT-2: Conv1D, below
def test_learning_in_int8_learns_the_int8_pass_states_and_keeps_the_wide_linears_float32(kind, monkeypatch):
    """learn() with learn_dtype='int8' adds exactly the keys an int8 pass gives (the hooks still capture float32
    states), within INT8_PASS_REL of the float32 pass's; per block every linear but the MLP's down projection (input
    64 wide, the hidden size 32) ran in int8."""
    monkeypatch.setattr(head_module, "INT8_OUTLIERS", 4)  # SmolLM2's 32 of 576; 32 would be all of the tiny 32
    modes = []
    real = int8_pass.Int8Pass

    def spy(*args, **kwargs):
        modes.append(real(*args, **kwargs))
        return modes[-1]

    monkeypatch.setattr(learning_module, "Int8Pass", spy)
    x = ids(batch=3, seq=40, period=11)
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[1, 30:] = False
    model = int8_model(kind)
    model.learn(x, mask)
    assert len(modes) == 1 and modes[0].widest == 32
    blocks = model.base_model.config.num_hidden_layers
    linears = [n for n, m in model.base_model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    narrow = [n for n in linears if model.base_model.get_submodule(n).in_features <= 32]
    assert len(narrow) < len(linears) and modes[0].calls == len(narrow)  # one batch: each narrow linear once
    assert len(linears) - len(narrow) == blocks  # the down projections
    gram = model.output_memory_layer.memory.gram
    exact = reference_statistics(model, x, mask)[2]
    with real(int8_pass.Int8Weights(), widest=32):
        k8 = full_keys(model, x, mask)
    pair = (mask[:, :-1] & mask[:, 1:]).reshape(-1)
    k8 = k8[:, :-1].reshape(-1, k8.shape[-1])[pair]
    assert rel(gram, k8.T @ k8) <= STAT_REL  # learn() ran the int8 pass
    assert 0 < rel(gram, exact) <= INT8_PASS_REL
    assert model.learner.precision()["learn_pass"] == "int8"


def test_a_learn_call_rounds_each_weight_once_for_all_its_batches(monkeypatch):
    formed = []

    class Counted(int8_pass.Int8Weight):
        def __init__(self, weight):  # noqa: ANN001
            formed.append(weight.data_ptr())
            super().__init__(weight)

    monkeypatch.setattr(int8_pass, "Int8Weight", Counted)
    model = int8_model("llama")
    texts = [list(range(1, 60)), list(range(3, 50)), list(range(7, 40))]
    stats = model.learn(texts, max_length=32, batch_size=1)
    narrow = model.learner.int8_linears()
    assert stats.batches >= 4 and narrow > 0
    assert len(formed) == len(set(formed)) == narrow  # every weight once, for every batch of the call
    model.learn(texts, max_length=32, batch_size=1)
    assert len(formed) == 2 * narrow  # dropped at the end of a call, formed again by the next


@pytest.mark.parametrize(
    ("fastest", "model_dtype", "expected"),
    [("torch.int8", torch.float32, "int8"), ("torch.bfloat16", torch.float32, "bfloat16"),
     ("torch.float32", torch.float32, "model"), ("torch.int8", torch.float64, "model")],
)  # fmt: skip
def test_auto_takes_the_mode_measured_fastest_for_float32_weights_on_a_cpu(timed, fastest, model_dtype, expected,
                                                                           monkeypatch):  # fmt: skip
    """'auto' learns exactly what the measured fastest mode learns when pinned; float64 weights keep their dtype."""
    monkeypatch.setattr(head_module, "INT8_OUTLIERS", 4)
    timed.times = {"torch.float32": 1.0, "torch.bfloat16": 1.0, "torch.int8": 1.0, fastest: 0.1}
    x = ids(batch=2, seq=30)

    def learned(learn_dtype, dtype=model_dtype):
        model = apply_faast(tiny_model("llama").to(dtype), FaastConfig(output=ResidualOutput(step=0.3),
                                                                       learn_dtype=learn_dtype))  # fmt: skip
        model.learn(x)
        return model, model.output_memory_layer.memory.gram

    auto, gram = learned("auto")
    assert auto.learner.pass_precision(torch.device("cpu")) == expected
    assert torch.equal(gram, learned(expected)[1])
    recorded = str(model_dtype).split(".")[-1] if expected == "model" else expected
    assert auto.learner.precision()["learn_pass"] == recorded


def test_int8_where_it_cannot_run_raises_before_anything_is_learned(monkeypatch):
    """learn_dtype='int8' with float64 weights, or off the CPU, raises ValueError naming the field in learn(), before
    the pass: no memory (middle or output) learns."""
    x = ids(batch=2, seq=30)
    config = FaastConfig(output=ResidualOutput(step=0.5), middle=MiddleLayers(layers=[1, 2]), learn_dtype="int8")
    model = apply_faast(tiny_model("llama").double(), config)
    with pytest.raises(ValueError, match="FaastConfig.learn_dtype: 'int8' runs the pass on a CPU with float32"):
        model.learn(x)
    assert all(float(layer.memory.count) == 0 for layer in model.faast_layers())
    model = apply_faast(tiny_model("llama"), config)
    with pytest.raises(ValueError, match="got torch.float32 weights on meta"):
        model.learner.pass_precision(torch.device("meta"))  # a GPU's path: no CUDA here
    model.learn(x)  # on the CPU with float32 weights the same configuration learns
    assert all(float(layer.memory.count) > 0 for layer in model.faast_layers())


def test_a_decoder_without_linears_raises_for_int8_and_auto_never_times_it(timed):
    """GPT-2's blocks multiply through Conv1D, which the int8 pass does not take: an explicit 'int8' raises before
    anything is learned; 'auto' on a CPU where int8 would be fastest does not time it and learns exactly the float32
    pass."""
    x = ids(batch=2, seq=30)
    model = int8_model("gpt2")
    with pytest.raises(ValueError, match="this model has none \\(GPT-2's blocks use Conv1D\\)"):
        model.learn(x)
    assert float(model.output_memory_layer.memory.count) == 0
    timed.times = {"torch.float32": 1.0, "torch.bfloat16": 2.0, "torch.int8": 0.1}  # int8 would win, could it run
    auto = int8_model("gpt2", "auto")
    auto.learn(x)
    auto.learn(x)
    assert auto.learner.precision()["learn_pass"] == "float32"
    assert not any(key.startswith("learn_pass") for entries in json.loads(timed.path.read_text())["entries"].values()
                   for key in entries)  # fmt: skip
    plain = int8_model("gpt2", "model")
    plain.learn(x)
    plain.learn(x)
    assert torch.equal(auto.output_memory_layer.memory.gram, plain.output_memory_layer.memory.gram)


def test_the_config_takes_int8_and_names_it_in_its_error():
    assert FaastConfig.from_dict(FaastConfig(learn_dtype="int8").to_dict()).learn_dtype == "int8"
    with pytest.raises(ValueError, match="learn_dtype: expected 'auto', 'model', 'bfloat16' or 'int8'"):
        FaastConfig(learn_dtype="int4")
