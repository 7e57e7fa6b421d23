"""The residual output layer's tuned constants as one OutputPolicy (faast/hf/output/policy.py, docs/design.md §6.3):
checked when built, saved with the configuration and loaded back (older configurations take the default), read by
the layer in place of module globals, and replaceable on a learned layer."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from faast.hf import (
    FaastConfig,
    OutputPolicy,
    ResidualOutput,
    apply_faast,
    from_pretrained,
)
from faast.hf import config as config_module
from faast.hf.output import DEFAULT_POLICY
from faast.hf.output import bias as output_bias
from faast.hf.output import diagnosis as output_diagnosis
from faast.hf.output import head as head_module
from faast.hf.output import layer as output_module
from faast.hf.output import step as step_module
from faast.hf.output import tuning as tuning_module
from hf_models import tiny_model
from test_hf_residual import ids

# The module globals the policy replaced: none may come back, or an experiment could rebind it again.
REPLACED = {
    output_module: ("DEFAULT_STEP", "DEFAULT_STEP_PER_DIM", "DEFAULT_WEIGHT"),
    step_module: (),  # the step choice reads its policy too
    output_bias: ("TOKEN_PRIOR",),
    output_diagnosis: ("PART_MIN_POSITIONS", "PART_STEP_RATIO", "DOCUMENT_POSITIONS_PER_DIM", "DOCUMENT_SHRINK_POWER"),
    tuning_module: ("STEP_ITERATIONS", "STEP_TOL", "MAX_STEP", "HELD_OUT_SHARE", "MIN_HELD_OUT", "MIN_FIT_TOKENS",
                    "FIT_PER_KEY_DIM", "SEARCH_SAMPLE_STRIDE", "SEARCH_SAMPLE_MIN_ROWS", "WIDTH_SAMPLE_MIN_ROWS",
                    "TUNE_SAMPLE", "GAP_MULTIPLE", "MIN_GRID_STEP", "GOLDEN_ITERATIONS", "WEIGHT_ITERATIONS",
                    "MIN_GAIN_SE"),
    head_module: ("POOL_AUTO", "POOL_DENSE_SHARE"),
    config_module: ("AUTO_KEY_BLOCK_DIVISOR",),
}  # fmt: skip
# Fields of mechanisms added after the policy replaced the globals: no module ever held them.
ADDED = ("document_folds", "document_folds_gate")


def test_no_module_keeps_a_tuned_constant_of_the_policy():
    left = [f"{m.__name__}.{n}" for m, names in REPLACED.items() for n in names if hasattr(m, n)]
    assert not left, left
    # DEFAULT_STEP: two fields
    assert len(dataclasses.fields(OutputPolicy)) == sum(map(len, REPLACED.values())) + 1 + len(ADDED)
    assert all(hasattr(OutputPolicy(), name) for name in ADDED)


def test_the_default_policy_holds_the_shipped_choices():
    p = OutputPolicy()
    assert p == DEFAULT_POLICY and hash(p) == hash(DEFAULT_POLICY)
    assert (p.default_step("probability"), p.default_step("logit"), p.default_weight) == (0.03, 0.015, 0.5)
    assert (p.held_out_share, p.min_held_out, p.min_fit_tokens, p.fit_per_key_dim, p.gap_multiple) == (
        0.2,
        128,
        256,
        4,
        2,
    )
    assert (p.document_positions_per_dim, p.document_shrink_power, p.pool_auto, p.pool_dense_share) == (
        2,
        0.5,
        3e-4,
        0.6,
    )
    assert (p.auto_key_block_divisor, p.document_folds, p.document_folds_gate) == (7, 4, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_step = 8.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "bad"),
    [("part_min_positions", 0), ("part_min_positions", 2.0), ("gap_multiple", -1), ("gap_multiple", True),
     ("tune_sample", 0), ("max_step", 0.0), ("step_tol", math.nan), ("held_out_share", 1.0), ("held_out_share", 0.0),
     ("default_weight", 1.5), ("min_grid_step", 8.0), ("pool_auto", -1e-4), ("part_step_ratio", 0.0),
     ("document_shrink_power", math.nan), ("default_step_per_dim", 0), ("token_prior", "0.3"),
     ("pool_dense_share", 1.5), ("pool_dense_share", -0.1), ("pool_dense_share", None)],
)  # fmt: skip
def test_a_value_out_of_range_is_refused_naming_its_field(field, bad):
    with pytest.raises(ValueError, match=f"OutputPolicy.{field}: expected"):
        OutputPolicy(**{field: bad})


def test_the_policy_is_saved_with_the_configuration_and_older_ones_load_the_default(tmp_path):
    policy = OutputPolicy(document_shrink_power=0.0, gap_multiple=1, token_prior=0.1)
    config = FaastConfig(output=ResidualOutput(policy=policy))
    data = json.loads(config.to_json())
    assert data["output"]["policy"]["gap_multiple"] == 1 and data["output"]["policy"]["document_shrink_power"] == 0
    assert FaastConfig.from_json(config.to_json()) == config
    del data["output"]["policy"]  # as a configuration saved before the policy existed
    assert FaastConfig.from_dict(data).output.policy == OutputPolicy()
    data["output"]["policy"] = {"gap_multiple": 3}  # fields missing take today's defaults
    assert FaastConfig.from_dict(data).output.policy == OutputPolicy(gap_multiple=3)
    data["output"]["policy"] = {"gap_multiples": 3}
    with pytest.raises(ValueError, match=r"ResidualOutput.policy: unknown fields \['gap_multiples'\]"):
        FaastConfig.from_dict(data)
    with pytest.raises(ValueError, match="ResidualOutput.policy: expected an OutputPolicy"):
        ResidualOutput(policy={"gap_multiple": 3})
    # A saved model loads with the policy it was saved with.
    model = apply_faast(tiny_model("llama"), config)
    model.learn(ids(batch=2, seq=30))
    model.save_pretrained(tmp_path / "saved")
    loaded = from_pretrained(tiny_model("llama"), tmp_path / "saved")
    assert loaded.faast_config.output.policy == policy == loaded.output_memory_layer.policy
    assert loaded.output_memory_layer.held_out.policy == policy


@pytest.mark.parametrize("removed", [{"folds": 2}, {"folds": 3, "fold_step_ratio": float("inf")},
                                     {"token_bias_full": 32_768}])  # fmt: skip
def test_a_configuration_saved_with_a_removed_mechanisms_fields_loads_with_a_warning_naming_them(removed):
    """The held-out ends in folds and the token bias's ramp were removed (docs/design.md §6.3): a configuration
    written before loads, its other fields kept, and the warning names what it leaves out."""
    data = json.loads(FaastConfig(output=ResidualOutput(policy=OutputPolicy(gap_multiple=1))).to_json())
    data["output"]["policy"].update(removed)
    with pytest.warns(UserWarning, match=r"ResidualOutput.policy: \[" + ", ".join(f"'{k}'" for k in sorted(removed))):
        loaded = FaastConfig.from_dict(data)
    assert loaded.output.policy == OutputPolicy(gap_multiple=1)
    assert not set(removed) & set(loaded.output.policy.to_dict())


def test_the_layer_reads_its_policy():
    # The untuned step and weight, their ramp, the token bias's κ, and the block 'auto' widens the keys with.
    policy = OutputPolicy(default_step_probability=0.07, default_step_per_dim=1.0, token_prior=1.0,
                          auto_key_block_divisor=2)  # fmt: skip
    x = ids(batch=2, seq=30)
    layers = {}
    for name, p in (("shipped", OutputPolicy()), ("given", policy)):
        model = apply_faast(tiny_model("llama"), FaastConfig(output=ResidualOutput(policy=p), learn_dtype="model"))
        model.learn(x)
        layers[name] = model.output_memory_layer
        assert model.faast_config.output.key_layers == [4 // p.auto_key_block_divisor]
    given, shipped = layers["given"], layers["shipped"]
    n = float(given.memory.count)  # 58 positions, d = 32: above 1 per dimension, below the shipped ramp's
    assert given.chosen_step() == pytest.approx(0.07) and given.default_step == 0.07
    assert shipped.chosen_step() == pytest.approx(0.03 * n / (DEFAULT_POLICY.default_step_per_dim * 32))
    assert given.last_tuning["token_bias_step"] == pytest.approx(0.3) and given.last_tuning["bias_step"] == 0.5
    counts, mass = given.target_count.targets.double(), given.token_mass.probability.double()
    want = 0.3 * torch.log((counts + 1.0) / (mass + 1.0))
    torch.testing.assert_close(given.folded_token_bias(torch.device("cpu"), torch.float64), want)


def test_a_learned_layer_given_another_policy_solves_again_with_it():
    model = apply_faast(tiny_model("llama"), FaastConfig(output=ResidualOutput(step=0.5), learn_dtype="model"))
    model.learn(ids(batch=2, seq=30))
    layer = model.output_memory_layer
    first = layer.folded_token_bias(torch.device("cpu"), torch.float64)
    layer.policy = OutputPolicy(token_prior=3.0, gap_multiple=0)
    assert layer.held_out.policy == layer.policy  # the tail reads it too
    again = layer.folded_token_bias(torch.device("cpu"), torch.float64)
    assert not torch.equal(first, again)
    with pytest.raises(ValueError, match="policy: expected an OutputPolicy"):
        layer.policy = {"gap_multiple": 0}
    # Another named memory, made afterwards, is read and learned under the layer's policy too.
    model.learn(ids(batch=2, seq=30, seed=4), memory="other")
    model.set_memory("other")
    assert model.output_memory_layer.held_out.policy == layer.policy == OutputPolicy(token_prior=3.0, gap_multiple=0)


def test_a_learned_layer_given_other_bias_steps_solves_again_with_them():
    model = apply_faast(tiny_model("llama"), FaastConfig(output=ResidualOutput(step=0.5), learn_dtype="model"))
    model.learn(ids(batch=2, seq=30))
    layer, cpu = model.output_memory_layer, torch.device("cpu")
    tokens, bias = layer.folded_token_bias(cpu, torch.float64), layer.folded_bias(cpu, torch.float64)
    assert tokens is not None and bias is not None
    layer.token_bias = 0.6  # twice γ: twice the token bias, the step and M unchanged
    torch.testing.assert_close(layer.folded_token_bias(cpu, torch.float64), 2 * tokens)
    layer.bias = 0
    assert layer.folded_bias(cpu, torch.float64) is None and layer.last_tuning["bias_step"] == 0.0
    layer.token_bias = 0
    assert layer.folded_token_bias(cpu, torch.float64) is None
    for name in ("bias", "token_bias"):
        with pytest.raises(ValueError, match=f"{name}: expected a number >= 0"):
            setattr(layer, name, -1.0)
    assert layer.bias == 0 and layer.token_bias == 0  # a refused value leaves the layer as it was


def test_the_layers_head_pools_as_its_policys_dense_share_says():
    # The tiny model's block keeps 41 of its 61 columns above p = 0.02 (67%): past the shipped share (0.6) p·H is
    # formed in full, as with the exact threshold, to the bit; a policy whose share is 1 pools the 20 others, so the
    # learned rows move.
    x = ids(batch=2, seq=30)
    cross = {}
    for name, pool, policy in (("exact", 0.0, OutputPolicy()), ("shipped", 0.02, OutputPolicy()),
                               ("pooled", 0.02, OutputPolicy(pool_dense_share=1.0))):  # fmt: skip
        output = ResidualOutput(head_pool_below=pool, head_dtype="float32", policy=policy)
        model = apply_faast(tiny_model("llama"), FaastConfig(output=output, learn_dtype="model"))
        model.learn(x)
        cross[name] = model.output_memory_layer.memory.cross
    assert torch.equal(cross["shipped"], cross["exact"])
    assert not torch.allclose(cross["pooled"], cross["exact"], rtol=1e-4, atol=0)
