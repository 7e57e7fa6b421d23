"""FaastConfig's groups (docs/design.md §6): round trips of every kind of configuration, the errors that name the
field (type mistakes, a field of another variant, the flat keywords of version 1), and configuration version 1 (the
flat files of faast 0.1) loading as the grouped configuration it meant, from a JSON file and from an adapter file."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from faast.hf import (
    EmbeddingOutput,
    FaastConfig,
    MiddleLayers,
    Regulariser,
    ResidualOutput,
    apply_faast,
    from_pretrained,
)
from faast.hf.config import CONFIG_VERSION
from faast.hf.config_legacy import FLAT_ONLY, V1_DEFAULTS
from faast.persist import read_verified, write_atomic
from hf_models import tiny_model
from legacy_configs import V1_APPLIED, V1_DEFAULT, V1_OLDEST

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "python" / "faast" / "data" / "smollm2-readout"

SPREAD = {
    "default": FaastConfig(),
    "middle": FaastConfig(middle=MiddleLayers(num_layers=3, dropout=0.2)),
    "paper rule": FaastConfig(middle=MiddleLayers()),
    "explicit blocks": FaastConfig(middle=MiddleLayers(layers=[4, 1], scorer=False)),
    "embedding": FaastConfig(output=EmbeddingOutput(mix=0.5), middle=MiddleLayers(num_layers=2)),
    "no output": FaastConfig(output=None, middle=MiddleLayers(layers=[0])),
    "alpha auto": FaastConfig(regulariser=Regulariser(alpha="auto")),
    "ridge auto": FaastConfig(regulariser=Regulariser(ridge="auto")),
    "ridge": FaastConfig(regulariser=Regulariser(alpha=0, ridge=0.25)),
    "residual fields": FaastConfig(
        output=ResidualOutput(
            space="logit",
            step=0.3,
            weight="auto",
            damping=0.5,
            alpha=0.7,
            tune_tokens=0,
            default_step=0.02,
            default_weight=0.4,
            key_layers=(3, 1),
            head_dtype="float32",
            bias=0.25,
            head_pool_below=3e-4,
        ),
        learn_dtype="bfloat16",
        compute_dtype="float32",
    ),  # fmt: skip
    "modules": FaastConfig(output=None, target_modules={"lm_head", "classifier"}, module_fit="replace"),
    "modules regex": FaastConfig(target_modules=r".*\.dense", regulariser=Regulariser(ridge=1)),
    "applied": FaastConfig(model_type="llama", hidden_size=32, num_hidden_layers=4, base_model="tiny"),
}


# ---------------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", list(SPREAD))
def test_every_configuration_survives_its_dict_its_json_and_its_file(name, tmp_path):
    config = SPREAD[name]
    data = config.to_dict()
    assert FaastConfig.from_dict(data) == config
    assert FaastConfig.from_dict(json.loads(json.dumps(data))) == config  # JSON-ready: lists, no tuples or sets
    assert FaastConfig.from_json(config.to_json()) == config
    config.save(tmp_path / "c.json")
    assert FaastConfig.load(tmp_path / "c.json") == config
    assert json.loads((tmp_path / "c.json").read_text())["config_version"] == CONFIG_VERSION == 2
    # The output's variant is named; no group is flattened.
    assert (
        data["output"] is None
        or data["output"]["kind"] == {ResidualOutput: "residual", EmbeddingOutput: "embedding"}[type(config.output)]
    )
    assert data["middle"] == (None if config.middle is None else dataclasses.asdict(config.middle))
    assert data["regulariser"] == dataclasses.asdict(config.regulariser)


def test_an_empty_dict_is_the_default_and_missing_fields_take_todays_defaults():
    assert FaastConfig.from_dict({}) == FaastConfig()
    assert FaastConfig.from_dict({"middle": {}}) == FaastConfig(middle=MiddleLayers())
    assert FaastConfig.from_dict({"output": {"kind": "embedding"}}).output == EmbeddingOutput(mix=0.9)
    # Version 2 applies none of version 1's defaults for missing fields.
    residual = FaastConfig.from_dict({"output": {"kind": "residual"}})
    assert residual.output == ResidualOutput() and residual.output.space == "probability"
    assert residual.output.key_layers == "auto" and residual.learn_dtype == "auto"
    assert FaastConfig.from_dict({"output": None}).output is None


def test_the_defaults_are_those_of_the_flat_configuration():
    # The previous release's FaastConfig() loads as today's: no default moved in the regrouping.
    assert len(V1_DEFAULT) == 28 and set(V1_DEFAULT) == set(V1_DEFAULTS)  # the converter knows every flat field
    assert FaastConfig.from_dict(V1_DEFAULT, version=1) == FaastConfig(faast_version="0.1.0")
    assert FaastConfig().middle is None and FaastConfig().output == ResidualOutput()
    assert FaastConfig().block_indices(12, 124_000_000) == []
    assert FaastConfig().lm_layers_requested() and not FaastConfig(output=None).lm_layers_requested()


# ---------------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: Regulariser(alpha=True), "Regulariser.alpha"),
        (lambda: Regulariser(alpha=-1), "Regulariser.alpha"),
        (lambda: Regulariser(alpha=math.nan), "Regulariser.alpha"),
        (lambda: Regulariser(ridge=True), "Regulariser.ridge"),
        (lambda: Regulariser(ridge="gcv"), "Regulariser.ridge"),
        (
            lambda: Regulariser(alpha="auto", ridge=0.1),
            "Regulariser.ridge: a ridge .* does not combine with alpha='auto'",
        ),
        (lambda: MiddleLayers(num_layers=True), "MiddleLayers.num_layers"),
        (lambda: MiddleLayers(num_layers=2.0), "MiddleLayers.num_layers"),
        (lambda: MiddleLayers(layers=[0, True]), "MiddleLayers.layers"),
        (lambda: MiddleLayers(layers=[1, "2"]), "MiddleLayers.layers"),
        (lambda: MiddleLayers(layers=[-1]), "MiddleLayers.layers"),
        (lambda: MiddleLayers(layers=[1, 1]), "MiddleLayers.layers: block indices must be distinct"),
        (lambda: MiddleLayers(layers=3), "MiddleLayers.layers"),
        (lambda: MiddleLayers(scorer=1), "MiddleLayers.scorer"),
        (lambda: MiddleLayers(dropout=True), "MiddleLayers.dropout"),
        (lambda: MiddleLayers(dropout=1.0), "MiddleLayers.dropout"),
        (lambda: ResidualOutput(tune_tokens=1.5), "ResidualOutput.tune_tokens"),
        (lambda: ResidualOutput(tune_tokens=False), "ResidualOutput.tune_tokens"),
        (lambda: ResidualOutput(step="fast"), "ResidualOutput.step"),
        (lambda: ResidualOutput(step=math.inf), "ResidualOutput.step"),
        (lambda: ResidualOutput(weight=1.5), "ResidualOutput.weight"),
        (lambda: ResidualOutput(weight=True), "ResidualOutput.weight"),
        (lambda: ResidualOutput(damping=0), "ResidualOutput.damping"),
        (lambda: ResidualOutput(alpha=True), "ResidualOutput.alpha"),
        (lambda: ResidualOutput(default_step="auto"), "ResidualOutput.default_step"),
        (lambda: ResidualOutput(default_weight=2), "ResidualOutput.default_weight"),
        (lambda: ResidualOutput(key_layers=[1, True]), "ResidualOutput.key_layers"),
        (lambda: ResidualOutput(key_layers="early"), "ResidualOutput.key_layers"),
        (lambda: ResidualOutput(space="logits"), "ResidualOutput.space: expected 'probability' or 'logit'"),
        (lambda: ResidualOutput(head_dtype="float16"), "ResidualOutput.head_dtype"),
        (lambda: ResidualOutput(bias=-0.1), "ResidualOutput.bias"),
        (lambda: ResidualOutput(bias=math.nan), "ResidualOutput.bias"),
        (lambda: ResidualOutput(head_pool_below=-1e-4), "ResidualOutput.head_pool_below"),
        (lambda: ResidualOutput(head_pool_below=1.5), "ResidualOutput.head_pool_below"),
        (lambda: ResidualOutput(head_pool_below="exact"), "ResidualOutput.head_pool_below"),
        (lambda: ResidualOutput(head_pool_below=math.nan), "ResidualOutput.head_pool_below"),
        (lambda: EmbeddingOutput(mix=True), "EmbeddingOutput.mix"),
        (lambda: EmbeddingOutput(mix=1.5), "EmbeddingOutput.mix"),
        (lambda: FaastConfig(output="embedding"), "output: expected a ResidualOutput, an EmbeddingOutput or None"),
        (lambda: FaastConfig(output=EmbeddingOutput), "output"),
        (lambda: FaastConfig(middle=True), "middle: expected a MiddleLayers or None"),
        (lambda: FaastConfig(regulariser=None), "regulariser: expected a Regulariser"),
        (lambda: FaastConfig(learn_dtype=True), "learn_dtype"),
        (lambda: FaastConfig(compute_dtype="float16"), "compute_dtype"),
        (lambda: FaastConfig(module_fit="add"), "module_fit"),
        (lambda: FaastConfig(hidden_size=True), "hidden_size"),
        (lambda: FaastConfig(num_hidden_layers=0), "num_hidden_layers"),
        (lambda: FaastConfig(model_type=3), "model_type"),
        (lambda: FaastConfig(faast_version=None), "faast_version"),
        (lambda: FaastConfig.from_dict({"middle": {"num_layers": True}}), "MiddleLayers.num_layers"),
        (lambda: FaastConfig.from_dict({"regulariser": None}), "regulariser"),
    ],
)
def test_a_wrong_type_or_value_is_refused_naming_the_field(build, field):
    with pytest.raises(ValueError, match=field) as err:
        build()
    assert str(err.value).startswith(field.split(":")[0] + ":")  # the message opens with the argument's name


def test_no_middle_layers_is_said_with_middle_none():
    for build in (lambda: MiddleLayers(num_layers=0), lambda: MiddleLayers(layers=[])):
        with pytest.raises(ValueError, match=r"no middle layers: use FaastConfig\(middle=None\)"):
            build()


def test_a_field_of_the_other_variant_is_refused_naming_the_variant():
    with pytest.raises(ValueError, match=r"output\.step: does not apply to kind='embedding' \(its fields: mix\)"):
        FaastConfig.from_dict({"output": {"kind": "embedding", "step": 0.3}})
    with pytest.raises(ValueError, match=r"output\.mix: does not apply to kind='residual' \(its fields: space, "):
        FaastConfig.from_dict({"output": {"kind": "residual", "mix": 0.9}})
    with pytest.raises(ValueError, match=r"output\.kind: expected 'residual' or 'embedding', got 'logit'"):
        FaastConfig.from_dict({"output": {"kind": "logit"}})
    with pytest.raises(ValueError, match=r"output: expected None or a dict with a 'kind'"):
        FaastConfig.from_dict({"output": {"mix": 0.9}})
    with pytest.raises(ValueError, match=r"middle: unknown fields \['alpha'\]"):
        FaastConfig.from_dict({"middle": {"alpha": 1.0}})
    # The constructors: a keyword of another group says where it lives.
    with pytest.raises(
        TypeError, match="EmbeddingOutput: step does not apply to EmbeddingOutput .* of ResidualOutput"
    ):
        EmbeddingOutput(step=0.3)
    with pytest.raises(TypeError, match="ResidualOutput: mix does not apply .* a field of EmbeddingOutput"):
        ResidualOutput(mix=0.5)
    with pytest.raises(TypeError, match="MiddleLayers: alpha does not apply .* Regulariser"):
        MiddleLayers(alpha=0.5)
    with pytest.raises(TypeError, match="Regulariser: colour does not apply to Regulariser"):
        Regulariser(colour=1)


@pytest.mark.parametrize("name", FLAT_ONLY)
def test_every_flat_keyword_of_version_1_says_where_it_lives_now(name):
    value = V1_DEFAULT[name]
    with pytest.raises(TypeError, match=rf"{name}: now .*FaastConfig\((middle|output|regulariser)="):
        FaastConfig(**{name: value})
    with pytest.raises(TypeError, match=rf"{name}: now "):  # replace() (from_pretrained's overrides) too
        dataclasses.replace(FaastConfig(), **{name: value})


def test_the_flat_keyword_errors_spell_out_the_new_call():
    cases = {
        "num_layers": (2, "FaastConfig(middle=MiddleLayers(num_layers=2))"),
        "layers": ([1, 2], "FaastConfig(middle=MiddleLayers(layers=[1, 2]))"),
        "alpha": (0.8, "FaastConfig(regulariser=Regulariser(alpha=0.8))"),
        "output_step": (0.3, "FaastConfig(output=ResidualOutput(step=0.3))"),
        "output_mix": (0.5, "FaastConfig(output=EmbeddingOutput(mix=0.5))"),
        "output_layer": (False, "FaastConfig(output=None)"),
        "output_target": ("embedding", "the output's class: FaastConfig(output=ResidualOutput(...)) or"),
    }
    for name, (value, now) in cases.items():
        with pytest.raises(TypeError) as err:
            FaastConfig(**{name: value})
        assert f"{name}: now {now}" in str(err.value), name
    with pytest.raises(TypeError, match="num_layers: now .*; alpha: now "):  # every one named at once
        FaastConfig(num_layers=2, alpha=0.5)


def test_unknown_or_flat_keys_in_a_dict_and_wrong_versions_are_refused():
    with pytest.raises(ValueError, match=r"unknown fields \['colour'\]"):
        FaastConfig.from_dict({"colour": 1})
    with pytest.raises(ValueError, match=r"unknown fields \['num_layers'\].*pass version=1"):
        FaastConfig.from_dict({"num_layers": 2})
    with pytest.raises(ValueError, match=r"config_version 1\): unknown fields \['middle'\]"):
        FaastConfig.from_dict({"middle": None}, version=1)
    with pytest.raises(ValueError, match="version: configuration version 3 was written by a newer faast"):
        FaastConfig.from_json(json.dumps({"config_version": 3}))
    for bad in (0, True, "2"):
        with pytest.raises(ValueError, match="version: expected a configuration version 1 to 2"):
            FaastConfig.from_dict({}, version=bad)
    with pytest.raises(ValueError, match="config_version than version=1"):
        FaastConfig.from_dict({"config_version": 2}, version=1)
    assert FaastConfig.from_dict({"config_version": 2}) == FaastConfig()
    with pytest.raises(TypeError, match="data: expected a dict, got list"):
        FaastConfig.from_dict([])


# ---------------------------------------------------------------------------------------------------- version 1


def test_a_version_1_file_with_every_field_loads_as_the_grouped_configuration(tmp_path):
    expected = FaastConfig(
        output=ResidualOutput(space="logit", step=0.3, weight="auto", damping=0.5, alpha=0.8, tune_tokens=512,
                              default_step=0.02, default_weight=0.4, key_layers=[0], head_dtype="float32"),
        middle=MiddleLayers(num_layers=2, layers=[1, 2], scorer=False, dropout=0.2),
        regulariser=Regulariser(alpha=0.5, ridge=0.01), learn_dtype="model", compute_dtype="float32",
        target_modules=["lm_head"], module_fit="replace", model_type="llama", hidden_size=32, num_hidden_layers=4,
        base_model="tiny", faast_version="0.1.0",
    )  # fmt: skip
    assert FaastConfig.from_dict(V1_APPLIED, version=1) == expected
    (tmp_path / "faast_config.json").write_text(json.dumps(V1_APPLIED, indent=2, sort_keys=True))
    assert FaastConfig.load(tmp_path / "faast_config.json") == expected  # no config_version: version 1
    # The other shapes of version 1: no output layer, blocks given beside the default num_layers=0, the paper rule.
    flat = {"output_layer": False, "layers": [3], "num_layers": 0}
    grouped = FaastConfig(output=None, middle=MiddleLayers(layers=[3]), learn_dtype="model")  # learn_dtype: missing
    assert FaastConfig.from_dict(flat, version=1) == grouped
    assert FaastConfig.from_dict({"num_layers": None}, version=1).middle == MiddleLayers()
    assert FaastConfig.from_dict({"layers": [], "num_layers": 2}, version=1).middle is None  # recorded: none
    embedding = FaastConfig.from_dict({"output_target": "embedding", "output_mix": 0.7}, version=1)
    assert embedding.output == EmbeddingOutput(mix=0.7)
    with pytest.raises(ValueError, match="output_target: expected 'residual' or 'embedding', got 'logits'"):
        FaastConfig.from_dict({"output_target": "logits"}, version=1)
    with pytest.raises(ValueError, match="MiddleLayers.num_layers"):
        FaastConfig.from_dict({"num_layers": -1}, version=1)


def test_an_older_version_1_file_takes_the_defaults_of_its_time():
    # Written before the residual output layer, probability space, wider keys and bfloat16 learning: the paper's
    # output layer, read in logit space with keys h̃ alone had it been residual, learned in the model's dtype.
    expected = FaastConfig(
        output=EmbeddingOutput(mix=0.9), middle=MiddleLayers(num_layers=6, layers=[4, 8, 12, 17, 21, 25]),
        learn_dtype="model", model_type="llama", hidden_size=576, num_hidden_layers=30,
        base_model="SmolLM2-135M-Instruct", faast_version="0.1.0",
    )  # fmt: skip
    assert FaastConfig.from_dict(V1_OLDEST, version=1) == expected
    residual = FaastConfig.from_dict({**V1_OLDEST, "output_target": "residual"}, version=1).output
    assert residual == ResidualOutput(space="logit", key_layers=[])
    # The shipped readout's configuration file: version 1, residual output, no output_space / output_key_layers /
    # learn_dtype fields.
    shipped = FaastConfig.load(SHIPPED / "faast_config.json")
    assert shipped.output == ResidualOutput(space="logit", default_step=0.03, key_layers=[])
    assert shipped.middle == MiddleLayers(num_layers=6, layers=[4, 8, 12, 17, 21, 25])
    assert shipped.regulariser == Regulariser(alpha=0.4) and shipped.learn_dtype == "model"
    # And its adapter file: format 1, whose embedded configuration has no output_target (the paper's layer).
    _, metadata = read_verified(SHIPPED / "faast_adapter.safetensors")
    assert metadata["format_version"] == "1" and "config_version" not in metadata
    embedded = FaastConfig.from_json(metadata["config"], version=1)
    assert embedded.output == EmbeddingOutput() and embedded.middle == shipped.middle


def _flat_of_this_model():
    # What the previous release recorded for FaastConfig(num_layers=2) on tiny_model("llama") (4 blocks, d = 32).
    return {**V1_APPLIED, "target_modules": None, "module_fit": "residual"}


def test_a_format_1_adapter_folder_loads_and_a_new_one_records_the_config_version(tmp_path):
    flat = _flat_of_this_model()
    model = apply_faast(tiny_model("llama"), FaastConfig.from_dict(flat, version=1))
    resolved = dataclasses.replace(
        FaastConfig.from_dict(flat, version=1), faast_version=model.faast_config.faast_version
    )
    assert model.faast_config == resolved  # recorded resolved already: applying it changes nothing
    g = torch.Generator().manual_seed(3)
    tensors = {}
    for key, layer in model.memory_layers.items():
        with torch.no_grad():
            layer.readout.weight.copy_(torch.randn(layer.readout.weight.shape, generator=g) * 0.2)
        tensors[f"layers.{key}.readout.weight"] = layer.readout.weight.detach().clone()
    # The folder as faast 0.1 wrote it: a flat faast_config.json, a format-1 adapter whose metadata embeds the flat
    # configuration (an older one, without the output fields) and no config_version.
    old = tmp_path / "old"
    old.mkdir()
    (old / "faast_config.json").write_text(json.dumps(flat, indent=2, sort_keys=True))
    embedded = {k: v for k, v in flat.items() if not k.startswith("output_") or k in ("output_layer", "output_mix")}
    metadata = {"format": "faast.hf.adapter", "format_version": "1", "faast_version": "0.1.0",
                "config": json.dumps(embedded)}  # fmt: skip
    write_atomic(old / "faast_adapter.safetensors", tensors, metadata)
    loaded = from_pretrained(tiny_model("llama"), old)
    assert loaded.faast_config == model.faast_config
    for key, layer in loaded.memory_layers.items():
        assert torch.equal(layer.readout.weight, tensors[f"layers.{key}.readout.weight"])
    # A format-1 adapter saved for other blocks is refused, naming what differs.
    other = {**embedded, "layers": [1, 3]}
    write_atomic(old / "faast_adapter.safetensors", tensors, {**metadata, "config": json.dumps(other)})
    with pytest.raises(ValueError, match=r"saved for middle.layers=\[1, 3\], this model has \[1, 2\]"):
        from_pretrained(tiny_model("llama"), old)

    # save_pretrained now: adapter format 2 recording config_version 2, in its metadata and in both JSON copies.
    model.save_pretrained(tmp_path / "new")
    _, metadata = read_verified(tmp_path / "new" / "faast_adapter.safetensors")
    assert metadata["format_version"] == "2" and metadata["config_version"] == "2"
    assert json.loads(metadata["config"])["config_version"] == 2
    assert json.loads((tmp_path / "new" / "faast_config.json").read_text())["config_version"] == 2
    assert from_pretrained(tiny_model("llama"), tmp_path / "new").faast_config == model.faast_config


def test_from_pretrained_overrides_are_groups_and_flat_ones_are_refused(tmp_path):
    model = apply_faast(tiny_model("llama"), FaastConfig(middle=MiddleLayers(num_layers=2)))
    model.save_pretrained(tmp_path, memories=False)  # the readouts only: another output layer may read them
    paper = from_pretrained(tiny_model("llama"), tmp_path, output=EmbeddingOutput(mix=0.5))
    assert paper.output_memory_layer.mix == 0.5 and paper.faast_config.middle == model.faast_config.middle
    tuned = from_pretrained(tiny_model("llama"), tmp_path, regulariser=Regulariser(alpha=0.8))
    assert all(layer.memory.alpha == 0.8 for layer in tuned.memory_layers.values())
    with pytest.raises(TypeError, match=r"output_target: now the output's class"):
        from_pretrained(tiny_model("llama"), tmp_path, output_target="embedding")
    with pytest.raises(ValueError, match=r"saved for output layer=True, this model has False"):
        from_pretrained(tiny_model("llama"), tmp_path, output=None)


def test_apply_faast_records_the_resolved_configuration_and_leaves_the_callers_alone():
    config = FaastConfig(middle=MiddleLayers(num_layers=2))
    model = apply_faast(tiny_model("llama"), config)
    assert model.faast_config.middle == MiddleLayers(num_layers=2, layers=[1, 2])  # int((i+1)·4/3)
    assert model.faast_config.output.key_layers == [0]  # 'auto' on 4 blocks: 4 // 7
    assert config.middle.layers is None and config.output.key_layers == "auto"
    config.regulariser.alpha = 0.3  # the caller's groups are not the model's
    assert model.faast_config.regulariser.alpha == 1.0
    assert apply_faast(tiny_model("llama"), FaastConfig()).faast_config.middle is None
