"""`faast serve` against the real openai client, on a tiny model: each memory's completion is what
FaastModel.generate gives with that memory (greedy), streamed or not, chat too; learn -> query -> forget -> query;
concurrent clients on different memories share batches and each gets its memory's answer alone."""

from __future__ import annotations

import threading

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

from faast.hf import FaastModel  # noqa: E402
from faast.hf.default import load_base_model  # noqa: E402
from serve_server import NAME, PROMPT, TEXTS, Reference, Server, checkpoint  # noqa: E402
from tolerances import ELEMENTWISE  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    ckpt = checkpoint(folder / "tiny")
    server = Server(ckpt, folder / "memories", "--max-resident", "3")
    reference = Reference(ckpt)
    try:
        with server.http() as http:
            for name in ("a", "b"):
                assert http.post("/v1/memories", json={"name": name, "texts": TEXTS[name]}).status_code == 201
                reference.learn(name, TEXTS[name])
        yield server, reference, ckpt, folder / "memories"
    finally:
        server.stop()


def test_each_memory_answers_what_generate_gives_with_that_memory(setup):
    server, reference, _, _ = setup
    client = server.openai()
    answers = {}
    for memory in (None, "a", "b"):
        model = NAME if memory is None else f"{NAME}:{memory}"
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=12)
        assert out.model == model and out.choices[0].finish_reason in ("length", "stop")
        answers[memory] = out.choices[0].text
        assert answers[memory] == reference.complete(memory), memory
    assert answers["a"] != answers[None] and answers["b"] != answers[None]  # the memories change the answer
    assert {m.id for m in client.models.list()} == {NAME, f"{NAME}:a", f"{NAME}:b"}


def test_streaming_sends_the_same_text_in_several_events_and_chat_works(setup):
    server, reference, _, _ = setup
    client = server.openai()
    chunks = list(client.completions.create(model=f"{NAME}:a", prompt=PROMPT, max_tokens=12, stream=True))
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert len([p for p in pieces if p]) > 1
    assert "".join(pieces) == reference.complete("a")
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    chat = client.chat.completions.create(model=f"{NAME}:b", messages=[{"role": "user", "content": "the bird"}],
                                          max_tokens=8)  # fmt: skip
    streamed = client.chat.completions.create(model=f"{NAME}:b", messages=[{"role": "user", "content": "the bird"}],
                                              max_tokens=8, stream=True)  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert chat.choices[0].message.content == text
    assert text == reference.complete("b", prompt="user: the bird\nassistant:", max_tokens=8)


def saved_logits(ckpt, folder, memory, x):
    """The logits of memory `memory` as committed in the server's folder, read by a fresh FaastModel."""
    model = FaastModel.from_pretrained(load_base_model(ckpt)[0], folder)
    with torch.no_grad():
        return model(x, memory_names=[memory]).logits


def test_learn_query_forget_query_gives_the_before_and_after_exactly(setup):
    server, reference, ckpt, folder = setup
    client, x = server.openai(), torch.tensor([reference.tokenizer(PROMPT)["input_ids"]])
    extra = ["the cat ate fish from a blue bowl. " * 10]
    with server.http() as http:
        assert http.post("/v1/memories", json={"name": "c", "texts": TEXTS["c"]}).status_code == 201
        reference.learn("c", TEXTS["c"])
        before = client.completions.create(model=f"{NAME}:c", prompt=PROMPT, max_tokens=12).choices[0].text
        assert before == reference.complete("c")
        learned = http.post("/v1/memories/c/learn", json={"texts": extra}).json()
        assert learned["tokens"] == len(extra[0])
        reference.learn("c", extra)
        # committed before the answer: the folder's memory is the reference's, bit for bit
        with torch.no_grad():
            assert torch.equal(saved_logits(ckpt, folder, "c", x), reference.model(x, memory_names=["c"]).logits)
        middle = client.completions.create(model=f"{NAME}:c", prompt=PROMPT, max_tokens=12).choices[0].text
        assert middle == reference.complete("c") and middle != before
        assert http.post("/v1/memories/c/forget", json={"texts": extra}).status_code == 200
        reference.model.forget(extra, tokenizer=reference.tokenizer, memory="c")
        reference.model.solve(memories=["c"])
        after = client.completions.create(model=f"{NAME}:c", prompt=PROMPT, max_tokens=12).choices[0].text
        assert after == reference.complete("c") == before
        with torch.no_grad():
            forgot = saved_logits(ckpt, folder, "c", x)
            assert torch.equal(forgot, reference.model(x, memory_names=["c"]).logits)
        # and what was never learned: the memory that learned TEXTS["c"] alone, to float32's tolerance
        alone = Reference(ckpt)
        alone.learn("c", TEXTS["c"])
        with torch.no_grad():
            atol, rtol = ELEMENTWISE[torch.float32]
            torch.testing.assert_close(forgot, alone.model(x, memory_names=["c"]).logits, atol=atol, rtol=rtol)
        info = {m["name"]: m for m in http.get("/v1/memories").json()["data"]}
        assert info["c"]["tokens"] == len(TEXTS["c"][0]) and info["c"]["resident"] is True


def test_concurrent_clients_on_different_memories_share_a_batch_and_each_gets_its_memorys_answer(setup):
    server, reference, _, _ = setup
    memories = [None, "a", "b", "a", "b", None]
    expected = {m: reference.complete(m) for m in set(memories)}
    answers: list[str | None] = [None] * len(memories)
    errors: list[BaseException] = []
    start = threading.Barrier(len(memories))

    def ask(i: int) -> None:
        try:
            client = server.openai()
            model = NAME if memories[i] is None else f"{NAME}:{memories[i]}"
            start.wait(timeout=60)
            answers[i] = client.completions.create(model=model, prompt=PROMPT, max_tokens=12).choices[0].text
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    with server.http() as http:
        batches = http.get("/health").json()["batches"]
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(memories))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        health = http.get("/health").json()
    assert not errors and not any(t.is_alive() for t in threads)
    assert answers == [expected[m] for m in memories]
    # fewer batches than requests, and one of them held several memories: one forward for many memories
    assert health["batches"] - batches < len(memories)
    assert health["most_memories_in_a_batch"] >= 2
