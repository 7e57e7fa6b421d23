"""docs/results.md is generated from the result records by scripts/results_tables.py: it must match them, and the
check must catch a record that changed without its table. JSON only: no model is loaded."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="the section list is TOML: Python 3.11 reads it")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "results_tables.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def sections() -> list[dict]:
    return tomllib.loads((ROOT / "docs" / "results_sections.toml").read_text())["section"]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of what the generator reads: the section list, docs/results.md and every record the sections name."""
    for rel in [
        "docs/results_sections.toml",
        "docs/results.md",
        *(r for s in sections() for r in s["records"] + s.get("logs", [])),
    ]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    return tmp_path


def test_results_md_matches_its_records() -> None:
    done = run("--check")
    assert done.returncode == 0, done.stderr


def test_check_names_the_section_whose_record_changed(tree: Path) -> None:
    assert run("--check", "--root", str(tree)).returncode == 0
    record = tree / "lab/benchmarks/results/cpu_paths_amd_epyc_avx2.json"
    payload = json.loads(record.read_text())
    payload["best_tokens_per_s"]["auto"] *= 0.5
    record.write_text(json.dumps(payload))
    done = run("--check", "--root", str(tree))
    assert done.returncode == 1
    assert "The CPU's learning paths, measured on the machine" in done.stderr
    assert "The language-model demo" not in done.stderr
    run("--root", str(tree))  # regenerating makes it current again
    assert run("--check", "--root", str(tree)).returncode == 0


def test_check_names_a_section_edited_by_hand(tree: Path) -> None:
    doc = tree / "docs/results.md"
    doc.write_text(doc.read_text().replace("## A stream of 10^8 rows\n\n", "## A stream of 10^8 rows\n\nEdited. "))
    done = run("--check", "--root", str(tree))
    assert done.returncode == 1 and "A stream of 10^8 rows" in done.stderr


def load_script():  # noqa: ANN201
    spec = importlib.util.spec_from_file_location("results_tables", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_section_names_existing_records_and_a_known_kind() -> None:
    module = load_script()
    for section in sections():
        assert section["kind"] in module.FORMATTERS, section["title"]
        assert all((ROOT / r).is_file() and r.endswith(".json") for r in section["records"]), section["title"]
        assert len(section["protocol"].strip().split("\n\n")) == 1, f"{section['title']}: one paragraph of protocol"


def test_unused_reads_file_names_stems_braces_and_globs() -> None:
    words, globs = load_script().names_in(
        "see `demo_{default,float32}_intel_cpu.{json,txt}`, lm_output_pool_*_validation_cpu.md and "
        "[x](lab/benchmarks/results/gpu_h100_run1_log.txt.gz); lm_stream_bias0.5_email_cpu."
    )
    assert {
        "demo_default_intel_cpu",
        "demo_float32_intel_cpu",
        "gpu_h100_run1_log",
        "lm_stream_bias0.5_email_cpu",
    } <= words
    assert "demo_default_intel_cpu_run2" not in words
    assert globs == ["lm_output_pool_*_validation_cpu.md"]


def anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    return "".join(c for c in title.lower() if c.isalnum() or c in " -_").replace(" ", "-")


def test_links_into_results_md_name_its_sections() -> None:
    anchors = {anchor(s["title"]) for s in sections()}
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    links = {(d.name, a) for d in docs for a in re.findall(r"results\.md#([\w-]+)", d.read_text())}
    assert {(name, a) for name, a in links if a not in anchors} == set()


def test_every_result_file_is_referred_to() -> None:
    # A run no table, doc, code or kept record names is history, which git keeps: it leaves the tree.
    done = run("--unused")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "", f"result files nothing refers to:\n{done.stdout}"


def test_unused_lists_a_planted_result_file(tree: Path) -> None:
    planted = tree / "lab/benchmarks/results/planted_run_nobody_names.json"
    planted.write_text("{}")
    subprocess.run(["git", "init", "-q", str(tree)], check=True)  # --unused reads what git tracks or would track
    done = run("--unused", "--root", str(tree))
    assert done.returncode == 0, done.stderr
    assert "lab/benchmarks/results/planted_run_nobody_names.json" in done.stdout.splitlines()
