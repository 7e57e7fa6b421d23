"""faast.distributed: gloo processes on loopback give the single-process statistics; bad setups fail every rank."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import faast
from dist_workers import NUM_BATCHES, Layers, learn, run
from faast import distributed
from faast.checkpoint import Checkpointer
from tolerances import REORDER_REL, rel

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def _spawn(world_size: int, scenario: str = "shards", bucket_mb: float = 256.0) -> dict[int, object]:
    """Run `world_size` ranks; returns {rank: saved dict or error text}."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = str(Path(tmp) / "init")
        procs = [
            ctx.Process(target=run, args=(r, world_size, init_file, tmp, scenario, bucket_mb))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
        assert not alive, f"{len(alive)} rank(s) hung (a collective was not joined by every rank)"
        results = {}
        for r in range(world_size):
            err = Path(tmp) / f"rank{r}.err"
            results[r] = err.read_text() if err.exists() else torch.load(Path(tmp) / f"rank{r}.pt")
        return results


def _check_against_single_process(results: dict, num_batches: int) -> None:
    errors = {r: v for r, v in results.items() if isinstance(v, str)}
    assert not errors, errors
    expected = Layers()
    learn(expected, range(num_batches))
    state = {k: v for k, v in expected.state_dict().items() if not k.startswith("head.")}
    for r, got in results.items():
        assert set(got["state"]) == set(state)
        for name, t in state.items():
            if t.is_floating_point():
                assert rel(got["state"][name], t) <= REORDER_REL, (r, name)
            else:
                assert torch.equal(got["state"][name], t), (r, name)  # counters are exact
        for name, m in distributed.find_memories(expected, faast.FastWeights):
            assert rel(got["weights"][f"{name}.W"], m.weights.to(torch.float64)) <= 1e-9, (r, name)
    # Every rank must hold bitwise the same result, or ranks would serve different weights.
    for r in results:
        for name, t in results[0]["state"].items():
            assert torch.equal(results[r]["state"][name], t), (r, name)


@pytest.mark.parametrize(
    ("world_size", "bucket_mb"),
    [(2, 256.0), (3, 0.001)],  # 0.001 MiB forces many buckets and lone tensors larger than a bucket
    ids=["2-ranks", "3-ranks-small-buckets"],
)
def test_ranks_equal_single_process(world_size, bucket_mb):
    results = _spawn(world_size, bucket_mb=bucket_mb)
    _check_against_single_process(results, NUM_BATCHES)
    assert int(results[0]["state"]["output.num_dropped"]) == 1  # the NaN row of batch 3, dropped on one rank
    # The Accumulator was summed too: its count is every row of every rank's shard.
    assert float(results[0]["state"]["sums.count"]) == sum(5 + 3 * i for i in range(NUM_BATCHES))


def test_rank_with_empty_shard():
    results = _spawn(3, scenario="empty")  # 2 batches on 3 ranks: rank 2 learns nothing
    _check_against_single_process(results, 2)
    assert list(distributed.shard(range(2), rank=2, world_size=3)) == []


def test_mismatched_ranks_fail_everywhere_without_hanging():
    results = _spawn(2, scenario="mismatch")
    for r, v in results.items():
        assert isinstance(v, str), f"rank {r} reduced mismatched memories"
        assert v.startswith("ValueError: obj: ranks hold memories with different"), v


def test_blend_on_one_rank_fails_every_rank():
    results = _spawn(2, scenario="blend")
    assert results[1].startswith("ValueError: obj: memory blocks.1 has mode='blend'"), results[1]
    assert results[0].startswith("ValueError: obj: ranks hold memories with different"), results[0]


def test_torchrun_example_equals_single_process(tmp_path):
    example = Path(__file__).resolve().parents[1] / "examples" / "distributed_learn.py"
    common = ["--batches", "7", "--rows", "50", "--dim", "12", "--dim-value", "3", "--every", "2"]
    runs = {
        "torchrun": [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "3",
            str(example),
        ],
        "single": [sys.executable, str(example)],
    }
    for name, cmd in runs.items():
        args = [*common, "--out", str(tmp_path / f"{name}.safetensors"), "--checkpoint-dir", str(tmp_path / name)]
        done = subprocess.run(cmd + args, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    sharded = faast.FastWeights.load(tmp_path / "torchrun.safetensors")
    single = faast.FastWeights.load(tmp_path / "single.safetensors")
    assert float(sharded.count) == float(single.count) == 350
    assert rel(sharded.gram, single.gram) <= REORDER_REL and rel(sharded.cross, single.cross) <= REORDER_REL
    assert rel(sharded.weights, single.weights) <= 1e-6  # float32 weights
    # Each rank checkpointed its own shard: 7 batches over 3 ranks are 3, 2 and 2.
    for rank, batches in enumerate([3, 2, 2]):
        newest = Checkpointer(tmp_path / "torchrun", rank=rank, world_size=3).checkpoints()[0]
        assert newest == Checkpointer(tmp_path / "torchrun", rank=rank, world_size=3).path(batches)


# ---------------------------------------------------------------------------------------------------- in-process


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _count_collectives(monkeypatch) -> list[torch.Tensor]:
    calls = []
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor)
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", counting)
    return calls


def test_one_collective_per_bucket_not_per_layer(world_of_one, monkeypatch):
    layers = torch.nn.ModuleList([faast.FastWeights(8, 4) for _ in range(24)])
    for m in layers:
        m.update(torch.randn(5, 8), torch.randn(5, 4))
    before = {k: v.clone() for k, v in layers.state_dict().items()}
    calls = _count_collectives(monkeypatch)
    distributed.all_reduce(layers)
    # The agreement probe, one float64 bucket for 96 tensors, one int64 bucket for the 24 dropped-row counters.
    assert len(calls) == 3
    assert calls[1].dtype == torch.float64 and calls[1].numel() == 24 * (64 + 32 + 1 + 1)
    for k, v in layers.state_dict().items():
        assert torch.equal(v, before[k]), k  # a world of one sums to itself, bit for bit


def test_large_tensor_is_reduced_in_place(world_of_one, monkeypatch):
    memory = faast.FastWeights(64, 64)
    memory.update(torch.randn(100, 64), torch.randn(100, 64))
    calls = _count_collectives(monkeypatch)
    distributed.all_reduce(memory, bucket_mb=16 * 1024 / 2**20)  # 16 KiB: gram and cross (32 KiB) go alone
    assert any(t is memory.gram for t in calls) and any(t is memory.cross for t in calls)


def test_reduce_marks_the_memory_changed(world_of_one):
    memory = faast.FastWeights(6, 3)
    memory.update(torch.randn(10, 6), torch.randn(10, 3))
    version = memory.version
    distributed.all_reduce(memory)
    assert memory.version > version  # cached weights are recomputed from the reduced statistics


def test_not_initialized_raises():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="not initialized.*init_process_group"):
        distributed.all_reduce(faast.FastWeights(4, 2))


@pytest.mark.parametrize(
    ("obj", "error", "match"),
    [
        (torch.nn.Linear(2, 2), ValueError, "holds no faast.FastWeights"),
        ("memory", TypeError, "expected a faast.FastWeights, an nn.Module"),
        ([faast.FastWeights(4, 2), torch.nn.Linear(2, 2)], TypeError, "found a Linear"),
    ],
)
def test_bad_objects(world_of_one, obj, error, match):
    with pytest.raises(error, match=match):
        distributed.all_reduce(obj)


def test_bad_bucket_size(world_of_one):
    with pytest.raises(ValueError, match="bucket_mb: expected a positive number"):
        distributed.all_reduce(faast.FastWeights(4, 2), bucket_mb=0)


def test_accumulators_are_reduced_with_the_memories(world_of_one, monkeypatch):
    model = torch.nn.ModuleDict({"memory": faast.FastWeights(6, 3), "sums": faast.Accumulator({"mass": (5,)})})
    model["memory"].update(torch.randn(10, 6), torch.randn(10, 3))
    model["sums"].add(count=10, mass=torch.rand(5))
    version = model["sums"].version
    calls = _count_collectives(monkeypatch)
    distributed.all_reduce(model)
    # The probe, one float64 bucket (S, T, N, yy of the memory; the sum and count of the accumulator), one int64.
    assert len(calls) == 3 and calls[1].numel() == 36 + 18 + 1 + 1 + 5 + 1
    assert model["sums"].version > version


def test_find_memories_finds_both_kinds_and_filters_by_kind():
    model = torch.nn.ModuleDict({"memory": faast.FastWeights(4, 2), "sums": faast.Accumulator({"mass": (3,)})})
    assert [n for n, _ in distributed.find_memories(model)] == ["memory", "sums"]
    assert [n for n, _ in distributed.find_memories(model, faast.FastWeights)] == ["memory"]
    assert [n for n, _ in distributed.find_memories(model, faast.Accumulator)] == ["sums"]
    assert [n for n, _ in distributed.find_memories([model["sums"], model["memory"]], faast.FastWeights)] == ["1"]
    with pytest.raises(ValueError, match="holds no faast.Accumulator"):
        distributed.find_memories(faast.FastWeights(4, 2), faast.Accumulator)
    with pytest.raises(TypeError, match="kind: expected faast.SummedStatistics"):
        distributed.find_memories(model, torch.nn.Linear)


def test_shared_memory_is_summed_once():
    shared = faast.FastWeights(4, 2)
    model = torch.nn.ModuleDict({"a": shared, "b": torch.nn.Sequential(shared)})
    assert [n for n, _ in distributed.find_memories(model)] == ["a"]
    assert len(distributed.find_memories([shared, shared])) == 1


def test_shard_streams_and_validates():
    assert list(distributed.shard(range(10), rank=1, world_size=3)) == [1, 4, 7]
    assert list(distributed.shard(iter(range(3)))) == [0, 1, 2]  # no process group: the whole stream
    with pytest.raises(ValueError, match=r"rank: expected an int in \[0, 2\)"):
        list(distributed.shard(range(3), rank=2, world_size=2))
    with pytest.raises(ValueError, match="world_size: expected a positive int"):
        list(distributed.shard(range(3), rank=0, world_size=0))
