"""The one-command GPU check (scripts/gpu_check.sh -> lab/benchmarks/gpu_check.py, goals in
lab/benchmarks/gpu_goals.py): its --smoke mode runs every step end to end on this CPU at tiny sizes (Triton
interpreter), with an interpreter that has neither faast nor the lab installed, as on the GPU machine; a crashing
test, a cut run and a spent budget still end in the report and the goals table; and the goals read the benchmarks'
files as documented."""

from __future__ import annotations

import json
import os
import runpy
import signal
import site
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
STEPS = ("build", "tests", "fidelity", "kernels", "eigh", "learn", "hf")
CHECK = "faast_lab.benchmarks.gpu_check"


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("FAAST_BACKEND", "FAAST_TRITON_AUTOTUNE", "PYTHONPATH")}


def _python_without_faast(folder: Path) -> str:
    """A virtual environment that sees this interpreter's packages (torch, triton, ...) but not faast: the GPU
    machine's situation (no install, no pip index). A .pth path line adds a folder without running its .pth files,
    so an editable install of faast stays invisible."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=120)
    python = folder / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    Path(purelib, "outer_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return str(python)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    pytest.importorskip("triton")
    pytest.importorskip("transformers")
    python = _python_without_faast(tmp_path_factory.mktemp("venv"))
    out = tmp_path_factory.mktemp("gpu_check")
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out), "--smoke"],
        env={**_env(), "PYTHON": python}, capture_output=True, text=True, timeout=1200, cwd="/",
    )  # fmt: skip
    return out, proc, python


def test_the_interpreter_of_the_smoke_run_cannot_import_faast_by_itself(smoke_run):
    _, _, python = smoke_run
    probe = subprocess.run([python, "-c", "import faast_kernels"], capture_output=True, text=True, cwd="/", env=_env())
    if probe.returncode == 0:
        pytest.skip("faast is installed as a regular package here: the PYTHONPATH fix is not exercised")
    assert "No module named 'faast_kernels'" in probe.stderr


def test_every_step_runs_and_the_outdir_holds_at_most_eight_files(smoke_run):
    out, proc, _ = smoke_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8, files
    assert {"gpu_check.json", "gpu_check.md", "gpu_check_log.txt.gz"} <= set(files)
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["smoke"] is True
    assert [s["step"] for s in report["steps"]] == list(STEPS)
    for step in report["steps"]:
        assert step["status"] in ("ok", "skipped"), step
        if step["status"] == "skipped":
            assert step["reason"], step
    # The build needs CUDA; without it the step says why instead of failing.
    build = report["steps"][0]
    assert build["status"] == "skipped" and "CUDA" in build["reason"]
    tests = report["steps"][1]
    assert len(tests["pytest"]) == 3 and all(p["ok"] for p in tests["pytest"])
    assert tests["pytest"][2]["counts"].get("passed", 0) > 0  # the unmarked native tests ran, one by one counted


def test_the_goals_table_is_printed_last(smoke_run):
    _, proc, _ = smoke_run
    tail = proc.stdout.rstrip().rsplit("## Goals", 1)
    assert len(tail) == 2, proc.stdout[-2000:]
    rows = [ln for ln in tail[1].splitlines() if ln.startswith("| ")]
    assert rows[0].startswith("| goal |") and len(rows) >= 10
    assert "Learn -> W" in tail[1] and "HF learning throughput" in tail[1] and "Batched float64 eigh" in tail[1]


def test_each_benchmark_left_a_json_with_the_machine_header_and_the_goals_are_not_judged(smoke_run):
    out, _, _ = smoke_run
    for prefix in ("kernels_", "eigh_", "learn_stack_", "triton_fidelity_", "hf_overhead_"):
        found = list(out.glob(f"{prefix}*.json"))
        assert len(found) == 1, (prefix, sorted(p.name for p in out.iterdir()))
        data = json.loads(found[0].read_text())
        machine = data["provenance"]  # faast.provenance's record
        for key in ("git_sha", "torch", "command", "loadavg_at_start", "cpu_model"):
            assert key in machine, (prefix, key)
    report = json.loads((out / "gpu_check.json").read_text())
    for key in ("git_sha", "torch", "command", "loadavg_at_start", "loadavg_at_end", "cpu_model"):
        assert key in report["provenance"], key
    assert report["goals"], "the goals table is empty"
    assert all(g["met"] is None for g in report["goals"])  # tiny CPU sizes prove nothing about the goals
    text = (out / "gpu_check.md").read_text()
    assert "## Goals" in text and "## kernels_smoke" in text


def test_the_smoke_run_measures_the_int8_gram_and_the_refined_eigh(smoke_run):
    """Issue 76's parts run in the dry run: the int8-slice Gram kernel (interpreted, its unscored case on the small
    smoke shape) in the kernels step, float32 eigh + refinement in the eigh step."""
    out, _, _ = smoke_run
    grams = json.loads(next(out.glob("kernels_*.json")).read_text())["gram"]
    assert any((r.get("triton_int8_noscores_s") or 0) > 0 for r in grams), grams
    records = json.loads(next(out.glob("eigh_*.json")).read_text())["records"]
    refined = [r for r in records if r.get("case", "").startswith("torch.refined")]
    assert refined and all(r.get("seconds", 0) > 0 and "error" not in r for r in refined), refined
    assert "bf16 composition / int8" in (out / "gpu_check.md").read_text()


def test_on_a_gpu_the_kernels_step_times_the_scored_int8_gram_and_the_goals_count_it_float64_grade():
    from faast_lab.benchmarks.bench_kernels import int8_cases
    from faast_lab.benchmarks.gpu_goals import float64_grade, gram_modes

    pytest.importorskip("triton")
    keys = values = torch.ones(1, 8, 4, dtype=torch.bfloat16)
    acc = (None, None, None)
    assert set(int8_cases(keys, values, torch.ones(1, 8), acc, True)) == {"triton_int8", "triton_int8_noscores"}
    big = torch.ones(1, 70, 40, dtype=torch.bfloat16)
    assert int8_cases(big, big, None, acc, False) == {}  # interpreted: the small smoke shape only
    assert float64_grade("triton_int8", set())
    _, modes = gram_modes(
        {"triton_int8_s": 1.0, "triton_int8_noscores_s": 0.5, "torch_bf16_composition_s": 0.2}, set()
    )
    assert modes == {"triton_int8": 1.0}


def test_the_learn_stack_records_every_backend_and_the_ones_that_cannot_run(smoke_run):
    out, _, _ = smoke_run
    data = json.loads(next(out.glob("learn_stack_*.json")).read_text())
    assert data["running"] is None  # no case was in flight when it ended
    assert set(data["solve"]) >= {"torch", "cupy", "cuda", "auto", "ridge"}
    assert "error" in data["solve"]["cuda"] and "cuda" in data["solve"]["cuda"]["error"]  # no GPU here: recorded
    assert data["solve"]["torch"]["eigh_s"] > 0
    ridge = data["solve"]["ridge"]
    assert ridge["rel_w_vs_eigh_path"] < 1e-8, ridge  # the fixed-ridge solve agrees with the eigh path
    assert data["gram"]["torch, compute float64"]["update_s"] > 0
    assert data["authors"]["stored keys, pinv"]["layers_measured"] >= 1
    assert data["speedup"] is not None and data["speedup_float64"] is not None


def test_a_failing_step_is_recorded_and_the_next_one_still_runs(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", CHECK, str(tmp_path), "--smoke", "--steps", "eigh,nope"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0 and "--steps: unknown ['nope']" in proc.stderr
    # The tests step's pytest gets an option it does not know (exit code 4, a usage error), then the eigh step must
    # still run, and both are recorded.
    env = {**_env(), "PYTEST_ADDOPTS": "--no-such-option-boom"}
    proc = subprocess.run(
        [sys.executable, "-m", CHECK, str(tmp_path), "--smoke", "--steps", "tests,eigh"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = {s["step"]: s for s in json.loads((tmp_path / "gpu_check.json").read_text())["steps"]}
    assert list(steps) == ["tests", "eigh"]
    assert steps["eigh"]["status"] == "ok"
    failed = steps["tests"]
    assert failed["status"] == "failed" and failed["exit_codes"] == [[4], [4], [4]] and "boom" in failed["tail"]


def test_a_crashing_test_is_named_and_the_tests_after_it_still_run(tmp_path):
    check = runpy.run_module(CHECK, run_name="gpu_check")  # defines, no main()
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_crash.py").write_text(
        "import os, signal\n"
        "def test_a():\n    pass\n"
        "def test_b():\n    os.kill(os.getpid(), signal.SIGSEGV)\n"
        "def test_c():\n    assert False\n"
        "def test_d():\n    pass\n"
    )
    console = check["Console"](None)
    argv = check["_pytest"]("test_crash.py")
    result = check["run_pytest"](argv, _env(), 120, console, isolate=True, cwd=tmp_path)
    crashed = [n.split("::")[-1] for n in result["crashed"]]
    assert crashed == ["test_b"]
    assert result["counts"] == {"passed": 2, "failed": 1}
    assert [n.split("::")[-1] for n in result["failed"]] == ["test_c"]
    assert result["exit_codes"][0] == -signal.SIGSEGV and not result["ok"]
    # Without isolation the crash ends the selection: test_c and test_d never run.
    result = check["run_pytest"](argv, _env(), 120, console, isolate=False, cwd=tmp_path)
    assert result["counts"] == {"passed": 1} and len(result["crashed"]) == 1


def test_a_spent_budget_and_a_signal_still_end_in_the_report_and_the_goals(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", CHECK, str(tmp_path / "a"), "--smoke", "--steps", "eigh,learn", "--budget-s", "1"],
        env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1
    steps = json.loads((tmp_path / "a" / "gpu_check.json").read_text())["steps"]
    assert [(s["step"], s["status"]) for s in steps] == [("eigh", "cut"), ("learn", "cut")]
    assert "budget of 1 s" in steps[0]["reason"]
    assert "## Goals" in proc.stdout.rsplit("## Steps", 1)[1]
    # SIGTERM while the learn step runs: the step is cut (its process group killed), the next one is not started.
    out = tmp_path / "b"
    proc = subprocess.Popen([sys.executable, "-m", CHECK, str(out), "--smoke", "--steps", "eigh,learn,hf"], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("== learn: "):
            proc.send_signal(signal.SIGTERM)
            break
    rest = proc.communicate(timeout=120)[0]
    assert proc.returncode == 1, "".join(lines) + rest
    steps = {s["step"]: s for s in json.loads((out / "gpu_check.json").read_text())["steps"]}
    assert steps["eigh"]["status"] == "ok"
    assert steps["learn"]["status"] == "cut" and "SIGTERM" in steps["learn"]["reason"]
    assert steps["hf"]["status"] == "cut"
    assert "| goal |" in rest.rsplit("## Goals", 1)[1]


def test_the_tests_step_names_only_files_that_exist(tmp_path):
    """The GPU run's test step passes its files to pytest by name: each must exist (a stale name fails the step)."""
    check = runpy.run_module(CHECK, run_name="gpu_check")
    for smoke in (False, True):
        commands = check["commands"]("tests", tmp_path, smoke, 60.0)
        named = [arg for command in commands for arg in command["argv"] if arg.startswith("tests/")]
        assert named, commands
        for name in named:
            assert (ROOT / name).exists(), name
        if not smoke:
            assert "tests/test_triton_kernels.py" in named and "tests/test_native.py" in named
            # test_native's gpu tests run apart and restart past a crash, so a segfault in the extension hides
            # nothing else; the other gpu tests leave them out.
            (native,) = [c["argv"] for c in commands if c.get("isolate")]
            assert native[-3:] == ["-m", "gpu", "tests/test_native.py"]
            assert "tests/test_native.py" not in commands[0]["argv"]
            assert "tests/test_triton_kernels.py" in commands[0]["argv"]  # it holds gpu-marked tests


def test_the_step_limits_fit_two_runs_in_a_device_lease():
    check = runpy.run_module(CHECK, run_name="gpu_check")
    assert set(check["LIMITS"]) == set(STEPS)
    assert sum(check["LIMITS"].values()) + check["REPORT_RESERVE_S"] <= check["BUDGET_S"] <= 330


# ---------------------------------------------------------------------------------------------------- the goals


def _write(folder: Path, name: str, payload: dict) -> None:
    (folder / name).write_text(json.dumps(payload))


def test_the_goals_read_each_benchmark_file(tmp_path):
    from faast_lab.benchmarks.gpu_goals import goals

    gram = {"n": 65536, "dk": 1600, "L": 1, "torch_bf16_composition_s": 1.0, "torch_backend_float64_s": 10.0,
            "torch_exact16_r4096_s": 0.5, "triton_tf32x3_s": 0.25, "triton_tf32x3_noscores_s": 0.1,
            "torch_float64_fused_rel_s": 1e-16, "torch_exact16_r4096_rel_s": 1e-5,
            "auto_choice": "torch_exact16_r4096"}  # fmt: skip
    _write(
        tmp_path, "kernels_x.json", {"gram": [gram], "residual": [{"rows": 8192, "d": 1600, "bf16m_vs_addmm": 0.9}]}
    )
    _write(tmp_path, "triton_fidelity_x.json", {"summary": {"torch.exact16 R=4096": {"pass": 26, "cases": 26},
                                                            "tf32x3": {"pass": 0, "cases": 26}}})  # fmt: skip
    eigh = [{"L": 48, "d": 1600, "case": "torch.linalg.eigh", "seconds": 1.0},
            {"L": 48, "d": 1600, "case": "faast cupy", "seconds": 0.25},
            {"L": 48, "d": 1600, "case": "cholesky solve", "seconds": 0.01},
            {"L": 48, "d": 64, "case": "torch.linalg.eigh", "seconds": 0.04},
            {"L": 48, "d": 64, "case": "faast cuda", "seconds": 0.002}]  # fmt: skip
    _write(tmp_path, "eigh_x.json", {"records": eigh})
    _write(tmp_path, "auto_choice_x.json", {"rows": [{"case": "eigh B=48 n=1600", "auto": "cupy", "fastest": "cupy"}]})
    _write(tmp_path, "learn_stack_x.json", {"speedup": 25.0, "speedup_float64": 10.0, "faast_best_setting": "s",
                                            "auto_check": [{"op": "eigh", "compute": "torch.float64", "auto": "torch",
                                                            "fastest": "cuda"}]})  # fmt: skip
    model = {"model": "m", "learn_vs_forward": 0.9, "read_overhead": 0.05, "read_overhead_per_token_s": 0.001,
             "generation_overhead": 0.02}  # fmt: skip
    _write(tmp_path, "hf_overhead_x.json", {"models": [model, {"model": "big", "skipped": "needs 9 GiB"}]})
    rows = {r["goal"]: r for r in goals(tmp_path)}

    def row(start: str) -> dict:
        return next(r for g, r in rows.items() if g.startswith(start))

    # tf32x3 is faster but fails fidelity; the noscores case is another workload; *_rel_s are errors, not times
    first = row("Gram N=65536")
    assert first["measured"] == pytest.approx(2.0) and first["met"] and "torch_exact16_r4096" in first["note"]
    assert row("Gram 48 x 8192")["measured"] is None and "no kernels record" in row("Gram 48 x 8192")["note"]
    assert row("Residual")["measured"] == 0.9 and row("Residual")["met"] is False
    auto = row("auto's choice")
    assert auto["measured"] == "2 / 3" and auto["met"] is False and "auto torch, fastest cuda" in auto["note"]
    big = row("Batched float64 eigh 48 x 1600")
    assert big["measured"] == pytest.approx(4.0) and big["met"] and big["note"] == "faast cupy"  # not Cholesky
    assert row("Batched float64 eigh 48 x 64")["measured"] == pytest.approx(20.0)
    assert row("Batched float64 eigh 48 x 64")["met"] is None  # reported, not judged
    assert row("Batched float64 eigh 48 x 256")["measured"] is None
    assert row("Learn -> W, 48 x 1600 stack, 64K tokens: vs the authors' algorithm (fastest")["met"] is True
    assert row("Learn -> W, 48 x 1600 stack, 64K tokens: vs the authors' algorithm (float64")["met"] is False
    assert row("HF learning throughput / the model's forward, m")["met"] is True
    assert row("HF read overhead per forward pass, m")["met"] is True  # 5% <= 10%
    assert row("HF read overhead per generated token (ms), m")["measured"] == pytest.approx(1.0)
    assert row("HF big")["note"] == "needs 9 GiB"
    # Without the fidelity file only float64 GEMMs count: the torch float64 backend against the composition.
    (tmp_path / "triton_fidelity_x.json").unlink()
    first = next(r for r in goals(tmp_path) if r["goal"].startswith("Gram N=65536"))
    assert first["measured"] == pytest.approx(0.1) and first["met"] is False


def test_the_hf_benchmark_runs_several_models_into_one_file_and_stops_at_its_budget(tmp_path):
    pytest.importorskip("transformers")
    proc = subprocess.run(
        [sys.executable, "-m", "faast_lab.benchmarks.bench_hf_overhead", "--model", "tiny", "tiny", "--smoke",
         "--budget-s", "0", "--out-dir", str(tmp_path)],
        env=_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads((tmp_path / "hf_overhead_shapes_smoke.json").read_text())
    first, second = data["models"]
    assert second == {"model": "tiny", "skipped": "time budget spent"}
    assert first["learn_vs_forward"] > 0 and first["solve_s"] > 0
    assert first["read_overhead"] == pytest.approx(
        first["median_s"]["forward with fast weights"] / first["median_s"]["full forward, base"] - 1
    )
    per_token = (first["median_s"]["generate with fast weights"] - first["median_s"]["generate, base"]) / 4
    assert first["read_overhead_per_token_s"] == pytest.approx(per_token)


def _hf_bench_on_tiny():  # noqa: ANN202 - (bench_hf_overhead, FaastModel, [2, 64] int64 batch, token ids)
    """lab/benchmarks/bench_hf_overhead.py, imported, with its tiny Llama and a batch of its tokens."""
    pytest.importorskip("transformers")
    import torch

    from faast_lab.benchmarks import bench_hf_overhead as bench

    model, ids, _ = bench.load("tiny")
    return bench, model, torch.tensor(ids[:128]).reshape(2, 64), ids


def test_the_hf_benchmark_reads_with_the_memory_on_and_says_when_it_forced_a_step():
    # A memory left off by tuning returns the head's logits untouched, so a read case must force a step to time a
    # read (gpu_h100_run5.md: runs 4 and 5 timed reads of a memory that was off). Here step 0 leaves it off for sure.
    bench, model, batch, ids = _hf_bench_on_tiny()
    import torch

    with torch.no_grad():
        model.learn(ids[128 : 128 + 8 * 64], max_length=64, batch_size=2)
    output = model.output_memory_layer
    output.step = 0.0
    forced: list[str] = []
    cases = bench.timed_cases(model, batch, new_tokens=2, forced=forced)
    setup, _ = cases["forward with fast weights"]
    setup()
    assert forced == [output.space] and output.chosen_step() == bench.FORCED_STEP
    with torch.no_grad():
        read = model(input_ids=batch).logits
        with model.disable_faast():
            base = model(input_ids=batch).logits
    assert (read - base).abs().max() > 1e-3  # the memory was read
    relearn, _ = cases["solve after a learned batch"]
    relearn()
    assert output.step == 0.0  # the solve case keeps the configured setting
    setup, _ = cases["forward with fast weights, logit space"]
    setup()
    assert forced == ["probability", "logit"] and output.space == "logit"


def test_the_hf_benchmark_times_exact_p_h_beside_the_shipped_pooling_and_restores_it(monkeypatch):
    # What pooling p·H saves is measured in the same rounds as the shipped learning: the exact case sets the
    # layer's threshold to 0 and every other learn case puts the shipped setting back before it runs.
    from faast.hf.output.head import head_weight, pool_threshold, products_dtype

    bench, model, batch, _ = _hf_bench_on_tiny()
    output = model.output_memory_layer
    assert output.head_pool_below == "auto"
    cases = bench.timed_cases(model, batch, new_tokens=2)
    seen = []
    real = output.gradients

    def record(keys, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        # the threshold the layer's gradients hands head_gradients for these keys, under its settings now
        products = products_dtype(output.head_dtype, keys, head_weight(output.head))
        seen.append(pool_threshold(output.head_pool_below, products, keys, output.policy))
        return real(keys, *args, **kwargs)

    monkeypatch.setattr(output, "gradients", record)
    for name, pool in ((bench.EXACT_PH, 0.0), ("learn, float64 statistics", None)):
        setup, run = cases[name]
        setup()
        seen.clear()
        run(None)
        assert seen and set(seen) == {pool}, name  # on a CPU 'auto' is timed inside head_gradients (None)
    rows = bench.overhead_rows({name: 1.0 for name in cases}, tokens=128, new_tokens=2)
    assert ["learn, float64 statistics", bench.EXACT_PH] == rows[2][:2]


def test_the_hf_benchmark_switches_the_learning_pass_dtype_the_learner_reads(monkeypatch):
    # The learner keeps its own copy of learn_dtype: a case that switched only the config's timed the shipped pass
    # under the label of the model's dtype. Here 'auto' is pinned to bfloat16 (as where it measures fastest), so
    # 'auto' and 'model' must differ.
    monkeypatch.setenv("FAAST_BACKEND", "learn_pass=torch.bfloat16")
    bench, model, batch, _ = _hf_bench_on_tiny()
    cases = bench.timed_cases(model, batch, new_tokens=2)
    for name, pass_dtype in (("learn, the model's dtype (learn_dtype='model')", "float32"),
                             ("learn, float64 statistics", "bfloat16")):  # fmt: skip
        setup, _ = cases[name]
        setup()
        assert model.learner.precision()["learn_pass"] == pass_dtype, name


def test_the_hf_benchmark_times_the_float32_pass_with_float32_and_int8_head_logits_and_the_int8_pass(monkeypatch):
    # What a CPU without native bfloat16 runs, three ways, in the same rounds: each case learns in its pass dtype with
    # its head dtype, and every other learn case puts the shipped one back.
    bench, model, batch, _ = _hf_bench_on_tiny()
    output = model.output_memory_layer
    cases = bench.timed_cases(model, batch, new_tokens=2)
    seen = []
    real = output.gradients

    def record(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append((model.learner.precision()["learn_pass"], output.head_dtype))
        return real(*args, **kwargs)

    monkeypatch.setattr(output, "gradients", record)
    for name, want in ((bench.FP32_HEAD, ("float32", "float32")), (bench.INT8_HEAD, ("float32", "int8")),
                       (bench.INT8_PASS, ("int8", "int8")),
                       ("learn, float64 statistics", (model.learner.precision()["learn_pass"], "auto"))):  # fmt: skip
        setup, run = cases[name]
        setup()
        seen.clear()
        run(None)
        assert seen and set(seen) == {want}, name
    rows = bench.overhead_rows({name: 1.0 for name in cases}, tokens=128, new_tokens=2)
    assert [bench.INT8_HEAD, bench.FP32_HEAD] in [r[:2] for r in rows]
    assert [bench.INT8_PASS, bench.INT8_HEAD] in [r[:2] for r in rows]


def test_benchmarks_skip_only_what_autos_gates_keep_out_on_a_gpu():
    # On a lent GPU a case auto's gate keeps out (measured there to fail or lose) costs minutes and tells nothing new,
    # so the benchmarks skip it unless --all-cases; off a GPU nothing is gated, so smoke runs keep every case.
    import torch

    from faast.ops import backends
    from faast_lab.benchmarks import _harness as H

    cuda = torch.device("cuda")

    class H100Call(backends.Call):  # a call on an sm_90 device, as the gates see it
        capability = property(lambda self: (9, 0))

    def eigh(d: int, device: torch.device = cuda) -> backends.Call:
        return backends.Call("eigh", device, (torch.float64,), ((48, d, d),))

    def gram(compute: torch.dtype) -> backends.Call:
        return H100Call("accumulate_gram", cuda, (torch.bfloat16, torch.bfloat16), options={"compute_dtype": compute})

    with backends.assume_loadable("cupy", "triton"):  # as on the GPU machine, where both load
        note = H.gated("eigh", "cupy", eigh(1600))
        assert note.startswith("auto's gate: ") and "measured slower than torch.linalg.eigh" in note
        assert note.endswith("(--all-cases runs it)")
        assert H.gated("eigh", "cupy", eigh(256)) is None
        assert H.gated("eigh", "cupy", eigh(1600, torch.device("cpu"))) is None
        assert "does not compile on sm_90" in H.gated("accumulate_gram", "triton", gram(torch.float64))
        assert H.gated("accumulate_gram", "triton", gram(torch.float32)) is None


def test_a_steps_output_names_no_folder_of_the_machine_that_ran_it(tmp_path):
    # The report and the log are committed: paths in the checkout are written relative to it, the home folder as ~.
    check = runpy.run_module(CHECK, run_name="gpu_check")  # defines, no main()
    console = check["Console"](tmp_path / "log.txt")
    inside, home = ROOT / "csrc" / "faast_ops.cpp", Path.home() / ".cache" / "x"
    code, output = check["run_command"](
        [sys.executable, "-c", f"print({str(inside)!r}); print({str(home)!r})"], dict(os.environ), 60, console
    )
    console.close()
    assert code == 0 and output.splitlines() == ["csrc/faast_ops.cpp", "~/.cache/x"]
    assert (tmp_path / "log.txt").read_text().splitlines() == output.splitlines()
