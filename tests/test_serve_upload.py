"""`faast serve` learning from files, with progress streamed: a file uploaded (multipart, with the openai client and
httpx) or sent as a bare text makes the memory that posting the same text makes, and the one FaastModel.learn makes in
one call, bit for bit, though the server learns it a batch at a time; streamed progress events count up to the total
and end with the committed memory's record; a file too large, empty or not UTF-8 is a 4xx naming the field, and an
error in the middle of a streamed learn is an error event with the folder unchanged."""

from __future__ import annotations

import json
import random
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pytest.importorskip("python_multipart")

from faast.hf import FaastModel  # noqa: E402
from faast.hf.default import load_base_model  # noqa: E402
from faast.serve import memories as memories_module  # noqa: E402
from faast.serve.app import create_app  # noqa: E402
from faast.serve.memories import MemoryHouse  # noqa: E402
from faast.serve.pieces import BATCH_SIZE, MAX_LENGTH  # noqa: E402
from serve_server import NAME, PROMPT, TEXTS, Reference, Server, checkpoint, free_port  # noqa: E402

WORDS = "the cat sat on a mat and was happy bird flew over river in morning my dog likes long walks park".split()


def long_text(seed: int, chars: int) -> str:
    """A text of about `chars` characters (= tokens: the tiny tokenizer is one of characters) from the tests' words."""
    rng, words = random.Random(seed), []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rng.choice(WORDS))
    return " ".join(words) + "."


def learned_tokens(text: str) -> int:
    """The tokens learn() counts for `text`: its characters, and the token each two of its windows share twice."""
    windows = -(-(len(text) - 1) // (MAX_LENGTH - 1))
    return len(text) + windows - 1


# Longer than two batches of windows (a text of 2.5 batches: the server learns it in 3 pieces, one cut mid-text).
LONG = long_text(0, int(2.5 * BATCH_SIZE * (MAX_LENGTH - 1)))
MORE = long_text(1, 3000)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-upload")
    ckpt = checkpoint(folder / "tiny")
    limits = ["--max-body-bytes", "100000", "--max-text-chars", "60000"]
    server = Server(ckpt, folder / "memories", *limits)
    try:
        yield server, ckpt, folder / "memories"
    finally:
        server.stop()


def folder_state(folder):
    return (folder / "faast_manifest.json").read_bytes(), (folder / "faast_serve.json").read_bytes()


def saved(ckpt, folder, names, x):
    """The logits of each memory of `names` as committed in the server's folder, read by a fresh FaastModel."""
    model = FaastModel.from_pretrained(load_base_model(ckpt)[0], folder)
    with torch.no_grad():
        return [model(x, memory_names=[n]).logits for n in names]


def saved_statistics(folder, name):
    from safetensors.torch import load_file

    return load_file(str(folder / "memories" / f"{name}.safetensors"))


def events(response):
    """The JSON events of a server-sent-event response, and whether it ended with [DONE]."""
    out, done = [], False
    for line in response.iter_lines():
        if line.startswith("data: "):
            if line == "data: [DONE]":
                done = True
            else:
                out.append(json.loads(line[len("data: ") :]))
    return out, done


def test_a_file_learns_what_posting_its_text_learns_and_what_one_learn_call_gives_bit_for_bit(setup):
    server, ckpt, folder = setup
    client = server.openai()
    with server.http() as http:
        up = http.post("/v1/memories", data={"name": "up"}, files={"file": ("long.txt", LONG.encode(), "text/plain")})
        assert up.status_code == 201, up.text
        assert up.json()["tokens"] == up.json()["record"]["tokens"] == learned_tokens(LONG)
        posted = http.post("/v1/memories", json={"name": "posted", "texts": [LONG]})
        assert posted.status_code == 201 and posted.json()["tokens"] == up.json()["tokens"]
        plain = http.post("/v1/memories", params={"name": "plain"}, content=LONG.encode(),
                          headers={"content-type": "text/plain; charset=utf-8"})  # fmt: skip
        assert plain.status_code == 201, plain.text
    reference = Reference(ckpt)
    reference.learn("one", [LONG])  # one learn() call over the whole text
    x = torch.tensor([reference.tokenizer(PROMPT)["input_ids"]])
    with torch.no_grad():
        expected = reference.model(x, memory_names=["one"]).logits
    for logits in saved(ckpt, folder, ["up", "posted", "plain"], x):
        assert torch.equal(logits, expected)
    first, second = saved_statistics(folder, "up"), saved_statistics(folder, "posted")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    answer = client.completions.create(model=f"{NAME}:up", prompt=PROMPT, max_tokens=12).choices[0].text
    assert answer == reference.complete("one")
    # forget takes files too: learn more from one and forget it, as FaastModel.learn and forget do, bit for bit
    with server.http() as http:
        more = {"file": ("more.txt", MORE.encode(), "text/plain")}
        assert http.post("/v1/memories/up/learn", files=more).status_code == 200
        reference.learn("one", [MORE])
        with torch.no_grad():
            assert torch.equal(saved(ckpt, folder, ["up"], x)[0], reference.model(x, memory_names=["one"]).logits)
        forgot = http.post("/v1/memories/up/forget", files=more)
        assert forgot.status_code == 200 and forgot.json()["tokens"] == learned_tokens(MORE), forgot.text
    reference.model.forget([MORE], tokenizer=reference.tokenizer, memory="one")
    reference.model.solve(memories=["one"])
    with torch.no_grad():
        assert torch.equal(saved(ckpt, folder, ["up"], x)[0], reference.model(x, memory_names=["one"]).logits)


def check_progress(stream_events, total_tokens=None):
    """Progress events with tokens rising to a constant total, then solving and saving, then the learned record."""
    *progress, last = stream_events
    learning = [e for e in progress if e["phase"] == "learning"]
    assert all(e["object"] == "memory.progress" for e in progress)
    assert [e["phase"] for e in progress] == ["learning"] * len(learning) + ["solving", "saving"]
    tokens = [e["tokens"] for e in learning]
    assert tokens == sorted(set(tokens)) and tokens[-1] == learning[0]["total_tokens"]
    assert len({e["total_tokens"] for e in progress}) == 1
    assert all(e["tokens_per_second"] > 0 and e["seconds_left"] >= 0 for e in learning)
    assert learning[-1]["seconds_left"] == 0
    assert last["object"] == "memory.learned" and last["tokens"] == tokens[-1]
    if total_tokens is not None:
        assert last["record"]["tokens"] == total_tokens
    return learning


def test_streamed_progress_rises_to_the_total_and_ends_with_the_record(setup):
    server, ckpt, folder = setup
    client = server.openai()
    # the openai client: a file upload with stream=true, read as an openai Stream
    stream = client.post(
        "/memories",
        cast_to=object,
        body={"name": "streamed", "stream": "true"},
        files=[("file", ("long.txt", LONG.encode(), "text/plain"))],
        options={"headers": {"Content-Type": "multipart/form-data"}},
        stream=True,
        stream_cls=openai.Stream[object],
    )
    learning = check_progress(list(stream), total_tokens=learned_tokens(LONG))
    assert len(learning) == 3  # 2.5 batches of windows: one event per batch
    # httpx, JSON with "stream": true, learning more into it: the record counts both learns
    with server.http() as http:
        with http.stream("POST", "/v1/memories/streamed/learn", json={"texts": [MORE], "stream": True}) as answer:
            assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
            got, done = events(answer)
        assert done
        check_progress(got, total_tokens=learned_tokens(LONG) + learned_tokens(MORE))
        listed = {m["name"]: m for m in http.get("/v1/memories").json()["data"]}
    assert listed["streamed"]["tokens"] == learned_tokens(LONG) + learned_tokens(MORE)
    reference = Reference(ckpt)
    reference.learn("one", [LONG])
    reference.learn("one", [MORE])
    x = torch.tensor([reference.tokenizer(PROMPT)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(saved(ckpt, folder, ["streamed"], x)[0], reference.model(x, memory_names=["one"]).logits)


BAD = [  # (path, request keywords, status, the field named)
    ("/v1/memories", {"data": {"name": "bad"}, "files": {"file": ("a.txt", b"", "text/plain")}}, 400, "file"),
    ("/v1/memories", {"data": {"name": "bad"}, "files": {"file": ("a.txt", b" \n\t ", "text/plain")}}, 400, "file"),
    (
        "/v1/memories",
        {"data": {"name": "bad"}, "files": {"file": ("a.txt", b"the cat \xff\xfe", "text/plain")}},
        400,
        "file",
    ),  # fmt: skip
    (
        "/v1/memories",
        {"data": {"name": "bad", "file": "the cat"}, "files": {"x": ("a.txt", b"a", "text/plain")}},
        400,
        "x",
    ),  # fmt: skip
    (
        "/v1/memories",
        {"data": {"name": "bad", "stream": "yes"}, "files": {"file": ("a.txt", b"the cat")}},
        400,
        "stream",
    ),  # fmt: skip
    ("/v1/memories", {"data": {"name": "../bad"}, "files": {"file": ("a.txt", b"the cat")}}, 400, "name"),
    ("/v1/memories/up/learn", {"data": {"name": "up"}, "files": {"file": ("a.txt", b"the cat")}}, 400, "name"),
    ("/v1/memories", {"files": {"file": ("big.txt", b"the cat. " * 12_000, "text/plain")}}, 413, "body"),
    ("/v1/memories", {"data": {"name": "bad"}, "files": {"file": ("big.txt", b"a" * 70_000)}}, 413, "file"),
    (
        "/v1/memories",
        {"params": {"name": "bad"}, "content": b"", "headers": {"content-type": "text/plain"}},
        400,
        "body",
    ),  # fmt: skip
    (
        "/v1/memories",
        {"params": {"name": "bad"}, "content": b"\xc3\x28", "headers": {"content-type": "text/plain"}},
        400,
        "body",
    ),  # fmt: skip
    (
        "/v1/memories",
        {"params": {"name": "bad", "colour": "red"}, "content": b"the cat", "headers": {"content-type": "text/plain"}},
        400,
        "colour",
    ),  # fmt: skip
    ("/v1/memories", {"json": {"name": "up", "texts": [MORE], "stream": True}}, 409, "name"),
    ("/v1/memories", {"json": {"name": "bad", "texts": [MORE], "stream": "yes"}}, 400, "stream"),
    ("/v1/memories/up/forget", {"json": {"texts": [MORE], "stream": True}}, 400, "stream"),
]


@pytest.mark.parametrize(("path", "request_", "status", "field"), BAD, ids=[f"{b[3]}-{b[2]}-{i}" for i, b in
                                                                            enumerate(BAD)])  # fmt: skip
def test_a_bad_or_too_large_file_is_a_4xx_naming_the_field_and_changes_nothing(setup, path, request_, status, field):
    server, _, folder = setup
    with server.http() as http:
        if "up" not in [m["name"] for m in http.get("/v1/memories").json()["data"]]:
            assert http.post("/v1/memories", json={"name": "up", "texts": TEXTS["a"]}).status_code == 201
        before = folder_state(folder)
        answer = http.post(path, **request_)
        assert answer.status_code == status, answer.text
        error = answer.json()["error"]
        assert error["param"] == field and error["message"].startswith(field), error
    assert folder_state(folder) == before


@pytest.mark.parametrize("where", ["learning", "saving"])
def test_an_error_in_the_middle_of_a_streamed_learn_is_an_error_event_and_the_folder_is_unchanged(
    tmp_path, monkeypatch, where
):
    import httpx2 as httpx

    ckpt = checkpoint(tmp_path / "tiny")
    base, tokenizer, _ = load_base_model(ckpt)
    house = MemoryHouse(base, tokenizer, tmp_path / "m")
    house.learn("a", TEXTS["a"], create=True)
    x = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    with torch.no_grad():
        before_logits = house.model(x, memory_names=["a"]).logits
    before = folder_state(tmp_path / "m")
    calls: list[int] = []
    if where == "learning":  # the second batch of windows fails
        real = house.model.learn

        def learn(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("the disk under the model caught fire")
            return real(*args, **kwargs)

        monkeypatch.setattr(house.model, "learn", learn)
    else:  # the commit fails once everything is learned and solved
        real_write = memories_module.write_text_atomic

        def write(path, text):
            if path.name == "COMMIT":
                raise OSError("the disk under the model caught fire")
            return real_write(path, text)

        monkeypatch.setattr(memories_module, "write_text_atomic", write)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(house, base="tiny"), host="127.0.0.1", port=port,
                                           log_level="warning"))  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(200):
            if server.started:
                break
            time.sleep(0.1)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
            for path, body in (("/v1/memories", {"name": "b"}), ("/v1/memories/a/learn", {})):
                if where == "learning":
                    calls.clear()
                with http.stream("POST", path, json={**body, "texts": [LONG], "stream": True}) as answer:
                    got, done = events(answer)
                *progress, error = got
                assert done and progress and all(e["object"] == "memory.progress" for e in progress)
                assert progress[-1]["phase"] == ("learning" if where == "learning" else "saving")
                assert error["error"]["type"] == "server_error" and "caught fire" in error["error"]["message"]
                assert folder_state(tmp_path / "m") == before
                assert [m["name"] for m in http.get("/v1/memories").json()["data"]] == ["a"]
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    assert "b" not in house.model.memories
    house.make_resident(["a"])  # read back from its committed file
    with torch.no_grad():
        assert torch.equal(house.model(x, memory_names=["a"]).logits, before_logits)
