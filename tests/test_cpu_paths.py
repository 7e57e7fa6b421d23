"""The CPU's automatic choices made by measurement (faast.ops.paths, faast/hf/pass_choice.py, faast/hf/head.py): with
a fake timer, the fastest mode wins, a cached choice is reused, another machine's is not, an explicit setting and the
FAAST_BACKEND pin win, a mode that raises is skipped and said, a less exact mode must win clearly, and a slow first
call is not repeated; the machine key; and `python -m faast.hardware`'s report on tiny shapes."""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch

from faast import hardware
from faast.hardware import report as report_module
from faast.hf import FaastConfig, OutputPolicy, ResidualOutput, apply_faast, pass_choice
from faast.hf.output import head as head_module
from faast.ops import _autotune, _dispatch, paths
from hf_models import tiny_model
from test_hf_residual import ids

CPU = torch.device("cpu")


def _choose(op: str = "learn_pass", shape_class: str = "s", **options: object) -> str:
    ran: list[str] = []
    mode = paths.choose(op, CPU, shape_class, ran.append, options={"int8_linears": 3, **options})
    assert all(m in paths.PATHS[op] for m in ran)
    return mode


def test_the_fastest_mode_wins_and_is_cached(timed):
    timed.times = {"torch.float32": 1.0, "torch.bfloat16": 0.9, "torch.int8": 0.5}
    assert _choose() == "int8"
    assert timed.sampled == ["torch.float32", "torch.bfloat16", "torch.int8"]
    entry = json.loads(timed.path.read_text())["entries"][_autotune.context_key(CPU)]["learn_pass s"]
    assert entry == {"choice": "torch.int8", "seconds": timed.times}
    assert paths.cached("learn_pass", CPU, "s") == "int8"


def test_a_cached_choice_is_reused_without_measuring_even_in_a_new_process(timed):
    timed.times = {"torch.float32": 1.0, "torch.bfloat16": 2.0, "torch.int8": 0.5}
    _choose()
    _autotune.forget_memory()  # a new process knows only the file
    timed.sampled.clear()
    timed.times = {"torch.float32": 0.1, "torch.bfloat16": 2.0, "torch.int8": 0.5}  # would flip it if measured
    assert _choose() == "int8" and timed.sampled == []
    assert _choose(shape_class="another") == "float32" and len(timed.sampled) == 3  # another shape: measured


@pytest.mark.parametrize("change", ["flags", "model", "threads"])
def test_another_machines_cache_entry_is_not_used(timed, monkeypatch, change):
    timed.times = {"torch.float32": 1.0, "torch.bfloat16": 2.0, "torch.int8": 0.5}
    _choose()
    timed.sampled.clear()
    if change == "flags":
        monkeypatch.setattr(hardware, "cpu_flags", lambda: ("avx2", "avx512f", "avx512_vnni"))
    elif change == "model":
        monkeypatch.setattr(hardware, "cpu_model", lambda: "Another CPU")
    else:
        monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    timed.times = {"torch.float32": 0.1, "torch.bfloat16": 2.0, "torch.int8": 0.5}
    assert _choose() == "float32" and len(timed.sampled) == 3
    assert len(json.loads(timed.path.read_text())["entries"]) == 2  # both machines' choices are kept


def test_a_less_exact_mode_must_win_by_more_than_the_margin(timed):
    timed.times = {"torch.float32": 1.0, "torch.bfloat16": 2.0, "torch.int8": 1.0 / (1 + paths.PRECISION_MARGIN / 2)}
    assert _choose() == "float32"
    timed.times = {"torch.float32": 1.0, "torch.bfloat16": 2.0, "torch.int8": 1.0 / (1 + 2 * paths.PRECISION_MARGIN)}
    assert _choose(shape_class="t") == "int8"


def test_a_mode_that_raises_while_timed_is_skipped_and_said_once(timed, caplog):
    timed.times = {"torch.float32": 1.0, "torch.bfloat16": 0.2, "torch.int8": RuntimeError("no kernel here")}
    with caplog.at_level(logging.INFO, logger="faast"):
        assert _choose() == "bfloat16"
        assert _choose(shape_class="t") == "bfloat16"
    said = [r.getMessage() for r in caplog.records if "failed while being timed" in r.getMessage()]
    assert len(said) == 1 and "torch.int8" in said[0] and "no kernel here" in said[0]


def test_a_mode_that_cannot_run_is_not_timed_and_a_pin_to_it_raises(timed, monkeypatch):
    assert _choose(int8_linears=0) == "float32" and "torch.int8" not in timed.sampled
    monkeypatch.setenv(_dispatch.ENV_VAR, "learn_pass=torch.int8")
    with pytest.raises(RuntimeError, match="FAAST_BACKEND=torch.int8 was requested for learn_pass .* no nn.Linear"):
        _choose(shape_class="u", int8_linears=0)


def test_the_environment_pins_a_mode_without_measuring(timed, monkeypatch):
    monkeypatch.setenv(_dispatch.ENV_VAR, "learn_pass=torch.bfloat16,head_logits=torch.int8")
    assert _choose() == "bfloat16" and _choose("head_logits") == "int8" and timed.sampled == []
    monkeypatch.setenv(_dispatch.ENV_VAR, "learn_pass=torch.float16")
    with pytest.raises(RuntimeError, match="has no variant 'float16' of learn_pass"):
        _choose()


def test_measuring_off_takes_the_first_mode(timed, monkeypatch):
    monkeypatch.setenv(_autotune.ENABLE_ENV, "0")
    timed.times = {"torch.float32": 9.0, "torch.bfloat16": 0.1, "torch.int8": 0.1}
    assert _choose() == "float32" and _choose("head_pool") == "exact" and timed.sampled == []


def test_a_first_call_far_slower_than_the_best_is_not_repeated(monkeypatch, tmp_path):
    """The real timer: a mode whose first call takes over GIVE_UP× the best time so far is called once, and that
    call's time is recorded."""
    monkeypatch.setenv(_autotune.ENABLE_ENV, "1")
    monkeypatch.setenv(_autotune.CACHE_ENV, str(tmp_path / "autotune.json"))
    _autotune.forget_memory()
    calls = {"float32": 0, "bfloat16": 0, "int8": 0}
    pause = {"float32": 0.002, "bfloat16": 0.05, "int8": 0.003}

    def run(mode: str) -> None:
        calls[mode] += 1
        time.sleep(pause[mode])

    assert paths.choose("learn_pass", CPU, "slow", run, options={"int8_linears": 1}) == "float32"
    assert calls == {"float32": 1 + _autotune.REPS, "bfloat16": 1, "int8": 1 + _autotune.REPS}
    seconds = _autotune.entry(CPU, "learn_pass", "slow")["seconds"]
    assert seconds["torch.bfloat16"] >= pause["bfloat16"]
    _autotune.forget_memory()


def test_the_machine_key_names_the_model_the_flags_and_the_threads(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_model", lambda: "Some CPU")
    monkeypatch.setattr(hardware, "cpu_flags", lambda: ("avx2", "fma"))
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    key = hardware.machine_key()
    assert key.startswith("Some CPU x") and "| avx2 fma |" in key and f"{torch.get_num_threads()} threads" in key
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")
    assert hardware.machine_key().endswith("| oneDNN limit AVX2")
    assert _autotune.context_key(CPU).startswith(f"cpu: {hardware.machine_key()} | torch ")


# ---------------------------------------------------------------------------------------------------- in a model


def test_learn_dtype_auto_on_a_cpu_takes_the_measured_mode_and_an_explicit_one_is_never_overridden(timed):
    timed.times = {"torch.float32": 1.0, "torch.bfloat16": 2.0, "torch.int8": 0.2}
    model = apply_faast(tiny_model("llama"), FaastConfig(output=ResidualOutput(step=0.5)))
    assert model.learner.pass_precision(CPU) == "int8"
    shapes = pass_choice.linear_shapes(model.learner.backbone)
    assert paths.cached("learn_pass", CPU, pass_choice.shape_class(shapes)) == "int8"
    timed.sampled.clear()
    for setting, expected in (("model", "model"), ("bfloat16", "bfloat16"), ("int8", "int8")):
        pinned = apply_faast(tiny_model("llama"), FaastConfig(output=ResidualOutput(step=0.5), learn_dtype=setting))
        assert pinned.learner.pass_precision(CPU) == expected
    assert not any(s.startswith("torch.") and s.split(".")[1] in paths.PATHS["learn_pass"] for s in timed.sampled)


def test_the_learn_pass_sample_runs_each_mode_on_the_models_own_linears(timed, monkeypatch):
    """Each distinct linear shape runs, in proportion to its count, under the mode being timed: float32 as the
    model's F.linear, bfloat16 under autocast, int8 through the int8 pass (its kernel chosen before it is timed)."""
    model = tiny_model("llama")
    shapes = pass_choice.linear_shapes(model.model)
    assert sorted((w.shape[1], w.shape[0], n) for w, n in shapes) == [(32, 16, 8), (32, 32, 8), (32, 64, 8),
                                                                      (64, 32, 4)]  # fmt: skip
    assert [r for _, r in pass_choice.sample_plan(shapes)] == [2, 2, 2, 1]
    seen: list[tuple[str, torch.dtype | None]] = []
    real = torch.nn.functional.linear

    def spy(x, weight, bias=None):  # noqa: ANN001, ANN202
        seen.append((x.dtype, torch.is_autocast_enabled("cpu")))
        return real(x, weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    timed.times = {"torch.float32": 1.0, "torch.bfloat16": 2.0, "torch.int8": 3.0}
    assert pass_choice.learn_pass_mode(shapes, 32, 24, CPU) == "float32"
    per_sample = sum(r for _, r in pass_choice.sample_plan(shapes))
    # One untimed call of each mode (float32, bfloat16, int8: the int8 kernels are chosen there), then the timed ones.
    assert len(seen) == 6 * per_sample
    blocks = [{autocast for _, autocast in seen[i * per_sample : (i + 1) * per_sample]} for i in range(6)]
    assert blocks == [{False}, {True}, {False}] * 2


def test_head_dtype_auto_on_a_cpu_takes_the_measured_products(timed):
    weight = torch.randn(61, 32)
    timed.times = {"torch.float32": 1.0, "torch.bfloat16": 0.5, "torch.int8": 0.8}
    assert head_module.products_dtype("auto", torch.zeros(2, 32), weight) == torch.bfloat16
    timed.sampled.clear()
    assert head_module.products_dtype("auto", torch.zeros(2, 32), weight) == torch.bfloat16 and not timed.sampled
    assert head_module.products_dtype("float32", torch.zeros(2, 32), weight) == torch.float32
    assert head_module.products_dtype("auto", torch.zeros(2, 32, dtype=torch.float64), weight) == torch.float32
    assert not timed.sampled


@pytest.mark.parametrize(("faster", "expected"), [("torch.pooled", "POOL_AUTO"), ("torch.exact", 0.0)])
def test_p_h_pooling_auto_is_timed_on_the_first_blocks_own_probabilities(timed, monkeypatch, faster, expected):
    seen = []
    real = head_module.head_gradients

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append(args[6])
        return real(*args, **kwargs)

    monkeypatch.setattr(head_module, "head_gradients", spy)
    import faast.hf.output.layer as output_module

    monkeypatch.setattr(output_module, "head_gradients", spy)
    timed.times = {"torch.exact": 1.0, "torch.pooled": 1.0, faster: 0.1}
    config = FaastConfig(output=ResidualOutput(step=0.5, head_dtype="float32"), learn_dtype="model")
    model = apply_faast(tiny_model("llama"), config)
    model.learn(ids(batch=2, seq=30))
    assert seen and all(s is None for s in seen)  # 'auto' on a CPU: measured inside head_gradients
    pool = OutputPolicy().pool_auto if expected == "POOL_AUTO" else expected
    assert model.learner.precision()["head_pool_below"] == pool
    assert [s for s in timed.sampled if "pool" in s or "exact" in s] == ["torch.exact", "torch.pooled"]


def test_the_hardware_report_measures_every_choice_and_writes_the_cache(timed, capsys):
    tiny = {"linears": [((32, 32), 8), ((32, 16), 8), ((64, 32), 4)], "hidden": 32, "vocab": 61,
            "key_widths": (32,), "gram_rows": 64}  # fmt: skip
    timed.times = {"torch.float32": 1.0, "torch.int8": 0.5, "torch.fbgemm": 0.3, "torch.int_mm": 0.6}
    info = report_module.report(tiny)
    ops = [c["op"] for c in info["choices"]]
    assert ops == ["learn_pass", "head_logits", "int8_linear", "int8_linear", "accumulate_gram", "eigh"]
    learn = info["choices"][0]
    assert learn["auto"] == "torch.int8" and not learn["from_cache"]
    assert learn["rates"]["torch.float32"] == pytest.approx(pass_choice.SAMPLE_ROWS / 4)  # 20 linears / 5 a sample
    assert paths.cached("learn_pass", CPU, learn["shape_class"]) == "int8"  # written to faast's cache
    again = report_module.report(tiny)["choices"][0]
    assert again["from_cache"] and again["auto"] == "torch.int8"
    text = report_module.format_report(info)
    assert "learn_pass" in text and "auto: int8" in text and hardware.cpu_model() in text
