"""faast.checkpoint: resume == uninterrupted (bitwise), atomic writes survive kills, loading never runs code."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest
import torch

import faast
from faast.checkpoint import Checkpointer, learn_stream, load_checkpoint

NUM_BATCHES = 10


def make_batch(i: int, dk: int = 9, dv: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + i)
    n = 3 + 2 * i
    return (
        torch.randn(n, dk, generator=g, dtype=torch.float64),
        torch.randn(n, dv, generator=g, dtype=torch.float64),
        torch.rand(n, generator=g, dtype=torch.float64),
    )


def stream(start: int = 0, stop: int = NUM_BATCHES, crash_at: int | None = None):
    for i in range(start, stop):
        if i == crash_at:
            raise KeyboardInterrupt(f"simulated crash before batch {i}")
        yield make_batch(i)


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


MEMORIES = {
    "exact": lambda: faast.FastWeights(9, 4),
    "discount": lambda: faast.FastWeights(9, 4, discount=0.9, alpha="auto"),
    "blend": lambda: faast.FastWeights(9, 4, mode="blend", blend_window=20, blend_chunk=8),
}


@pytest.mark.parametrize("kind", sorted(MEMORIES))
def test_resume_is_bitwise_uninterrupted(tmp_path, kind):
    uninterrupted = MEMORIES[kind]()
    full = learn_stream(uninterrupted, stream())
    assert full["batches"] == NUM_BATCHES and full["rows"] == sum(3 + 2 * i for i in range(NUM_BATCHES))

    crashed = MEMORIES[kind]()
    with pytest.raises(KeyboardInterrupt):
        learn_stream(crashed, stream(crash_at=7), checkpoint_dir=tmp_path, every=3)
    resumed = MEMORIES[kind]()  # a fresh process: nothing but the files survives
    position = learn_stream(resumed, stream(), checkpoint_dir=tmp_path, every=3)
    assert position["resumed_from"] == 6
    assert (position["batches"], position["rows"]) == (full["batches"], full["rows"])
    assert_same_state(resumed, uninterrupted)
    assert torch.equal(resumed.weights, uninterrupted.weights)


def test_seekable_source_starts_at_the_resume_point(tmp_path):
    starts = []

    def source(start):
        starts.append(start)
        return stream(start)

    memory = faast.FastWeights(9, 4)
    with pytest.raises(KeyboardInterrupt):
        learn_stream(memory, lambda start: stream(start, crash_at=5), checkpoint_dir=tmp_path, every=2)
    resumed = faast.FastWeights(9, 4)
    learn_stream(resumed, source, checkpoint_dir=tmp_path, every=2)
    assert starts == [4]
    expected = faast.FastWeights(9, 4)
    learn_stream(expected, stream())
    assert_same_state(resumed, expected)


def test_module_with_several_memories_and_custom_step(tmp_path):
    def build():
        model = torch.nn.ModuleDict(
            {"a": faast.FastWeights(9, 4), "b": faast.FastWeights(9, 9, batch_shape=(2,), prior="identity")}
        )
        model.head = torch.nn.Linear(3, 3)  # not a memory: not checkpointed
        return model

    def step(model, batch):
        keys, values, scores = batch
        model["a"].update(keys, values, scores)
        model["b"].update(torch.stack([keys, 2 * keys]), torch.stack([keys, keys]))
        return keys.shape[0]

    expected = build()
    learn_stream(expected, stream(), step=step)
    with pytest.raises(KeyboardInterrupt):
        learn_stream(build(), stream(crash_at=4), step=step, checkpoint_dir=tmp_path, every=1)
    resumed = build()
    learn_stream(resumed, stream(), step=step, checkpoint_dir=tmp_path, every=1)
    for name in ("a", "b"):
        assert_same_state(resumed[name], expected[name])


def test_keep_prunes_old_checkpoints(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=2)
    learn_stream(faast.FastWeights(9, 4), stream(), checkpointer=ckpt, every=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "checkpoint-rank00000-batch000000000000008.safetensors",
        "checkpoint-rank00000-batch000000000000010.safetensors",
    ]


def test_every_seconds_checkpoints_by_time(tmp_path, monkeypatch):
    clock = iter(range(0, 10_000, 7))  # each monotonic() call advances 7 s
    # faast.checkpoint's own clock only (its `time` name), so that nothing else's monotonic() calls move it.
    monkeypatch.setattr("faast.checkpoint.time", types.SimpleNamespace(monotonic=lambda: next(clock)))
    learn_stream(faast.FastWeights(9, 4), stream(), checkpoint_dir=tmp_path, every=None, every_seconds=10, keep=100)
    # Start at 0 s; each batch reads the clock once and each save once more: batch 1 at 7 s (7 since the last save),
    # batch 2 at 14 s (14: save, clock 21), batch 3 at 28 s (7), batch 4 at 35 s (14: save), ... so every second
    # batch is saved, the last (10) included, and no extra final save is needed.
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f"checkpoint-rank00000-batch{b:015d}.safetensors" for b in (2, 4, 6, 8, 10)]


def test_corrupt_newest_falls_back_to_the_previous(tmp_path, caplog):
    with pytest.raises(KeyboardInterrupt):
        learn_stream(faast.FastWeights(9, 4), stream(crash_at=9), checkpoint_dir=tmp_path, every=4, keep=3)
    newest = Checkpointer(tmp_path).checkpoints()[0]
    assert newest.name.endswith("000000000008.safetensors")
    blob = bytearray(newest.read_bytes())
    blob[-5] ^= 0xFF  # one flipped bit of statistics
    newest.write_bytes(bytes(blob))
    resumed = faast.FastWeights(9, 4)
    with caplog.at_level(logging.WARNING, logger="faast"):
        position = learn_stream(resumed, stream(), checkpoint_dir=tmp_path, every=4, keep=3)
    assert position["resumed_from"] == 4
    assert "skipping unreadable checkpoint" in caplog.text and newest.name in caplog.text
    expected = faast.FastWeights(9, 4)
    learn_stream(expected, stream())
    assert_same_state(resumed, expected)


def test_all_corrupt_raises(tmp_path):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(faast.FastWeights(9, 4), {"batches": 1})
    ckpt.checkpoints()[0].write_bytes(b"\x00" * 40)
    with pytest.raises(ValueError, match="no intact checkpoint for rank 0"):
        ckpt.restore(faast.FastWeights(9, 4))


def test_loading_never_executes_code(tmp_path):
    marker = tmp_path / "executed"

    class Exploit:
        def __reduce__(self):
            return (Path.touch, (marker,))

    ckpt = Checkpointer(tmp_path)
    ckpt.path(5).parent.mkdir(parents=True, exist_ok=True)
    ckpt.path(5).write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(ValueError, match="no intact checkpoint"):
        ckpt.restore(faast.FastWeights(9, 4))
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_checkpoint(ckpt.path(5), faast.FastWeights(9, 4))
    assert not marker.exists()


def test_mismatched_object_is_refused_and_left_untouched(tmp_path):
    ckpt = Checkpointer(tmp_path)
    source = torch.nn.ModuleDict({"a": faast.FastWeights(9, 4), "b": faast.FastWeights(9, 4)})
    for m in source.values():
        m.update(*make_batch(0)[:2])
    ckpt.save(source, {"batches": 1})
    target = torch.nn.ModuleDict({"a": faast.FastWeights(9, 4), "b": faast.FastWeights(9, 5)})
    with pytest.raises(ValueError, match=r"memory b\).*dim_value=4, this memory has 5"):
        ckpt.restore(target)
    assert float(target["a"].count) == 0  # all or nothing: 'a' would have fitted, but nothing was loaded
    with pytest.raises(ValueError, match=r"holds memories \['a', 'b'\], the object being restored has \['a'\]"):
        ckpt.restore(torch.nn.ModuleDict({"a": faast.FastWeights(9, 4)}))


def test_world_size_must_match_to_resume(tmp_path):
    Checkpointer(tmp_path, rank=1, world_size=2).save(faast.FastWeights(9, 4), {"batches": 3})
    assert Checkpointer(tmp_path, rank=0, world_size=2).restore(faast.FastWeights(9, 4)) is None  # other rank's
    with pytest.raises(ValueError, match="world_size=2, this run has 3"):
        Checkpointer(tmp_path, rank=1, world_size=3).restore(faast.FastWeights(9, 4))
    memory = faast.FastWeights(9, 4)
    assert load_checkpoint(Checkpointer(tmp_path, rank=1, world_size=2).path(3), memory) == {"batches": 3}


def test_stale_temporaries_are_removed_on_restore(tmp_path):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(faast.FastWeights(9, 4), {"batches": 2})
    stale = tmp_path / f".{ckpt.path(4).name}.12345.deadbeef.tmp"
    stale.write_bytes(b"half a file")
    other = tmp_path / ".unrelated.tmp"
    other.write_bytes(b"")
    assert ckpt.restore(faast.FastWeights(9, 4)) == {"batches": 2}
    assert not stale.exists() and other.exists()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"keep": 0}, ValueError, "keep"),
        ({"name": "a/b"}, ValueError, "name: expected letters"),
        ({"rank": 2, "world_size": 2}, ValueError, r"rank: expected an int in \[0, 2\)"),
    ],
)
def test_checkpointer_arguments(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        Checkpointer(tmp_path, **kwargs)


def test_save_and_stream_arguments(tmp_path):
    ckpt = Checkpointer(tmp_path)
    memory = faast.FastWeights(9, 4)
    with pytest.raises(ValueError, match="non-negative int 'batches'"):
        ckpt.save(memory, {"rows": 3})
    with pytest.raises(ValueError, match="JSON-serialisable"):
        ckpt.save(memory, {"batches": 1, "when": object()})
    with pytest.raises(TypeError, match="step: required to learn into a ModuleDict"):
        learn_stream(torch.nn.ModuleDict({"a": memory}), stream())
    with pytest.raises(ValueError, match="a dict batch needs 'keys' and 'values'"):
        learn_stream(memory, [{"keys": torch.ones(2, 9), "valuez": torch.ones(2, 4)}])
    with pytest.raises(TypeError, match="each batch must be"):
        learn_stream(memory, [torch.ones(2, 9)])
    assert list(tmp_path.iterdir()) == []


def test_dict_batches_with_mask_count_real_rows():
    keys, values, scores = make_batch(3)
    mask = torch.arange(keys.shape[0]) % 3 != 0
    memory = faast.FastWeights(9, 4)
    position = learn_stream(memory, [{"keys": keys, "values": values, "scores": scores, "mask": mask}])
    assert position["rows"] == int(mask.sum()) == int(memory.count)


def test_counts_stay_exact_past_32_bits():
    memory = faast.FastWeights(3, 2)
    memory.count.fill_(2**32 - 1)
    memory.update(torch.randn(5, 3), torch.randn(5, 2))
    assert float(memory.count) == 2**32 + 4  # float64 counts are exact integers up to 2^53 rows
    memory.count.fill_(2**53 - 8)
    memory.update(torch.randn(5, 3), torch.randn(5, 2))
    assert float(memory.count) == 2**53 - 3


_WRITER = textwrap.dedent(
    """
    import sys, torch, faast
    from faast.checkpoint import Checkpointer
    ckpt = Checkpointer(sys.argv[1], keep=3)
    memory = faast.FastWeights(1024, 1024)  # 16 MB files: most of the loop's time is spent writing
    step = 0
    while True:
        step += 1
        memory.update(torch.ones(1, 1024), torch.ones(1, 1024))  # count == step, gram == step everywhere
        ckpt.save(memory, {"batches": step, "rows": step})
        if step == 2:
            print("ready", flush=True)
    """
)


@pytest.mark.parametrize("delay", [0.05, 0.3])
def test_killed_writer_leaves_an_intact_latest_checkpoint(tmp_path, delay, caplog):
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    memory = faast.FastWeights(1024, 1024)
    with caplog.at_level(logging.WARNING, logger="faast"):
        position = Checkpointer(tmp_path, keep=3).restore(memory)
    assert "skipping" not in caplog.text  # the newest file is intact: no fallback was needed
    assert position is not None and position["batches"] >= 2
    assert float(memory.count) == position["rows"]
    assert torch.equal(memory.gram, torch.full((1024, 1024), float(position["rows"]), dtype=torch.float64))
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


_DIES_MID_WRITE = textwrap.dedent(
    """
    import os, sys, torch, faast
    from faast.checkpoint import Checkpointer

    def half_then_die(fd):
        # The first durability barrier of the third save, the fsync of the temporary file that holds the whole
        # checkpoint: keep only the first half of its bytes and kill the process, as a crash in the middle of the
        # write would. No cleanup code runs, and the rename never happens.
        os.ftruncate(fd, os.fstat(fd).st_size // 2)
        os._exit(9)

    ckpt = Checkpointer(sys.argv[1])
    memory = faast.FastWeights(64, 8)
    for step in (1, 2, 3):
        memory.update(torch.ones(1, 64), torch.ones(1, 8))
        if step == 3:
            os.fsync = half_then_die
        ckpt.save(memory, {"batches": step, "rows": step})
    """
)


def test_crash_in_the_middle_of_a_write_keeps_the_previous_checkpoint(tmp_path, caplog):
    done = subprocess.run([sys.executable, "-c", _DIES_MID_WRITE, str(tmp_path)], timeout=120)
    assert done.returncode == 9
    torn = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert torn  # the torn temporary file is there
    intact = [p for p in tmp_path.iterdir() if p.name.endswith(".safetensors")]
    assert torn[0].stat().st_size < min(p.stat().st_size for p in intact)  # it really holds only part of the bytes
    memory = faast.FastWeights(64, 8)
    with caplog.at_level(logging.WARNING, logger="faast"):
        position = Checkpointer(tmp_path).restore(memory)
    assert "skipping" not in caplog.text  # no torn file under a checkpoint name
    assert position == {"batches": 2, "rows": 2} and float(memory.count) == 2
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
