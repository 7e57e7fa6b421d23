"""FaastConfig(target_modules=...): memories on any module (docs/design.md §6.6), on tiny models built in-process: a
BERT classifier's head with a new label set, a causal LM's lm_head, module matching, disabling, save/load."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from faast.hf import FaastConfig, FaastModel, MiddleLayers, Regulariser, apply_faast, from_pretrained
from faast.hf.modules import FaastModuleModel, match_target_modules
from hf_models import VOCAB, tiny_model
from legacy_configs import V1_DEFAULT
from tolerances import TRUTH_REL_W, assert_close, rel

transformers = pytest.importorskip("transformers")

F64 = torch.float64
NUM_LABELS = 3


def tiny_classifier(seed: int = 0) -> torch.nn.Module:
    """A BertForSequenceClassification with a new, untrained 3-label head. initializer_range 0.2: at BERT's 0.02 a
    random encoder's pooled outputs are one direction plus 1e-3 noise (a trained encoder's are not)."""
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, num_labels=NUM_LABELS, initializer_range=0.2,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config).eval()


def separable(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of the class's token (5 + label) with 30% of positions a shared noise token, after [CLS] (1)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, NUM_LABELS, (n,), generator=g)
    noise = torch.rand(n, 24, generator=g) < 0.3
    ids = torch.where(noise, 20, 5 + labels[:, None])
    ids[:, 0] = 1
    return ids, labels


def module_inputs(model: torch.nn.Module, name: str, **inputs: object) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) of module `name` in a forward pass of `model`, seen by a hook of the test's own."""
    seen = []
    handle = model.get_submodule(name).register_forward_hook(lambda m, a, o: seen.append((a[0], o)))
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        handle.remove()
    assert len(seen) == 1
    return seen[0]


def truncated_reference(keys: torch.Tensor, values: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """W = pinv_eps(K) V in float64, eps = N^-alpha (FastWeights' default filter); asserts the cut is well posed."""
    k, v = keys.to(F64), values.to(F64)
    eps = k.shape[0] ** -alpha
    s = torch.linalg.svdvals(k)
    assert not bool(((s / s[0] - eps).abs() < 0.01 * eps).any()), "a singular value sits on the cut"
    return torch.linalg.pinv(k, atol=0.0, rtol=eps) @ v


# ---------------------------------------------------------------------------------------------------- configuration


def test_target_modules_validation_and_round_trip():
    assert FaastConfig().target_modules is None and FaastConfig().module_fit == "residual"
    config = FaastConfig(target_modules=("lm_head", "c_proj"), module_fit="replace")
    assert config.target_modules == ["lm_head", "c_proj"]
    assert FaastConfig.from_json(config.to_json()) == config
    assert FaastConfig.from_json(FaastConfig(target_modules=r".*\.dense").to_json()).target_modules == r".*\.dense"
    # A configuration saved before the fields existed loads with no module memories.
    old = {k: v for k, v in V1_DEFAULT.items() if k not in ("target_modules", "module_fit")}
    assert FaastConfig.from_dict(old, version=1).target_modules is None
    assert FaastConfig.from_dict(old, version=1).module_fit == "residual"
    with pytest.raises(ValueError, match="target_modules: .* not a valid regular expression"):
        FaastConfig(target_modules="(")
    with pytest.raises(ValueError, match="target_modules: expected None, a regular expression or a non-empty list"):
        FaastConfig(target_modules=[])
    with pytest.raises(ValueError, match="target_modules: expected"):
        FaastConfig(target_modules=["lm_head", 3])
    with pytest.raises(ValueError, match="target_modules: names must be distinct"):
        FaastConfig(target_modules=["a", "a"])
    with pytest.raises(ValueError, match="module_fit: expected 'residual' or 'replace'"):
        FaastConfig(module_fit="add")


def test_matching_follows_peft_rules():
    model = tiny_classifier()
    dense = match_target_modules(model, ["dense"])
    # A list entry matches the whole name or a suffix after a dot: every '...dense', not 'dense' inside a name.
    assert "bert.pooler.dense" in dense and "bert.encoder.layer.0.attention.output.dense" in dense
    assert all(n == "dense" or n.endswith(".dense") for n in dense)
    assert match_target_modules(model, ["pooler.dense", "classifier"]) == ["bert.pooler.dense", "classifier"]
    # A string is a regular expression matching the whole name.
    assert match_target_modules(model, r"bert\.encoder\.layer\.\d+\.output\.dense") == [
        "bert.encoder.layer.0.output.dense",
        "bert.encoder.layer.1.output.dense",
    ]
    assert match_target_modules(model, "classifier") == ["classifier"]
    with pytest.raises(ValueError, match="target_modules: 'classif' matches no module"):
        match_target_modules(model, "classif")
    with pytest.raises(ValueError, match="target_modules: \\['nothing'\\] matches no module"):
        apply_faast(model, FaastConfig(target_modules=["nothing"]))
    wrapped = apply_faast(model, FaastConfig(target_modules=["classifier"]))
    with pytest.raises(ValueError, match="model: FAAST is already applied"):
        apply_faast(wrapped, FaastConfig(target_modules=["classifier"]))


# ---------------------------------------------------------------------------------------------------- a classifier


@pytest.mark.parametrize("fit", ["residual", "replace"])
def test_classifier_head_learns_a_new_label_set(fit):
    base = tiny_classifier()
    ids, labels = separable(96, seed=0)
    test_ids, test_labels = separable(300, seed=1)
    with torch.no_grad():
        base_logits = base(input_ids=test_ids).logits
    keys, head_out = module_inputs(base, "classifier", input_ids=ids)

    model = apply_faast(base, FaastConfig(target_modules=["classifier"], module_fit=fit))
    assert isinstance(model, FaastModuleModel)
    assert model.faast_config.model_type == "bert" and model.faast_config.output is None
    assert all(not p.requires_grad for p in base.parameters())
    with torch.no_grad():  # an empty memory: the base model's logits, bit for bit
        assert torch.equal(model(input_ids=test_ids).logits, base_logits)
    assert model.learn(input_ids=ids, labels=labels) == 96

    one_hot = torch.nn.functional.one_hot(labels, NUM_LABELS).to(F64)
    values = one_hot - head_out.to(F64) if fit == "residual" else one_hot
    memory = model.module_memories.entry("classifier").memory
    assert rel(memory.weights, truncated_reference(keys, values)) < TRUTH_REL_W

    before = float((base_logits.argmax(-1) == test_labels).float().mean())
    with torch.no_grad():
        logits = model(input_ids=test_ids).logits
    accuracy = float((logits.argmax(-1) == test_labels).float().mean())
    assert before < 0.6 and accuracy > 0.98, (before, accuracy)

    test_keys, _ = module_inputs(base, "classifier", input_ids=test_ids)
    w = truncated_reference(keys, values)
    head = torch.nn.functional.linear(test_keys, base.classifier.weight, base.classifier.bias)  # the head, no hooks
    expected = test_keys.to(F64) @ w + (head.to(F64) if fit == "residual" else 0)
    assert_close(logits, expected, torch.float32)
    with model.disable_faast(), torch.no_grad():
        assert torch.equal(model(input_ids=test_ids).logits, base_logits)


def test_learn_module_from_inputs_equals_learning_in_the_forward_pass():
    ids, labels = separable(40, seed=2)
    # float64 models: the two routes compute the pooled states in separate forward passes, which a float32 BLAS need
    # not round identically (on an Intel Xeon's MKL they differed at 1e-8), hiding the statistics' own agreement.
    a = apply_faast(tiny_classifier().double(), FaastConfig(target_modules=["classifier"]))
    a.learn(input_ids=ids, labels=labels)
    b = apply_faast(tiny_classifier().double(), FaastConfig(target_modules=["classifier"]))
    pooled, _ = module_inputs(b.base_model, "classifier", input_ids=ids)
    # Float targets (one-hot) and class ids are the same rows; -100 rows and masked rows are not learned.
    assert b.learn_module(pooled[:30], targets=torch.nn.functional.one_hot(labels[:30], NUM_LABELS).float()) == 30
    ignored = torch.cat([labels[30:35], torch.full((5,), -100)])
    assert b.learn_module(pooled[30:], targets=ignored, name="classifier") == 5
    assert b.learn_module(pooled[35:], targets=labels[35:], mask=torch.ones(5, dtype=torch.bool)) == 5
    for name in ("gram", "cross", "count"):
        sa = getattr(a.module_memories.entry().memory, name)
        sb = getattr(b.module_memories.entry().memory, name)
        assert float((sa - sb).norm()) <= 1e-12 * float(sa.norm()), name


def test_module_memory_errors_name_the_argument():
    model = apply_faast(tiny_classifier(), FaastConfig(target_modules=["classifier", "pooler.dense"]))
    ids, labels = separable(4, seed=3)
    with pytest.raises(ValueError, match="name: 2 target modules"):
        model.learn_module(torch.randn(4, 32), targets=labels)
    with pytest.raises(ValueError, match="name: expected one of the target modules"):
        model.learn_module(torch.randn(4, 32), targets=labels, name="pooler")
    with pytest.raises(ValueError, match="class ids must lie in \\[0, 3\\)"):
        model.learn_module(torch.randn(4, 32), targets=torch.tensor([0, 1, 2, 3]), name="classifier")
    with pytest.raises(ValueError, match="targets\\['classifier'\\]: expected float"):
        model.learn_module(torch.randn(4, 32), targets=torch.randn(4, 5), name="classifier")
    with pytest.raises(TypeError, match="targets: expected a tensor or a mapping"):
        model.learn(input_ids=ids, targets=[0, 1])
    with pytest.raises(ValueError, match="targets: nothing to learn against"):
        model.learn(input_ids=ids)
    # A mapping with both modules: the pooler's dense layer (rows [B, d]) and the head.
    rows = model.learn(input_ids=ids, targets={"classifier": labels, "bert.pooler.dense": torch.randn(4, 32)})
    assert rows == 8


def test_a_module_of_unknown_width_is_sized_by_its_first_learn_and_by_a_load(tmp_path):
    ids, _ = separable(12, seed=4)
    target = torch.randn(12, 32)
    model = apply_faast(tiny_classifier(), FaastConfig(target_modules=["pooler.activation"]))  # nn.Tanh: no widths
    assert model.module_memories.entry().memory is None
    model.learn(input_ids=ids, targets=target)
    memory = model.module_memories.entry().memory
    assert (memory.dim_key, memory.dim_value) == (32, 32) and float(memory.count) == 12
    path = model.save_fast_weights(tmp_path / "fw.safetensors")
    fresh = apply_faast(tiny_classifier(), FaastConfig(target_modules=["pooler.activation"])).load_fast_weights(path)
    for name, t in memory.state_dict().items():
        assert torch.equal(fresh.module_memories.entry().memory.state_dict()[name], t), name


def test_module_model_save_and_load_round_trip(tmp_path):
    ids, labels = separable(48, seed=5)
    model = apply_faast(
        tiny_classifier(), FaastConfig(regulariser=Regulariser(ridge=0.1), target_modules=["classifier"])
    )
    model.learn(input_ids=ids, labels=labels)
    model.save_pretrained(tmp_path / "adapter")
    path = model.save_fast_weights(tmp_path / "adapter" / "fast_weights.safetensors")
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:  # only what faast adds: the head memory's statistics
        assert all(k.startswith("module_memories.classifier.memory.") for k in f.keys())
        assert json.loads(f.metadata()["memories"]).keys() == {"module_memories.classifier.memory"}
    loaded = from_pretrained(tiny_classifier(), tmp_path / "adapter")
    assert isinstance(loaded, FaastModuleModel) and loaded.faast_config == model.faast_config
    # save_pretrained wrote what the memories learned: from_pretrained alone restores it.
    for name, t in model.module_memories.entry().memory.state_dict().items():
        assert torch.equal(loaded.module_memories.entry().memory.state_dict()[name], t), name
    model.save_pretrained(tmp_path / "adapter", memories=False)
    with pytest.raises(NotImplementedError, match="faast.hf.from_pretrained"):
        loaded.from_pretrained(tiny_classifier(), tmp_path / "adapter")
    loaded = from_pretrained(tiny_classifier(), tmp_path / "adapter")
    assert int(loaded.module_memories.entry().memory.count.sum()) == 0
    loaded.load_fast_weights(path)
    for name, t in model.module_memories.entry().memory.state_dict().items():
        assert torch.equal(loaded.module_memories.entry().memory.state_dict()[name], t), name
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    other = apply_faast(tiny_classifier(), FaastConfig(target_modules=["pooler.dense"]))
    with pytest.raises(ValueError, match="holds memories"):
        other.load_fast_weights(path)
    base = loaded.remove_faast()
    with torch.no_grad():
        assert torch.equal(base(input_ids=ids).logits, tiny_classifier()(input_ids=ids).logits)


# ---------------------------------------------------------------------------------------------------- an LM head


def lm_batch(seed: int = 0, batch: int = 3, seq: int = 17) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and the next-token targets of every position (-100 at the last: nothing follows it)."""
    ids = torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
    targets = torch.cat([ids[:, 1:], torch.full((batch, 1), -100)], dim=1)
    return ids, targets


@pytest.mark.parametrize(("kind", "ridge"), [("gpt2", None), ("llama", None), ("llama", 0.5)])
def test_lm_head_memory_fits_the_residual_of_the_users_targets(kind, ridge):
    base = tiny_model(kind)
    ids, targets = lm_batch()
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
    keys, head_out = module_inputs(base, "lm_head", input_ids=ids)
    model = apply_faast(
        base, FaastConfig(output=None, regulariser=Regulariser(ridge=ridge), target_modules=["lm_head"])
    )
    assert isinstance(model, FaastModel)
    assert model.learn_modules(input_ids=ids, targets=targets) == 3 * 16

    keep = targets != -100
    k = keys[keep].to(F64)
    v = torch.nn.functional.one_hot(targets[keep], VOCAB).to(F64) - head_out[keep].to(F64)
    if ridge is None:
        reference = truncated_reference(k, v)
    else:
        reference = torch.linalg.solve(k.mT @ k + ridge * torch.eye(k.shape[-1], dtype=F64), k.mT @ v)
    memory = model.module_memories.entry("lm_head").memory
    assert (memory.dim_key, memory.dim_value) == (32, VOCAB)
    assert rel(memory.weights, reference) < TRUTH_REL_W

    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert_close(logits, head_out.to(F64) + keys.to(F64) @ reference, torch.float32)
    assert not torch.equal(logits, base_logits)
    for which in ("all", "modules"):
        with model.disable_faast(which), torch.no_grad():
            assert torch.equal(model(input_ids=ids).logits, base_logits), which


def test_lm_head_memory_follows_the_cut_on_rank_deficient_keys():
    model = apply_faast(
        tiny_model("gpt2"), FaastConfig(output=None, regulariser=Regulariser(alpha=0.5), target_modules=["lm_head"])
    )
    g = torch.Generator().manual_seed(7)
    half = torch.randn(64, 16, generator=g)
    keys = torch.cat([half, half @ torch.randn(16, 16, generator=g)], dim=-1)  # rank 16 of 32
    targets = torch.randint(0, VOCAB, (64,), generator=g)
    model.learn_module(keys, targets=targets)
    with model.disable_faast(), torch.no_grad():
        head = model.base_model.lm_head(keys)
    values = torch.nn.functional.one_hot(targets, VOCAB).to(F64) - head.to(F64)
    memory = model.module_memories.entry().memory
    assert rel(memory.weights, truncated_reference(keys, values, alpha=0.5)) < TRUTH_REL_W
    s = torch.linalg.svdvals(keys.to(F64))
    kept = int((s > 64**-0.5 * s[0]).sum())
    assert int(memory.solve_info.rank) == kept <= 16


def test_learn_is_unchanged_by_module_memories_and_save_load_is_exact(tmp_path):
    ids, targets = lm_batch(seed=1)
    plain = apply_faast(tiny_model("gpt2"), FaastConfig(middle=MiddleLayers(layers=[1])))
    config = FaastConfig(middle=MiddleLayers(layers=[1]), target_modules=["h.1.mlp.c_proj", "lm_head"])
    model = apply_faast(tiny_model("gpt2"), config)
    assert model.module_memories.names == ["transformer.h.1.mlp.c_proj", "lm_head"]
    assert model.module_memories.entry("c_proj").memory.dim_key == 128  # GPT-2's Conv1D: nx -> nf
    model.learn_modules(input_ids=ids, targets={"c_proj": torch.randn(3, 17, 32), "lm_head": targets})
    # The LM layers learn from the base model's activations, whatever the module memories have learned.
    plain.learn(ids)
    model.learn(ids)
    assert torch.equal(plain.memory_bank.gram, model.memory_bank.gram)
    assert torch.equal(plain.output_memory_layer.memory.cross, model.output_memory_layer.memory.cross)

    path = model.save_fast_weights(tmp_path / "fw.safetensors")
    fresh = apply_faast(tiny_model("gpt2"), config).load_fast_weights(path)
    originals = dict(model.learned_state())
    for name, memory in fresh.learned_state():
        for key, t in memory.state_dict().items():
            assert torch.equal(t, originals[name].state_dict()[key]), (name, key)
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, model(input_ids=ids).logits)
    fresh.reset_fast_weights()
    assert float(fresh.module_memories.entry("lm_head").memory.count) == 0


def test_a_module_run_twice_in_one_pass_is_refused():
    model = apply_faast(tiny_model("gpt2"), FaastConfig(output=None, target_modules=["lm_head"]))
    ids, targets = lm_batch()

    def twice(**inputs):
        model.base_model(**inputs)
        return model.base_model(**inputs)

    with pytest.raises(ValueError, match="the module ran 2 times"):
        model.module_memories.learn_forward(lambda: twice(input_ids=ids), targets)
    assert float(model.module_memories.entry().memory.count) == 0


def _accepts(base: inspect.Signature, sub: inspect.Signature) -> list[str]:
    """What of `base`'s call contract `sub` breaks: a parameter missing, of another kind or default, or an extra
    parameter without a default (a call written against the base would fail)."""
    broken = []
    params = sub.parameters
    for name, p in base.parameters.items():
        q = params.get(name)
        if q is None and not (p.kind is p.VAR_KEYWORD and any(x.kind is x.VAR_KEYWORD for x in params.values())):
            broken.append(f"{name} missing")
        elif q is not None and (q.kind != p.kind or q.default != p.default):
            broken.append(f"{name}: {q} against {p}")
    extra = [
        q for n, q in params.items() if n not in base.parameters and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)
    ]
    broken += [f"{q.name} has no default" for q in extra if q.default is q.empty]
    return broken


@pytest.mark.parametrize("model_class", ["FaastModel", "FaastModuleModel"])
def test_both_model_classes_implement_the_shared_api_with_its_parameters(model_class: str) -> None:
    from faast.hf import base, model, modules

    cls = {"FaastModel": model.FaastModel, "FaastModuleModel": modules.FaastModuleModel}[model_class]
    assert issubclass(cls, base.FaastModelBase) and not cls.__abstractmethods__
    shared = sorted(base.FaastModelBase.__abstractmethods__)
    assert {"learn_module", "learn_modules", "save_pretrained", "load_adapter", "disable_faast"} <= set(shared)
    broken = {
        name: b
        for name in shared
        if (
            b := _accepts(inspect.signature(getattr(base.FaastModelBase, name)), inspect.signature(getattr(cls, name)))
        )
    }
    assert not broken, f"{model_class} drifted from FaastModelBase: {broken}"


def test_the_shared_api_check_finds_a_drifted_signature() -> None:
    def base(self, directory, *, memories=True): ...  # noqa: ANN001, ANN202
    def renamed(self, folder, *, memories=True): ...  # noqa: ANN001, ANN202
    def new_default(self, directory, *, memories=False): ...  # noqa: ANN001, ANN202
    def required_extra(self, directory, strict, *, memories=True): ...  # noqa: ANN001, ANN202
    def optional_extra(self, directory, *, memories=True, which="all"): ...  # noqa: ANN001, ANN202

    sig = inspect.signature
    assert _accepts(sig(base), sig(renamed)) and _accepts(sig(base), sig(new_default))
    assert _accepts(sig(base), sig(required_extra))
    assert _accepts(sig(base), sig(optional_extra)) == []
