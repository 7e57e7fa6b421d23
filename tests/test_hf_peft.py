"""faast and PEFT (docs/design.md §6.6): PEFT's registration is closed to third-party methods, and faast's module
memories compose with a PEFT (LoRA) model on tiny models built in-process."""

from __future__ import annotations

import pytest
import torch

from faast.hf import FaastConfig, FaastModel
from faast.hf.modules import FaastModuleModel
from faast.hf.peft_method import apply_faast_to_peft, peft_accepts_method
from hf_models import VOCAB, tiny_model
from tolerances import TRUTH_REL_W, assert_close, rel

peft = pytest.importorskip("peft")

F64 = torch.float64


def test_peft_registration_refuses_a_method_outside_its_enum():
    """If this starts failing, PEFT has opened register_peft_method to new names: faast can then register itself
    (docs/design.md §6.6, faast/hf/peft_method.py)."""
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING
    from peft.utils import PeftType, register_peft_method

    assert not peft_accepts_method("faast")
    assert peft_accepts_method("lora")
    with pytest.raises(ValueError, match="Unknown PEFT type FAAST"):
        register_peft_method(name="faast", config_cls=peft.PeftConfig, model_cls=None, prefix="faast_")
    with pytest.raises(ValueError):
        PeftType("FAAST")
    assert "FAAST" not in PEFT_TYPE_TO_CONFIG_MAPPING and "FAAST" not in PEFT_TYPE_TO_TUNER_MAPPING


def lora_gpt2() -> torch.nn.Module:
    # init_lora_weights=False: B is random, so the adapter changes the logits from the start.
    config = peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, init_lora_weights=False)
    torch.manual_seed(3)
    return peft.get_peft_model(tiny_model("gpt2"), config).eval()


def test_lm_head_memory_on_a_lora_model_fits_what_the_adapted_model_gets_wrong():
    ids = torch.randint(3, VOCAB, (3, 17), generator=torch.Generator().manual_seed(0))
    targets = torch.cat([ids[:, 1:], torch.full((3, 1), -100)], dim=1)
    peft_model = lora_gpt2()
    with torch.no_grad():
        lora_logits = peft_model(input_ids=ids).logits
        with peft_model.disable_adapter():
            assert not torch.equal(peft_model(input_ids=ids).logits, lora_logits)  # the adapter is active
    seen = []
    handle = peft_model.get_base_model().lm_head.register_forward_hook(lambda m, a, o: seen.append((a[0], o)))
    with torch.no_grad():
        peft_model(input_ids=ids)
    handle.remove()
    keys, head_out = seen[0]

    model = apply_faast_to_peft(peft_model, FaastConfig(output=None, target_modules=["lm_head"]))
    assert isinstance(model, FaastModel)
    assert model.learn_modules(input_ids=ids, targets=targets) == 48
    keep = targets != -100
    k = keys[keep].to(F64)
    v = torch.nn.functional.one_hot(targets[keep], VOCAB).to(F64) - head_out[keep].to(F64)
    reference = torch.linalg.pinv(k, atol=0.0, rtol=1 / k.shape[0]) @ v
    assert rel(model.module_memories.entry().memory.weights, reference) < TRUTH_REL_W
    with torch.no_grad():
        # Calling the PeftModel runs LoRA and the memory together: its logits are the LoRA model's plus K·W.
        assert_close(peft_model(input_ids=ids).logits, head_out.to(F64) + keys.to(F64) @ reference, torch.float32)
        with model.disable_faast():
            assert torch.equal(peft_model(input_ids=ids).logits, lora_logits)


def test_classifier_memory_on_a_lora_classifier():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, num_labels=3, initializer_range=0.2,
    )  # fmt: skip
    base = transformers.BertForSequenceClassification(config).eval()
    peft_model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["query", "value"])).eval()
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 3, (120,), generator=g)
    ids = torch.where(torch.rand(120, 24, generator=g) < 0.3, 20, 5 + labels[:, None])
    model = apply_faast_to_peft(peft_model, FaastConfig(target_modules=["classifier"]))
    assert isinstance(model, FaastModuleModel)
    assert model.learn(input_ids=ids[:60], labels=labels[:60]) == 60
    with torch.no_grad():
        accuracy = float((peft_model(input_ids=ids[60:]).logits.argmax(-1) == labels[60:]).float().mean())
        with model.disable_faast():
            before = float((peft_model(input_ids=ids[60:]).logits.argmax(-1) == labels[60:]).float().mean())
    assert before < 0.6 and accuracy > 0.98, (before, accuracy)


def test_apply_faast_to_peft_needs_a_peft_model():
    with pytest.raises(TypeError, match="peft_model: expected a peft.PeftModel"):
        apply_faast_to_peft(torch.nn.Linear(2, 2), FaastConfig(target_modules=["x"]))
