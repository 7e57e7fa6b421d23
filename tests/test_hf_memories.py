"""Named memories on tiny GPT-2 / Llama / Qwen2 models: learn into, select and delete them; many in one batch (forward
and generate, padding, KV cache); forget and merge; save_pretrained / from_pretrained of every memory (a fresh
process reloads bit for bit); and the errors, each leaving the state as it was."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from faast.hf import (
    EmbeddingOutput,
    FaastConfig,
    FaastModel,
    MiddleLayers,
    ResidualOutput,
    apply_faast,
    from_pretrained,
)
from hf_models import KINDS, VOCAB, tiny_model
from tolerances import ELEMENTWISE, REORDER_REL, rel

ROOT = Path(__file__).resolve().parents[1]
F32 = dict(zip(("atol", "rtol"), ELEMENTWISE[torch.float32], strict=True))


def stream(seed, batch=12, seq=100, period=23):
    """A repeated random phrase per seed: text each memory can learn something distinct from."""
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(3, VOCAB, (period,), generator=g)
    noise = torch.randint(3, VOCAB, (batch, seq), generator=g)
    x = phrase.repeat(batch * seq // period + 1)[: batch * seq].reshape(batch, seq)
    return torch.where(torch.rand((batch, seq), generator=g) < 0.15, noise, x)


def prompts(seed=9, batch=4, seq=15):
    return torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def randomize_readouts(model, seed=1, std=0.2):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.memory_layers.values():
            layer.readout.weight.copy_(torch.randn(layer.readout.weight.shape, generator=g) * std)


CONFIGS = {
    "default": {},
    "middle": {"middle": MiddleLayers(layers=[1, 2])},
    "logit": {"output": ResidualOutput(space="logit")},
    "embedding": {"output": EmbeddingOutput()},
}


def learned(kind, config="default", names=("a", "b", "c")):
    model = apply_faast(tiny_model(kind), FaastConfig(**CONFIGS[config]))
    randomize_readouts(model)
    for i, name in enumerate(names):
        model.learn(stream(i), memory=name)
    return model


def logits(model, x, **kwargs):
    with torch.no_grad():
        return model(x, **kwargs).logits


def base_logits(model, x, **kwargs):
    with torch.no_grad(), model.disable_faast():
        return model(x, **kwargs).logits


# ---------------------------------------------------------------------------------------------------- named memories


def test_named_memories_are_listed_selected_and_deleted_and_learning_leaves_the_selection():
    model = apply_faast(tiny_model("llama"), FaastConfig())
    assert model.memories == ["default"] and model.active_memory == "default"
    x = prompts()
    model.learn(stream(0), memory="a")
    assert model.memories == ["default", "a"] and model.active_memory == "default"
    torch.testing.assert_close(logits(model, x), base_logits(model, x), rtol=0, atol=0)  # 'default' is empty
    model.set_memory("a")
    read_a = logits(model, x)
    assert (read_a - base_logits(model, x)).abs().max() > 1e-3
    model.learn(stream(1), memory="b")
    assert model.active_memory == "a"
    torch.testing.assert_close(logits(model, x), read_a, rtol=0, atol=0)  # learning b left a alone
    model.set_memory("default").delete_memory("a")
    assert model.memories == ["default", "b"]


def test_switching_memories_solves_nothing_again():
    model = learned("llama", "middle")
    model.solve()
    calls = []
    original = torch.linalg.eigh
    torch.linalg.eigh = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        for name in ("a", "b", "c", "a"):
            model.set_memory(name)
            logits(model, prompts())
    finally:
        torch.linalg.eigh = original
    assert calls == []


def test_each_memory_equals_a_model_that_learned_only_its_text():
    model = learned("qwen2", "middle")
    x = prompts()
    for i, name in enumerate(("a", "b", "c")):
        alone = apply_faast(tiny_model("qwen2"), FaastConfig(**CONFIGS["middle"]))
        randomize_readouts(alone)
        alone.learn(stream(i))
        model.set_memory(name)
        torch.testing.assert_close(logits(model, x), logits(alone, x), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------- mixed batches


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("kind", KINDS)
def test_a_mixed_batch_equals_each_row_read_alone(kind, config, padding):
    model = learned(kind, config)
    x = prompts(batch=5)
    mask = torch.ones_like(x)
    pad = slice(0, 4) if padding == "left" else slice(-4, None)
    mask[1, pad] = 0
    mask[3, pad] = 0
    names = ["a", "b", "__base__", "c", "a"]
    mixed = logits(model, x, attention_mask=mask, memory_names=names)
    for i, name in enumerate(names):
        if name == "__base__":
            single = base_logits(model, x[i : i + 1], attention_mask=mask[i : i + 1])
            torch.testing.assert_close(mixed[i : i + 1], single, rtol=0, atol=0)  # the base rows: exactly
            continue
        model.set_memory(name)
        single = logits(model, x[i : i + 1], attention_mask=mask[i : i + 1])
        real = mask[i].bool()
        torch.testing.assert_close(mixed[i, real], single[0, real], **F32)
        assert (
            single[0, real] - base_logits(model, x[i : i + 1], attention_mask=mask[i : i + 1])[0, real]
        ).abs().max() > 1e-4
    model.set_memory("default")


@pytest.mark.parametrize("kind", KINDS)
def test_mixed_generation_equals_each_row_alone_with_and_without_the_kv_cache(kind):
    model = learned(kind, "middle")
    x = prompts(batch=3, seq=10)
    mask = torch.ones_like(x)
    mask[0, :3] = 0  # left padding, as for generation
    names = ["a", "__base__", "c"]
    settings = dict(max_new_tokens=6, do_sample=False, attention_mask=mask)
    cached = model.generate(x, memory_names=names, **settings)
    uncached = model.generate(x, memory_names=names, use_cache=False, **settings)
    assert torch.equal(cached, uncached)
    for i, name in enumerate(names):
        row = dict(settings, attention_mask=mask[i : i + 1])
        if name == "__base__":
            with model.disable_faast():
                alone = model.generate(x[i : i + 1], **row)
        else:
            model.set_memory(name)
            alone = model.generate(x[i : i + 1], **row)
        assert torch.equal(cached[i : i + 1, -alone.shape[1] :], alone)


def test_generation_expanding_rows_keeps_each_rows_memory():
    model = learned("llama")
    x = prompts(batch=2, seq=8)
    beams = dict(max_new_tokens=4, do_sample=False, num_beams=2, num_return_sequences=2)
    out = model.generate(x, memory_names=["a", "b"], **beams)
    for i, name in enumerate(["a", "b"]):
        model.set_memory(name)
        alone = model.generate(x[i : i + 1], **beams)
        assert torch.equal(out[2 * i : 2 * i + 2], alone)


def test_a_mixed_batch_is_one_batched_product_per_layer():
    model = learned("llama", "middle")
    model.solve()  # reading is what is counted (solving tunes each memory's step with products of its own)
    calls = []
    original = torch.bmm
    torch.bmm = lambda *a, **k: calls.append(a[1].shape) or original(*a, **k)
    try:
        logits(model, prompts(batch=4), memory_names=["a", "b", "c", "a"])
    finally:
        torch.bmm = original
    # two middle layers and the output layer, each one bmm over the 4 rows
    assert len(calls) == 3 and all(shape[0] == 4 for shape in calls)


# ---------------------------------------------------------------------------------------------------- forget and merge


def statistics(model, name):
    state = model.memory_state(name)
    out = {"bank.gram": state.bank.gram, "bank.cross": state.bank.cross} if state.bank is not None else {}
    out.update({"output.gram": state.output.memory.gram, "output.cross": state.output.memory.cross,
                "curvature": state.output.curvature.gram, "mass": state.output.token_mass.probability,
                "gradient": state.output.gradient_sum.gradient,
                "target counts": state.output.target_count.targets})  # fmt: skip
    return out


def assert_same_statistics(model, a, b):
    for (key, x), y in zip(statistics(model, a).items(), statistics(model, b).values(), strict=True):
        assert rel(x, y) <= REORDER_REL, key


@pytest.mark.parametrize("order", ["forgotten first", "forgotten last"])
def test_forget_equals_never_learned(order):
    # A fixed step and weight: reading depends on the statistics alone. (With a tuned step, see the next test.)
    config = FaastConfig(output=ResidualOutput(step=0.5, weight=0.5), middle=MiddleLayers(layers=[1, 2]))
    model = apply_faast(tiny_model("llama"), config)
    randomize_readouts(model)
    keep, drop = stream(0), stream(1)
    model.learn(keep, memory="never")
    for part in [drop, keep] if order == "forgotten first" else [keep, drop]:
        model.learn(part, memory="forgot")
    model.forget(drop, memory="forgot")
    assert_same_statistics(model, "forgot", "never")
    x = prompts()
    torch.testing.assert_close(logits(model, x, memory_names=["forgot"] * 4),
                               logits(model, x, memory_names=["never"] * 4), **F32)  # fmt: skip


def test_forget_with_a_tuned_step_drops_the_forgotten_positions_from_the_tuning_tail():
    model = apply_faast(tiny_model("llama"), FaastConfig())
    keep, drop = stream(0), stream(1)
    model.learn(keep, memory="never")
    model.learn(keep, memory="forgot")
    model.learn(drop, memory="forgot")
    model.forget(drop, memory="forgot")
    layer = model.output_memory_layer
    # the text learned first, then forgotten: what remains is exactly what the never-learned memory holds
    model.set_memory("never")
    tail_never = len(layer.held_out)
    model.set_memory("forgot")
    # every position of the forgotten text left the tail; the step is tuned on the rest (no saved step is read)
    assert len(layer.held_out) <= tail_never
    x = prompts()
    read = logits(model, x)
    assert layer.last_tuning is not None and layer.last_tuning.get("saved_step") in (None, False)
    model.forget(keep, memory="forgot")
    assert len(layer.held_out) == 0 and float(layer.memory.count) == 0
    torch.testing.assert_close(logits(model, x), base_logits(model, x), rtol=0, atol=0)
    assert not torch.equal(read, logits(model, x))


def test_forget_first_learned_text_with_a_tuned_step_reads_exactly_as_never_learned():
    model = apply_faast(tiny_model("gpt2"), FaastConfig())
    keep, drop = stream(0), stream(1)
    model.learn(keep, memory="never")
    model.learn(drop, memory="forgot")
    model.learn(keep, memory="forgot")
    model.forget(drop, memory="forgot")
    assert_same_statistics(model, "forgot", "never")
    x = prompts()
    never = logits(model, x, memory_names=["never"] * 4)
    torch.testing.assert_close(logits(model, x, memory_names=["forgot"] * 4), never, **F32)
    tuned = [model.memory_state(name).output.last_tuning for name in ("forgot", "never")]
    assert tuned[0]["tuned"] and tuned[0]["held_out_tokens"] == tuned[1]["held_out_tokens"]  # the same tail


@pytest.mark.parametrize("config", ["default", "middle", "embedding"])
def test_merge_equals_learning_both_streams_into_one_memory(config):
    model = learned("llama", config, names=("a", "b"))
    model.learn(stream(0), memory="ab")
    model.learn(stream(1), memory="ab")
    model.merge_memories(["a", "b"], into="merged")
    assert model.memories == ["default", "a", "b", "ab", "merged"]
    if config != "embedding":
        assert_same_statistics(model, "merged", "ab")
    x = prompts()
    merged = logits(model, x, memory_names=["merged"] * 4)
    torch.testing.assert_close(merged, logits(model, x, memory_names=["ab"] * 4), **F32)
    if config == "default":  # the merged memory tuned its own step on the joined tails: the one learning both tuned
        model.set_memory("merged")
        logits(model, x)
        tuned = dict(model.output_memory_layer.last_tuning)
        model.set_memory("ab")
        logits(model, x)
        assert tuned["tuned"] and tuned["step"] == pytest.approx(model.output_memory_layer.last_tuning["step"],
                                                                 rel=1e-4)  # fmt: skip
    # the merged memory forgets one source exactly
    model.forget(stream(1), memory="merged")
    model.set_memory("default")
    if config != "embedding":
        assert_same_statistics(model, "merged", "a")


# ---------------------------------------------------------------------------------------------------- saving


def test_save_pretrained_writes_a_manifest_and_one_file_per_memory_and_reloads_every_memory(tmp_path):
    model = learned("llama", "middle")
    model.set_memory("b")
    model.save_pretrained(tmp_path)
    manifest = json.loads((tmp_path / "faast_manifest.json").read_text())
    assert manifest["format_version"] == 2 and manifest["selected"] == "b"
    assert [m["name"] for m in manifest["memories"]] == ["default", "a", "b", "c"]
    assert all((tmp_path / m["file"]).stat().st_size == m["bytes"] for m in manifest["memories"])
    reloaded = FaastModel.from_pretrained(tiny_model("llama"), tmp_path)
    assert reloaded.memories == model.memories and reloaded.active_memory == "b"
    x = prompts()
    for name in model.memories:
        assert torch.equal(logits(model, x, memory_names=[name] * 4), logits(reloaded, x, memory_names=[name] * 4))
    # forget works after a reload: the ledger was saved with each memory
    reloaded.forget(stream(0), memory="a")
    assert float(reloaded.memory_state("a").output.memory.count) == 0


def test_a_later_save_removes_the_files_of_deleted_memories_and_memories_false_keeps_none(tmp_path):
    model = learned("gpt2")
    model.save_pretrained(tmp_path)
    model.delete_memory("b").save_pretrained(tmp_path)
    assert sorted(p.name for p in (tmp_path / "memories").iterdir()) == ["a.safetensors", "c.safetensors",
                                                                         "default.safetensors"]  # fmt: skip
    model.save_pretrained(tmp_path, memories=False)
    assert list((tmp_path / "memories").iterdir()) == []
    reloaded = from_pretrained(tiny_model("gpt2"), tmp_path)
    assert reloaded.memories == ["default"]


def test_a_saved_model_without_the_default_memory_reloads_without_it(tmp_path):
    model = learned("gpt2")
    model.set_memory("a").delete_memory("default")
    model.save_pretrained(tmp_path)
    assert from_pretrained(tiny_model("gpt2"), tmp_path).memories == ["a", "b", "c"]


RELOAD = """
import sys, torch
from faast.hf import FaastModel
from hf_models import tiny_model
torch.set_num_threads({threads})  # the parent's: bit-for-bit needs the same GEMM kernels and summation order
model = FaastModel.from_pretrained(tiny_model("{kind}"), sys.argv[1])
x = torch.load(sys.argv[2])
with torch.no_grad():
    out = {{name: model(x, memory_names=[name] * x.shape[0]).logits for name in model.memories}}
    out["__selected__"] = model(x).logits
torch.save(out, sys.argv[3])
"""


@pytest.mark.parametrize(("kind", "config"), [("llama", "default"), ("qwen2", "middle"), ("gpt2", "embedding")])
def test_a_fresh_process_reloads_every_memory_bit_for_bit(kind, config, tmp_path):
    model = learned(kind, config)
    model.set_memory("c")
    model.save_pretrained(tmp_path / "saved")
    x = prompts()
    torch.save(x, tmp_path / "x.pt")
    code = RELOAD.format(kind=kind, threads=torch.get_num_threads())
    args = [sys.executable, "-c", code, str(tmp_path / "saved"), str(tmp_path / "x.pt"), str(tmp_path / "out.pt")]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")])),
    }
    run = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = torch.load(tmp_path / "out.pt")
    assert set(out) == {*model.memories, "__selected__"}
    for name in model.memories:
        assert torch.equal(out[name], logits(model, x, memory_names=[name] * 4)), name
    assert torch.equal(out["__selected__"], logits(model, x))
    assert not torch.equal(out["c"], base_logits(model, x))


def test_a_folder_written_before_manifests_loads_its_memories_as_default(tmp_path):
    model = learned("llama", names=("default",))
    model.save_pretrained(tmp_path)
    # the format-1 layout: one memories file beside the config, no manifest
    (tmp_path / "memories" / "default.safetensors").rename(tmp_path / "faast_memories.safetensors")
    (tmp_path / "faast_manifest.json").unlink()
    reloaded = from_pretrained(tiny_model("llama"), tmp_path)
    x = prompts()
    assert torch.equal(logits(reloaded, x), logits(model, x))


# ---------------------------------------------------------------------------------------------------- errors


def snapshot(model):
    state = {name: {k: v.clone() for k, v in model.memory_state(name).state_dict().items()} for name in model.memories}
    return model.memories, model.active_memory, state


def assert_unchanged(model, before):
    names, active, state = before
    assert model.memories == names and model.active_memory == active
    for name in names:
        now = model.memory_state(name).state_dict()
        assert set(now) == set(state[name])
        assert all(torch.equal(now[k], state[name][k]) for k in now), name


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda m: m.set_memory("nope"), "memory: no memory named 'nope'"),
        (lambda m: m.delete_memory("nope"), "memory: no memory named 'nope'"),
        (lambda m: m.delete_memory("default"), "'default' is the selected memory"),
        (lambda m: m.learn(stream(3), memory="a.b"), "memory: expected a memory name"),
        (lambda m: m.learn(stream(3), memory="__base__"), "memory: expected a memory name"),
        (lambda m: m.learn(stream(3), memory=3), "memory: expected a memory name"),
        (lambda m: m(prompts(), memory_names=["a", "b"]), "memory_names: expected one name per row"),
        (lambda m: m(prompts(), memory_names="a"), "memory_names: expected a list"),
        (lambda m: m(prompts(), memory_names=["a", "b", "x", "a"]), r"memory_names: no memories named \['x'\]"),
        (lambda m: m(prompts(), memory_names=["a", 1, "b", "a"]), "memory_names: expected a list"),
        (lambda m: m.forget(stream(7), memory="a"), "never learned into this memory"),
        (lambda m: m.forget(stream(0), memory="b"), "never learned into this memory"),
        (lambda m: m.forget(stream(0), memory="nope"), "memory: no memory named 'nope'"),
        (lambda m: m.merge_memories(["a", "nope"], into="x"), "names: no memory named 'nope'"),
        (lambda m: m.merge_memories(["a", "b"], into="c"), "into: a memory named 'c' exists"),
        (lambda m: m.merge_memories(["a", "a"], into="x"), "names: each memory once"),
        (lambda m: m.learn([[5, 6, 7]] * 9 + [["bad"]], memory="new"), "."),
    ],
)
def test_bad_calls_raise_naming_the_argument_and_change_nothing(call, match):
    model = learned("llama", "middle")
    before = snapshot(model)
    ledgers = {name: list(model.memory_store.ledgers[name].entries) for name in model.memories}
    with pytest.raises((ValueError, TypeError), match=match):
        call(model)
    assert_unchanged(model, before)
    assert {name: model.memory_store.ledgers[name].entries for name in model.memories} == ledgers


def test_loading_into_a_mismatched_base_model_is_refused_by_name(tmp_path):
    model = learned("llama")
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        from_pretrained(tiny_model("llama", layers=3), tmp_path)
    wider = tiny_model("llama")
    wider.resize_token_embeddings(VOCAB + 3)
    with pytest.raises(ValueError, match="vocab_size=61"):
        from_pretrained(wider, tmp_path)
    assert not hasattr(wider, "faast_hooks")  # left bare: faast applies again
    apply_faast(wider, FaastConfig())


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda text: text[: len(text) // 2], "not a readable faast manifest"),
        (lambda text: text.replace('"format_version": 2', '"format_version": 9'), "newer faast"),
        (lambda text: text.replace('"format_version": 2', '"format_version": "2"'), "format_version"),
        (lambda text: text.replace('"selected": "a"', '"selected": "zz"'), "selected"),
        (lambda text: text.replace("memories/b.safetensors", "memories/../b.safetensors"), "memories: expected"),
        (lambda text: json.dumps({**json.loads(text), "base": {}}), "base: expected the fields"),
    ],
)
def test_a_truncated_or_edited_manifest_is_refused(tmp_path, edit, match):
    model = learned("llama")
    model.set_memory("a").save_pretrained(tmp_path)
    path = tmp_path / "faast_manifest.json"
    path.write_text(edit(path.read_text()))
    base = tiny_model("llama")
    with pytest.raises(ValueError, match=match):
        from_pretrained(base, tmp_path)
    apply_faast(base, FaastConfig())  # the failed load left the base model bare


def test_a_memory_file_that_is_not_the_one_the_manifest_names_is_refused(tmp_path):
    model = learned("llama")
    model.save_pretrained(tmp_path)
    (tmp_path / "memories" / "a.safetensors").write_bytes((tmp_path / "memories" / "b.safetensors").read_bytes())
    with pytest.raises(ValueError, match="memory 'a': memories/a.safetensors is not the file the manifest names"):
        from_pretrained(tiny_model("llama"), tmp_path)
    (tmp_path / "memories" / "a.safetensors").unlink()
    with pytest.raises(ValueError, match="memory 'a': memories/a.safetensors is missing"):
        from_pretrained(tiny_model("llama"), tmp_path)


def test_memory_names_are_refused_with_target_module_memories():
    model = apply_faast(tiny_model("llama"), FaastConfig(target_modules=["lm_head"]))
    with pytest.raises(ValueError, match="memory_names: not supported with target_modules"):
        model(prompts(), memory_names=["default"] * 4)
