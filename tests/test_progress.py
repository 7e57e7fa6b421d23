"""Progress (faast/hf/progress.py): learn() and read_stream() show a bar on stderr from the second batch when asked,
none with progress=False or for one batch, never anything on stdout; its total (hence the time left) from the input's
size; and a solve over a second says so."""

from __future__ import annotations

import re
import sys

import pytest
import torch

from faast.hf import FaastConfig, ResidualOutput, apply_faast
from faast.hf import progress as progress_module
from hf_models import tiny_model


def _model():  # noqa: ANN202
    return apply_faast(tiny_model("llama"), FaastConfig(output=ResidualOutput(step=0.5)))


def _texts(n: int = 5, length: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 60, (length,), generator=g).tolist() for _ in range(n)]


def test_a_bar_on_stderr_when_asked_and_nothing_on_stdout(capsys):
    stats = _model().learn(_texts(), max_length=16, batch_size=2, progress=True)
    out, err = capsys.readouterr()
    assert out == ""
    assert "faast learn" in err and "tok" in err
    assert re.search(rf"{stats.tokens}(\.0)?/{stats.tokens}(\.0)? ", err)  # the exact total of token-id lists


def test_no_bar_with_progress_false_or_for_one_batch(capsys):
    model = _model()
    model.learn(_texts(), max_length=16, batch_size=2, progress=False)
    model.learn(_texts(1, 10), max_length=16, batch_size=2, progress=True)  # one batch
    assert capsys.readouterr() == ("", "")


def test_the_default_follows_whether_stderr_is_a_terminal(monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert progress_module.enabled(None) is False
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert progress_module.enabled(None) is True
    assert progress_module.enabled(False) is False
    with pytest.raises(ValueError, match="progress: expected True, False or None"):
        progress_module.enabled("yes")


def test_the_total_of_texts_is_estimated_from_their_characters():
    meter = progress_module.Metered(["abcd", "ef", "ghij"])
    assert meter.total == 10 and meter.fraction() == 0
    it = iter(meter)
    next(it)
    assert meter.fraction() == pytest.approx(0.4)
    list(it)
    assert meter.fraction() == 1.0
    assert progress_module.Metered(iter(["abc"])).fraction() is None  # unsized: no total, no time left
    assert progress_module.Metered([{"input_ids": torch.zeros(2, 5)}]).total == 10


def test_a_bar_estimates_its_total_from_the_share_done(monkeypatch):
    opened = []

    class FakeBar:
        def __init__(self, **kwargs):  # noqa: ANN003
            self.kwargs, self.total, self.n = kwargs, None, kwargs["initial"]
            opened.append(self)

        def update(self, n):  # noqa: ANN001, ANN202
            self.n += n

        def close(self):  # noqa: ANN202
            pass

    monkeypatch.setattr(progress_module, "_open", lambda desc, initial, total: FakeBar(desc=desc, initial=initial))
    bar = progress_module.Bar(True, "faast learn")
    bar.update(100, 0.1)
    assert not opened  # one batch: no bar
    bar.update(100, 0.25)
    (fake,) = opened
    assert fake.n == 200 and fake.total == 800
    bar.close()


def test_read_stream_shows_a_bar_with_the_exact_total(capsys):
    model = _model()
    ids = torch.randint(3, 60, (70,), generator=torch.Generator().manual_seed(1))
    model.read_stream(ids, chunk=16, progress=True)
    out, err = capsys.readouterr()
    assert out == "" and "faast read" in err and re.search(r"69(\.0)?/69(\.0)? ", err)
    model.read_stream(ids, chunk=16, progress=False, memory="other")
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize("progress", [True, False])
def test_a_slow_solve_says_so_on_stderr_only_when_asked(monkeypatch, capsys, progress):
    monkeypatch.setattr(progress_module, "SLOW_SOLVE_S", -1.0)  # every solve counts as slow
    model = _model()
    model.learn(_texts(), max_length=16, batch_size=2, progress=False)
    model.solve(progress=progress)
    out, err = capsys.readouterr()
    assert out == ""
    assert ("faast: solving the output memory took" in err) is progress


def test_the_first_learn_says_once_what_it_measured_and_only_when_asked(timed, capsys):
    timed.times = {"torch.float32": 1.0, "torch.bfloat16": 2.0, "torch.int8": 0.5}
    _model().learn(_texts(), max_length=16, batch_size=2, progress=False)
    assert capsys.readouterr() == ("", "")  # measured, not said
    timed.path.unlink()
    from faast.ops import _autotune

    _autotune.forget_memory()
    model = _model()
    model.learn(_texts(), max_length=16, batch_size=2, progress=True)
    said = [line for line in capsys.readouterr().err.splitlines() if "measured this CPU's learning paths" in line]
    assert len(said) == 1 and "pass int8, head logits int8" in said[0]
    model.learn(_texts(), max_length=16, batch_size=2, progress=True)  # cached: nothing more to say
    assert "measured this CPU" not in capsys.readouterr().err


def test_scoring_shows_a_bar_when_asked(capsys):
    from faast.hf.evaluate import perplexity

    windows = _texts(6, 20)
    quiet = perplexity(_model(), windows, batch_size=2, progress=False)
    assert capsys.readouterr() == ("", "")
    shown = perplexity(_model(), windows, batch_size=2, progress=True)
    out, err = capsys.readouterr()
    assert out == "" and "faast score" in err and re.search(r"120(\.0)?/120(\.0)? ", err)
    assert shown.nll == quiet.nll and shown.tokens == quiet.tokens
