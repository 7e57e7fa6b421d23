"""auto's measured choice (faast.ops._dispatch + faast.ops._autotune), with a fake timer: which candidate wins, the
cache file it writes and reads, a corrupt cache file, a candidate that fails while timed, and the overrides."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from faast import ops
from faast.ops import _autotune, _dispatch, reference

CPU = torch.device("cpu")


@pytest.fixture
def world(monkeypatch, tmp_path):
    """A registry of torch plus a fake 'triton' backend for eigh on the CPU, a fresh cache folder, and a fake timer
    that reports the seconds in `world.times` by candidate name and counts the samples it ran."""
    monkeypatch.setattr(
        _dispatch, "_REGISTRY", {"torch": _dispatch.Backend("torch", dict(_dispatch._REGISTRY["torch"].ops))}
    )
    monkeypatch.setattr(_dispatch, "_PREFERENCE", {"cpu": ("triton", "torch")})
    monkeypatch.setattr(_dispatch, "_logged", set())
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    monkeypatch.delenv(_autotune.ENABLE_ENV, raising=False)
    monkeypatch.setenv(_autotune.CACHE_ENV, str(tmp_path / "cache" / "autotune.json"))
    _autotune.forget_memory()

    class World:
        times: dict[str, float] = {}
        sampled: list[str] = []
        path = tmp_path / "cache" / _autotune.FILE_NAME

    def fake_eigh(gram):
        lam, vecs = torch.linalg.eigh(gram)
        return lam + 1000.0, vecs  # recognisable: proves which candidate ran

    World.fake_eigh = staticmethod(fake_eigh)
    _dispatch.register_backend(_dispatch.Backend("triton", {"eigh": fake_eigh}))

    def factory(device):
        def timer(name, run):
            World.sampled.append(name)
            run()
            return World.times[name]

        return timer

    _autotune.set_timer(factory)
    yield World
    _autotune.set_timer(None)
    _autotune.forget_memory()


def _gram(b: int = 3, d: int = 6) -> torch.Tensor:
    k = torch.randn(b, 4 * d, d, dtype=torch.float64)
    return k.mT @ k


def test_auto_keeps_the_faster_candidate_and_writes_the_choice(world):
    world.times = {"triton": 2.0, "torch": 1.0}
    gram = _gram()
    lam, _ = ops.eigh_gram(gram)
    assert world.sampled == ["triton", "torch"]
    torch.testing.assert_close(lam, torch.linalg.eigvalsh(gram), rtol=1e-12, atol=0)  # torch ran, not the fake
    data = json.loads(world.path.read_text())
    ((context, entries),) = data["entries"].items()
    assert context == _autotune.context_key(CPU) and f"torch {torch.__version__}" in context
    ((key, entry),) = entries.items()
    assert key.startswith("eigh ") and entry == {"choice": "torch", "seconds": {"triton": 2.0, "torch": 1.0}}


def test_the_other_candidate_wins_when_it_is_faster(world):
    world.times = {"triton": 0.5, "torch": 1.0}
    gram = _gram()
    lam, _ = ops.eigh_gram(gram)
    torch.testing.assert_close(lam, torch.linalg.eigvalsh(gram) + 1000.0, rtol=1e-12, atol=0)


def test_a_remembered_choice_is_not_measured_again_even_in_a_new_process(world):
    world.times = {"triton": 0.5, "torch": 1.0}
    ops.eigh_gram(_gram())
    _autotune.forget_memory()  # what a new process knows: only the file
    world.sampled.clear()
    world.times = {"triton": 9.0, "torch": 1.0}  # would flip the choice if it were measured again
    lam, _ = ops.eigh_gram(_gram())
    assert world.sampled == []
    assert float(lam.min()) > 999.0
    # Another shape class is measured on its own.
    ops.eigh_gram(_gram(d=9))
    assert world.sampled == ["triton", "torch"]


def test_a_corrupt_cache_file_is_ignored_with_one_warning_and_rewritten(world):
    world.path.parent.mkdir(parents=True)
    world.path.write_text("{ not json")
    world.times = {"triton": 2.0, "torch": 1.0}
    with pytest.warns(RuntimeWarning, match="ignoring the autotune cache .*autotune.json"):
        ops.eigh_gram(_gram())
    assert json.loads(world.path.read_text())["format"] == _autotune.FORMAT


@pytest.mark.parametrize("content", ['{"format": 99, "entries": {}}', "[1, 2]", '{"format": 1, "entries": 3}'])
def test_a_cache_file_of_another_layout_is_ignored_with_a_warning(world, content):
    world.path.parent.mkdir(parents=True)
    world.path.write_text(content)
    world.times = {"triton": 0.5, "torch": 1.0}
    with pytest.warns(RuntimeWarning, match="ignoring the autotune cache"):
        lam, _ = ops.eigh_gram(_gram())
    assert float(lam.min()) > 999.0


def test_a_candidate_that_fails_while_timed_is_dropped_and_logged_once(world, caplog):
    def broken(gram):
        raise RuntimeError("PassManager::run failed")

    _dispatch.register_backend(_dispatch.Backend("triton", {"eigh": broken}))
    world.times = {"triton": 0.1, "torch": 1.0}
    with caplog.at_level(logging.INFO, logger="faast"):
        for d in (5, 7):
            gram = _gram(d=d)
            lam, _ = ops.eigh_gram(gram)
            torch.testing.assert_close(lam, torch.linalg.eigvalsh(gram), rtol=1e-12, atol=0)
    failed = [r.getMessage() for r in caplog.records if "failed while being timed" in r.getMessage()]
    assert len(failed) == 1 and "PassManager::run failed" in failed[0]
    entry = next(iter(json.loads(world.path.read_text())["entries"].values()))
    assert all(v["choice"] == "torch" and v["seconds"]["triton"].startswith("failed") for v in entry.values())


def test_faast_backend_overrides_the_measured_choice(world, monkeypatch):
    world.times = {"triton": 0.5, "torch": 1.0}
    monkeypatch.setenv(_dispatch.ENV_VAR, "eigh=torch")
    lam, _ = ops.eigh_gram(_gram())
    assert world.sampled == [] and float(lam.min()) < 999.0
    assert not world.path.exists()


def test_measuring_off_takes_the_first_eligible_candidate(world, monkeypatch):
    monkeypatch.setenv(_autotune.ENABLE_ENV, "0")
    world.times = {"triton": 2.0, "torch": 1.0}
    lam, _ = ops.eigh_gram(_gram())
    assert world.sampled == [] and float(lam.min()) > 999.0
    monkeypatch.setenv(_autotune.ENABLE_ENV, "maybe")
    with pytest.raises(ValueError, match="FAAST_AUTOTUNE: expected 0 or 1"):
        ops.eigh_gram(_gram())


def test_gated_candidates_are_not_timed(world, caplog):
    _dispatch.register_backend(
        _dispatch.Backend("triton", {"eigh": world.fake_eigh}, gate=lambda op, call: "fails fidelity here")
    )
    world.times = {"triton": 0.1, "torch": 1.0}
    with caplog.at_level(logging.INFO, logger="faast"):
        lam, _ = ops.eigh_gram(_gram())
    assert world.sampled == [] and float(lam.min()) < 999.0
    assert any("skips the triton backend: fails fidelity here" in r.getMessage() for r in caplog.records)


def test_variants_compete_and_can_be_requested_by_name(world, monkeypatch):
    calls = []

    def variant(keys, values, scores, mask, **options):
        calls.append(keys.shape)
        return reference.accumulate_gram_streaming(keys, values, scores, mask, **options)

    _dispatch.register_variant(
        "torch", "accumulate_gram", "alt", variant,
        cannot_run=lambda call: None if call.device.type == "cpu" else "CPU only",
    )  # fmt: skip
    world.times = {"torch": 1.0, "torch.alt": 0.5}
    keys, values = torch.randn(2, 50, 4), torch.randn(2, 50, 3)
    gram, cross = ops.accumulate_gram(keys, values)
    assert world.sampled == ["torch", "torch.alt"] and calls[-1] == (2, 50, 4)  # sampled, then the real call
    torch.testing.assert_close(gram, keys.double().mT @ keys.double())
    # FAAST_BACKEND=torch lets the backend's own candidates compete; torch.alt asks for exactly that one.
    monkeypatch.setenv(_dispatch.ENV_VAR, "accumulate_gram=torch.alt")
    assert _dispatch.resolve("accumulate_gram", CPU)[0] == "torch.alt"
    with pytest.raises(RuntimeError, match="torch.alt was requested for accumulate_gram on cuda, but CPU only"):
        _dispatch.resolve("accumulate_gram", torch.device("cuda"))
    monkeypatch.setenv(_dispatch.ENV_VAR, "accumulate_gram=torch.nope")
    with pytest.raises(RuntimeError, match=r"has no variant 'nope' of accumulate_gram \(it has: \['alt'\]\)"):
        _dispatch.resolve("accumulate_gram", CPU)


def test_register_variant_rejects_bad_names(world):
    with pytest.raises(ValueError, match="backend: expected a registered backend"):
        _dispatch.register_variant("cudnn", "eigh", "x", lambda g: g)
    with pytest.raises(ValueError, match="variant: expected a non-empty name"):
        _dispatch.register_variant("torch", "eigh", "a.b", lambda g: g)


def test_size_classes_share_a_choice_within_a_factor_of_two():
    assert [_autotune.size_class(n) for n in (0, 1, 3, 4, 5, 8192, 8193)] == [0, 1, 4, 4, 8, 8192, 16384]


def test_a_backend_whose_only_variants_cannot_run_the_call_raises_when_requested(world, monkeypatch):
    _dispatch.register_backend(_dispatch.Backend("cupy"))
    _dispatch.register_variant("cupy", "eigh", "gpu_only", lambda g: torch.linalg.eigh(g), cannot_run=lambda c: "no")
    monkeypatch.setenv(_dispatch.ENV_VAR, "eigh=cupy")
    with pytest.raises(RuntimeError, match="none of the cupy backend's variants of eigh can run this call"):
        _dispatch.resolve("eigh", CPU)


@pytest.mark.parametrize(("rows", "sampled_rows", "size_class"), [(1500, 1024, 1024), (300, 300, 512)])
def test_the_mixture_is_timed_on_one_whole_read_chunk(world, rows, sampled_rows, size_class):
    # The fused kernel's time hardly shrinks below a GPU's worth of rows, so a smaller sample than the 1,024-row
    # chunks a read sends would misjudge it (lab/benchmarks/results/gpu_h100_run5.md): the sample is the call's rows up
    # to one chunk.
    seen: list[int] = []

    def fake_mixture(z, dz, log_odds, log_rest, full, scale):
        seen.append(z.shape[0])
        return torch.zeros_like(z)

    _dispatch.register_backend(_dispatch.Backend("triton", {"mix_probabilities": fake_mixture}))
    world.times = {"triton": 0.5, "torch": 1.0}
    z, dz = torch.randn(rows, 7), torch.randn(rows, 7)
    odds, rest = torch.zeros(rows), torch.full((rows,), -0.5)
    out = ops.mix_probabilities(z, dz, odds, rest)
    assert world.sampled == ["triton", "torch"]
    assert seen == [sampled_rows, rows]  # the timed sample, then the call itself on the chosen candidate
    assert torch.equal(out, torch.zeros_like(z))
    ((key, entry),) = next(iter(json.loads(world.path.read_text())["entries"].values())).items()
    assert key.startswith(f"mix_probabilities rows{size_class} V7 ") and entry["choice"] == "triton"
