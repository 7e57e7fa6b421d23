"""Memories on the upper blocks' MLPs as an lm_suite setting (lab/experiments/lm_suite_mlp.py, "mlp"): the closed-form
values against autograd, a pass and a capture shared by the settings of one set of blocks, a step that scales what is
read, and bad specs refused."""

from __future__ import annotations

import json
import math

import pytest
import torch

from faast_lab.experiments import lm_suite, lm_suite_mlp, lm_suite_report
from faast_lab.experiments.lm_baselines.tuning import TuningSplit, held_out_nll, tuning_split
from hf_models import VOCAB, tiny_model
from test_lm_suite import ARGS, fake_manifest, fake_tree, loader
from tolerances import ELEMENTWISE


def test_the_closed_form_values_are_the_log_likelihood_gradient_autograd_gives():
    # The oracle: RMSNorm and the head in float64 under autograd (the model's own RMSNorm computes in float32).
    g = torch.Generator().manual_seed(0)
    d, vocab, n, eps = 24, 50, 7, 1e-5
    head = torch.randn(vocab, d, generator=g, dtype=torch.float64)
    scale = torch.rand(d, generator=g, dtype=torch.float64) + 0.5
    r = torch.randn(n, d, generator=g, dtype=torch.float64) * 3
    y = torch.randint(0, vocab, (n,), generator=g)
    wanted = r.clone().requires_grad_(True)
    hidden = scale * wanted / (wanted.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    torch.log_softmax(hidden @ head.T, -1)[torch.arange(n), y].sum().backward()
    got = lm_suite_mlp.log_likelihood_gradient(r, y, head, scale, eps)
    atol, rtol = ELEMENTWISE[torch.float64]
    torch.testing.assert_close(got, wanted.grad, atol=atol, rtol=rtol)


def test_mlp_settings_share_a_pass_and_read_their_memories_with_their_step(tmp_path):
    bases, sources = fake_tree(tmp_path / "tree")
    manifest = fake_manifest(bases, sources)
    settings = {"default": {}, "tiny": {"mlp": {"blocks": [3], "step": 1e-9}},
                "small": {"mlp": {"blocks": [3], "step": 1e-3}}, "large": {"mlp": {"blocks": [3], "step": 1e-2}},
                "two": {"mlp": {"blocks": [2, 3], "step": 1e-3}},
                "ridged": {"mlp": {"blocks": [3], "step": 1e-3, "ridge": "auto"}}}  # fmt: skip
    out = tmp_path / "shards"
    lm_suite.main([*ARGS, "--settings", json.dumps(settings), "--out", str(out)],
                  load_model=loader, manifest=manifest, bases=bases)  # fmt: skip
    shard = json.loads((out / "code.json").read_text())
    rows, defined = shard["settings"], shard["protocol"]["settings"]
    # One pass and one capture per set of blocks; the default learns without either.
    assert rows["default"]["shared_pass"] == ["default"] and rows["two"]["shared_pass"] == ["two"]
    assert rows["tiny"]["shared_pass"] == ["tiny", "small", "large"]
    assert rows["ridged"]["shared_pass"] == ["ridged"]  # another ridge: another configuration of the memories
    assert defined["ridged"]["mlp"] == {"blocks": [3], "step": 1e-3, "ridge": "auto"}
    assert defined["small"]["mlp"] == {"blocks": [3], "step": 1e-3} and "mlp" not in defined["default"]
    assert "mlp" not in rows["default"]
    for name in ("tiny", "small", "large", "two", "ridged"):
        mlp = rows[name]["mlp"]
        assert mlp["capture_s"] > 0 and mlp["learn_s"] > 0
        # The capture and the module learning count in the setting's time.
        assert rows[name]["learn_s"] == pytest.approx(
            rows[name]["pass_learn_s"] + rows[name]["solve_s"] + mlp["capture_s"] + mlp["learn_s"]
        )
    assert rows["tiny"]["mlp"]["capture_s"] == rows["large"]["mlp"]["capture_s"]
    # A vanishing step reads as the default; a larger one moves further from it at every point.
    default, tiny = rows["default"]["curve"]["ppl"], rows["tiny"]["curve"]["ppl"]
    assert tiny == pytest.approx(default, rel=1e-6)
    small, large = rows["small"]["curve"]["ppl"], rows["large"]["curve"]["ppl"]
    for d, s, big in zip(default, small, large, strict=True):
        assert 0 < abs(s - d) < abs(big - d)
    assert "score_reused_from" not in rows["small"] and "score_reused_from" not in rows["large"]
    assert rows["two"]["curve"]["ppl"] != rows["small"]["curve"]["ppl"]
    # The ridge GCV chooses solves otherwise than the pseudo-inverse, and its memory still acts.
    ridged = rows["ridged"]["curve"]["ppl"]
    assert all(r not in (d, s) for d, s, r in zip(default, small, ridged, strict=True))
    # The module memories' statistics count in the memory.
    assert rows["two"]["memory_bytes"] > rows["small"]["memory_bytes"] > rows["default"]["memory_bytes"]
    # The report reads them as settings that leave-one-kind-out may choose.
    merged = lm_suite_report.merge(lm_suite_report.load_shards([out]))
    assert set(merged["reductions"]["code"]) == set(settings)
    assert not math.isnan(merged["loko"]["median"])


def patterned_model(lengths: tuple[int, ...] = (300,) * 4) -> tuple:
    """A tiny Llama with a module memory on block 3's down projection, its output layer learned on documents (of
    these lengths) that each repeat a pattern of 13 tokens (text a memory can learn), and an MlpCapture of them."""
    from faast.hf import FaastConfig, apply_faast

    torch.manual_seed(0)
    base = tiny_model("llama")
    g = torch.Generator().manual_seed(1)
    docs = [(torch.randint(3, VOCAB, (13,), generator=g).tolist() * 60)[:length] for length in lengths]
    model = apply_faast(base, FaastConfig(target_modules=[lm_suite_mlp.module_name(3)]))
    model.learn(docs, max_length=64, batch_size=4, progress=False)
    capture = lm_suite_mlp.MlpCapture(base, [3], 64, 4)
    capture.add(model, docs)
    return base, model, capture, docs


# The output layer turns itself off on these few patterned documents (says so); the MLP memory is what is tested.
@pytest.mark.filterwarnings("ignore::faast.hf.MemoryOffWarning")
def test_a_tuned_step_is_the_argmin_on_documents_the_fit_did_not_see_and_then_learns_every_row_at_it():
    base, model, capture, docs = patterned_model()
    name = lm_suite_mlp.module_name(3)
    memory = model.module_memories.entry(name).memory
    capture.learn(model, lm_suite_mlp.MlpSpec((3,), (0.01, 0.1, 1.0)))
    choice = capture.choice
    assert choice["tuned"] and [g["step"] for g in choice["grid"]] == [0.0, 0.01, 0.1, 1.0]
    assert choice["step"] == min(choice["grid"], key=lambda g: g["nll"])["step"] > 0  # the patterns recur
    tuned = {k: getattr(memory, k).clone() for k in ("gram", "cross", "count")}
    # The oracle: documents 0, 2 and 1, 3 as the folds; each step learned afresh on one fold with learn_module and
    # the other fold's held-out ends (the split cut independently) scored with it.
    plan = tuning_split(docs, 2048, 0).plan
    held = [TuningSplit([docs[i] for i in fold], [(plan[i][0], 0) for i in fold]) for fold in ([0, 2], [1, 3])]
    assert choice["held_tokens"] == sum(h for h, _ in plan) > 0 and choice["documents"] == 4
    rows = [range(i * 299, (i + 1) * 299) for i in range(4)]  # 300 tokens each: 299 positions
    fold_rows = [torch.tensor([*rows[0], *rows[2]]), torch.tensor([*rows[1], *rows[3]])]
    keys, values = torch.cat(capture.keys[3]), torch.cat(capture.values)
    with torch.no_grad(), model.disable_faast():
        own = base.get_submodule(name)(keys)
    for point in choice["grid"]:
        nll, count = 0.0, 0
        for f in (0, 1):
            memory.reset()
            if point["step"] > 0:
                r = fold_rows[1 - f]
                model.learn_module(keys[r], targets=own[r] + point["step"] * values[r], name=name)
            part = held_out_nll(model, held[f], 64, 4)
            nll, count = nll + part[0], count + part[1]
        assert nll / count == pytest.approx(point["nll"], rel=1e-5)
    # Then every row at the chosen step: the statistics of learning all of them at it (learn_module forms the values
    # as (f(a) + η·g) − f(a) in float32: one float32 rounding apart).
    capture.learn(model, lm_suite_mlp.MlpSpec((3,), choice["step"]))
    assert capture.choice is None  # a fixed step chooses nothing
    assert float(tuned["count"]) == float(memory.count) == keys.shape[0]
    atol, rtol = ELEMENTWISE[torch.float32]
    for k in ("gram", "cross"):
        torch.testing.assert_close(tuned[k], getattr(memory, k), rtol=rtol, atol=atol * float(tuned[k].abs().max()))


@pytest.mark.filterwarnings("ignore::faast.hf.MemoryOffWarning")
def test_a_tuned_step_leaves_the_memories_empty_where_nothing_can_be_held_out():
    # One document: no second fold. 238 positions: under min_held_out. A fold of 149 rows: under faast_min_fit's 256
    # for keys 64 wide (and 150 held out).
    for lengths in ((300,), (120, 120), (600, 150)):
        _, model, capture, _ = patterned_model(lengths)
        capture.learn(model, lm_suite_mlp.MlpSpec((3,), (0.01, 1.0)))
        assert capture.choice == {"step": 0.0, "tuned": False, "held_tokens": 0, "documents": len(lengths),
                                  "grid": []}  # fmt: skip
        assert float(model.module_memories.entry(lm_suite_mlp.module_name(3)).memory.count) == 0
    _, model, capture, docs = patterned_model((600, 300))  # folds of 599 and 299 rows, about 180 held out: tuned
    capture.learn(model, lm_suite_mlp.MlpSpec((3,), (0.01, 1.0)))
    held = sum(h for h, _ in tuning_split(docs, 2048, 0).plan)
    assert capture.choice["tuned"] and capture.choice["held_tokens"] == held


@pytest.mark.filterwarnings("ignore::faast.hf.MemoryOffWarning")
def test_a_document_cut_between_parts_is_captured_as_one():
    from faast.hf.tokens import split_continuing

    base, model, whole, docs = patterned_model((300, 200, 250))
    cut = lm_suite_mlp.MlpCapture(base, [3], 64, 4)
    for part, continues in split_continuing(docs, [400, 750]):  # the second document is cut at 400 tokens
        cut.add(model, part, continues)
    assert cut.documents == whole.documents == docs
    # Its rows: every position once (the pieces share one token), each document's in order.
    assert sum(int(v.shape[0]) for v in cut.values) == sum(len(d) - 1 for d in docs)
    cut.learn(model, lm_suite_mlp.MlpSpec((3,), (0.01, 1.0)))  # the row check of the tuned learn passes
    assert cut.choice["documents"] == 3


def test_a_tuned_setting_records_each_points_choice(tmp_path):
    bases, sources = fake_tree(tmp_path / "tree")
    settings = {"default": {}, "tuned": {"mlp": {"blocks": [3], "step": [1e-2, 1e-3]}}}
    out = tmp_path / "shards"
    args = [("1200" if a == "800" else a) for a in ARGS]  # all 1,200 learned tokens: 3 documents, two folds of ≥ 256
    assert args[args.index("--learn-tokens") + 1] == "1200"
    lm_suite.main([*args, "--settings", json.dumps(settings), "--out", str(out)],
                  load_model=loader, manifest=fake_manifest(bases, sources), bases=bases)  # fmt: skip
    shard = json.loads((out / "code.json").read_text())
    row = shard["settings"]["tuned"]
    assert shard["protocol"]["settings"]["tuned"]["mlp"]["step"] == [1e-3, 1e-2]
    first, last = row["mlp_curve"]
    # 383 positions at the first point hold out under min_held_out: the memories stay empty, it reads as the default.
    assert not first["tuned"] and first["step"] == 0
    assert row["curve"]["ppl"][0] == pytest.approx(shard["settings"]["default"]["curve"]["ppl"][0], rel=1e-6)
    assert last["tuned"] and [g["step"] for g in last["grid"]] == [0.0, 1e-3, 1e-2]
    assert last["step"] == min(last["grid"], key=lambda g: g["nll"])["step"] == row["mlp"]["chosen_step"]


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (3, "expects"),
        ({"blocks": [3]}, "expects"),
        ({"blocks": [3], "step": 1, "extra": 0}, "expects"),
        ({"blocks": [], "step": 1}, "blocks"),
        ({"blocks": [1, 1], "step": 1}, "blocks"),
        ({"blocks": [-1], "step": 1}, "blocks"),
        ({"blocks": [True], "step": 1}, "blocks"),
        ({"blocks": [1], "step": 0}, "step"),
        ({"blocks": [1], "step": "1"}, "step"),
        ({"blocks": [1], "step": math.nan}, "step"),
        ({"blocks": [1], "step": math.inf}, "step"),
        ({"blocks": [1], "step": []}, "step"),
        ({"blocks": [1], "step": [1, 1]}, "step"),
        ({"blocks": [1], "step": [1, 0]}, "step"),
        ({"blocks": [1], "step": [1, True]}, "step"),
        ({"blocks": [1], "step": 1, "ridge": -1}, "ridge"),
        ({"blocks": [1], "step": 1, "ridge": "gcv"}, "ridge"),
        ({"blocks": [1], "step": 1, "ridge": True}, "ridge"),
    ],
)
def test_a_bad_mlp_spec_is_refused_naming_the_setting(spec, says):
    with pytest.raises(ValueError, match=f"setting 'bad'.*'mlp'.*{says}"):
        lm_suite_mlp.split_mlp("bad", {"mlp": spec})
    assert lm_suite_mlp.split_mlp("ok", {"bias": 0}) == ({"bias": 0}, None)
    fields, spec_ok = lm_suite_mlp.split_mlp("ok", {"mlp": {"blocks": [3, 1], "step": 2}, "bias": 0})
    assert fields == {"bias": 0} and spec_ok == lm_suite_mlp.MlpSpec((1, 3), 2.0)
    _, ridged = lm_suite_mlp.split_mlp("ok", {"mlp": {"blocks": [1], "step": 2, "ridge": 1}})
    assert ridged == lm_suite_mlp.MlpSpec((1,), 2.0, 1.0) and ridged.learn_key() != spec_ok.learn_key()
    _, tuned = lm_suite_mlp.split_mlp("ok", {"mlp": {"blocks": [1], "step": [50, 25]}})
    assert tuned == lm_suite_mlp.MlpSpec((1,), (25.0, 50.0)) and tuned.tuned and not spec_ok.tuned
    assert tuned.to_dict() == {"blocks": [1], "step": [25.0, 50.0]} and tuned.learn_key() == "[1]|None"


def test_a_block_the_model_lacks_is_refused_naming_the_setting():
    specs = {"ok": lm_suite_mlp.MlpSpec((1,), 1.0), "far": lm_suite_mlp.MlpSpec((2, 9), 1.0)}
    with pytest.raises(ValueError, match=r"setting 'far'.*\[9\].*4 blocks"):
        lm_suite_mlp.check_blocks(tiny_model("llama"), specs)
    assert lm_suite_mlp.check_blocks(tiny_model("llama"), {"ok": specs["ok"]}) == [1]


def test_mlp_memories_with_a_readout_are_refused_naming_the_setting(tmp_path):
    bases, sources = fake_tree(tmp_path / "tree")
    settings = {"both": {"mlp": {"blocks": [3], "step": 1.0}, "readout": "shipped"}}
    with pytest.raises(ValueError, match="setting 'both'.*'mlp' and 'readout'"):
        lm_suite.main([*ARGS, "--settings", json.dumps(settings), "--out", str(tmp_path / "shards")],
                      load_model=loader, manifest=fake_manifest(bases, sources), bases=bases)  # fmt: skip
    assert not (tmp_path / "shards").exists()
