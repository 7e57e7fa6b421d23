"""The server's memories folder (faast.serve.memories): least recently used memories leave the model and come back
bit for bit; a commit interrupted at any point (an exception standing in for a crash, and a real SIGKILL of the server
during a learn) leaves the folder with the old memory or the new one; learning jobs past the cap are refused."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from faast.hf.default import load_base_model  # noqa: E402
from faast.serve import memories as memories_module  # noqa: E402
from faast.serve.app import create_app  # noqa: E402
from faast.serve.memories import COMMIT, STAGING, MemoryHouse  # noqa: E402
from serve_server import PROMPT, TEXTS, Reference, Server, checkpoint, free_port  # noqa: E402

MORE = ["the cat ate fish from a blue bowl. " * 10]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("house") / "tiny")


def house(ckpt, folder, cap=2):
    base, tokenizer, _ = load_base_model(ckpt)
    return MemoryHouse(base, tokenizer, folder, max_resident=cap)


def logits(model, name, tokenizer):
    x = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    with torch.no_grad():
        return model(x, memory_names=[name]).logits


def test_least_recently_used_memories_are_evicted_and_reload_bit_for_bit(ckpt, tmp_path):
    h = house(ckpt, tmp_path / "m", cap=1)
    h.learn("a", TEXTS["a"], create=True)
    first = logits(h.model, "a", h.tokenizer)
    h.learn("b", TEXTS["b"], create=True)
    assert list(h.resident) == ["b"] and "a" not in h.model.memories
    assert h.info("a")["resident"] is False and h.info("b")["resident"] is True
    h.make_resident(["a"])
    assert list(h.resident) == ["a"] and "b" not in h.model.memories
    assert torch.equal(logits(h.model, "a", h.tokenizer), first)
    # a restart serves what was committed, bit for bit
    again = house(ckpt, tmp_path / "m", cap=1)
    assert again.names == ["a", "b"] and again.info("a")["tokens"] == len(TEXTS["a"][0])
    again.make_resident(["a"])
    assert torch.equal(logits(again.model, "a", again.tokenizer), first)


def reference_logits(ckpt, steps):
    ref = Reference(ckpt)
    for texts in steps:
        ref.learn("a", texts)
    return logits(ref.model, "a", ref.tokenizer)


CRASHES = {  # where the commit of a learn stops, and what the folder holds after a restart
    "before COMMIT is written": ("write_text_atomic", COMMIT, "old"),
    "after COMMIT, before any rename": ("recover", None, "new"),
    "between the renames": ("replace", 2, "new"),
}


@pytest.mark.parametrize("where", list(CRASHES))
def test_a_commit_interrupted_anywhere_leaves_the_old_or_the_new_memory(ckpt, tmp_path, monkeypatch, where):
    h = house(ckpt, tmp_path / "m")
    h.learn("a", TEXTS["a"], create=True)
    what, arg, expect = CRASHES[where]
    if what == "write_text_atomic":
        real_write = memories_module.write_text_atomic

        def write(path, text):
            if path.name == arg:
                raise OSError("crash")
            return real_write(path, text)

        monkeypatch.setattr(memories_module, "write_text_atomic", write)
    elif what == "recover":
        monkeypatch.setattr(memories_module, "recover", lambda folder: (_ for _ in ()).throw(OSError("crash")))
    else:
        real_move, calls = memories_module._move, []

        def move(a, b):
            calls.append(a)
            if len(calls) == arg:
                raise OSError("crash")
            return real_move(a, b)

        monkeypatch.setattr(memories_module, "_move", move)
    with pytest.raises(OSError, match="crash"):
        h.learn("a", MORE, create=False)
    assert "a" not in h.model.memories  # what the folder does not hold is not served
    monkeypatch.undo()
    again = house(ckpt, tmp_path / "m")
    assert not (tmp_path / "m" / STAGING).exists()
    again.make_resident(["a"])
    steps = [TEXTS["a"]] if expect == "old" else [TEXTS["a"], MORE]
    assert torch.equal(logits(again.model, "a", again.tokenizer), reference_logits(ckpt, steps))


def test_a_server_killed_during_a_learn_restarts_with_the_old_or_the_new_memory(ckpt, tmp_path):
    server = Server(ckpt, tmp_path / "m")
    try:
        with server.http() as http:
            assert http.post("/v1/memories", json={"name": "a", "texts": TEXTS["a"]}).status_code == 201

        def learn() -> None:
            try:
                with server.http() as http:
                    http.post("/v1/memories/a/learn", json={"texts": MORE * 20})
            except Exception:  # noqa: BLE001 - the server is killed under it
                pass

        thread = threading.Thread(target=learn)
        thread.start()
        time.sleep(random.uniform(0.2, 2.0))
        server.kill()
        thread.join(timeout=60)
    finally:
        server.stop()
    again = house(ckpt, tmp_path / "m")
    assert again.names == ["a"]
    again.make_resident(["a"])
    now = logits(again.model, "a", again.tokenizer)
    assert torch.equal(now, reference_logits(ckpt, [TEXTS["a"]])) or torch.equal(
        now, reference_logits(ckpt, [TEXTS["a"], MORE * 20])
    )


def test_learning_jobs_past_the_cap_are_refused_with_429_and_change_nothing(ckpt, tmp_path):
    import httpx2 as httpx

    h = house(ckpt, tmp_path / "m")
    h.learn("a", TEXTS["a"], create=True)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(h, base="tiny", max_learning=1), host="127.0.0.1", port=port,
                                           log_level="warning"))  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            if server.started:
                break
            time.sleep(0.1)
        answers = {}
        with h.lock:  # the first job takes the one slot and waits for the model
            first = threading.Thread(target=lambda: answers.setdefault("first", httpx.post(
                url + "/v1/memories/a/learn", json={"texts": MORE}, timeout=120)))  # fmt: skip
            first.start()
            time.sleep(1.0)
            second = httpx.post(url + "/v1/memories", json={"name": "b", "texts": MORE}, timeout=120)
            assert second.status_code == 429 and second.json()["error"]["message"].startswith("learning:")
        first.join(timeout=120)
        assert answers["first"].status_code == 200
        assert h.names == ["a"]
    finally:
        server.should_exit = True
        thread.join(timeout=30)
