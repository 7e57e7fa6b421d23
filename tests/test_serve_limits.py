"""`faast serve` with an API-key file and small limits: every operation on another tenant's memory is refused with a
bare 403 (the same whether the memory exists or not), lists show a tenant its own memories only, and every bad request
gets a 4xx JSON error naming the field, with the folder unchanged."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from serve_server import NAME, PROMPT, TEXTS, Server, checkpoint  # noqa: E402

ALICE, BOB, ADMIN = "alice-key-0001", "bob-key-00002", "admin-key-0003"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-limits")
    keys = folder / "keys.json"
    keys.write_text(json.dumps({"keys": {ALICE: {"memories": ["alice*"]}, BOB: {"memories": ["bob"]},
                                         ADMIN: {"admin": True}}}))  # fmt: skip
    limits = ["--max-text-chars", "2000", "--max-body-bytes", "20000", "--max-new-tokens", "32"]
    server = Server(checkpoint(folder / "tiny"), folder / "memories", "--api-keys", str(keys), *limits)
    try:
        for key, name in ((ALICE, "alice"), (BOB, "bob")):
            with server.http(key) as http:
                assert http.post("/v1/memories", json={"name": name, "texts": TEXTS["a"]}).status_code == 201
        yield server, folder / "memories"
    finally:
        server.stop()


def folder_state(folder):
    """The committed folder: the manifest and the memories' sidecar, byte for byte."""
    return (folder / "faast_manifest.json").read_bytes(), (folder / "faast_serve.json").read_bytes()


FORBIDDEN = [  # what bob's key may not do to alice's memories, or to names outside its own
    ("GET", "/v1/memories/{m}", None),
    ("POST", "/v1/memories/{m}/learn", {"texts": ["the cat"]}),
    ("POST", "/v1/memories/{m}/forget", {"texts": [TEXTS["a"][0]]}),
    ("DELETE", "/v1/memories/{m}", None),
    ("POST", "/v1/memories", {"name": "{m}", "texts": ["the cat"]}),
    ("POST", "/v1/memories/merge", {"sources": ["{m}", "bob"], "into": "bob2"}),
    ("POST", "/v1/memories/merge", {"sources": ["bob"], "into": "{m}"}),
    ("POST", "/v1/completions", {"model": f"{NAME}:{{m}}", "prompt": PROMPT, "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"model": f"{NAME}:{{m}}", "messages": [{"role": "user", "content": "hi"}]}),
]


@pytest.mark.parametrize(("method", "path", "body"), FORBIDDEN)
def test_every_operation_on_another_tenants_memory_is_refused_with_a_bare_403(server, method, path, body):
    server, folder = server
    before = folder_state(folder)
    answers = []
    with server.http(BOB) as http:
        for memory in ("alice", "alice-never-made"):  # one that exists, one that does not: the same answer
            fill = json.loads(json.dumps(body).replace("{m}", memory)) if body is not None else None
            answer = http.request(method, path.format(m=memory), json=fill)
            answers.append((answer.status_code, answer.json()))
    assert answers[0] == answers[1]
    assert answers[0][0] == 403 and answers[0][1]["error"]["message"] == "forbidden"
    assert folder_state(folder) == before


def test_a_tenant_lists_its_own_memories_and_a_missing_or_wrong_key_is_401(server):
    server, _ = server
    with server.http(BOB) as http:
        assert [m["name"] for m in http.get("/v1/memories").json()["data"]] == ["bob"]
    assert {m.id for m in server.openai(BOB).models.list()} == {NAME, f"{NAME}:bob"}
    with server.http(ADMIN) as http:
        assert [m["name"] for m in http.get("/v1/memories").json()["data"]] == ["alice", "bob"]
    for key in (None, "not-a-key-at-all"):
        with server.http(key) as http:
            answer = http.get("/v1/memories")
            assert answer.status_code == 401 and answer.json()["error"]["message"] == "unauthorized"
    with pytest.raises(openai.AuthenticationError):
        server.openai("wrong-key-0000").completions.create(model=NAME, prompt=PROMPT, max_tokens=2)
    # the openai client: bob reads the base model and its own memory, and is refused alice's
    client = server.openai(BOB)
    assert client.completions.create(model=f"{NAME}:bob", prompt=PROMPT, max_tokens=2).choices[0].text is not None
    with pytest.raises(openai.PermissionDeniedError):
        client.completions.create(model=f"{NAME}:alice", prompt=PROMPT, max_tokens=2)


BAD = [  # (method, path, body: a JSON value or raw bytes, status, the field named)
    ("POST", "/v1/completions", {"model": f"{NAME}:alice-nope", "prompt": PROMPT}, 404, "model"),
    ("POST", "/v1/completions", {"model": "other", "prompt": PROMPT}, 404, "model"),
    ("POST", "/v1/completions", {"model": f"{NAME}:../alice", "prompt": PROMPT}, 400, "model"),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": ', 400, "body"),
    ("POST", "/v1/completions", b"[1, 2]", 400, "body"),
    ("POST", "/v1/completions", {"model": NAME, "prompt": ""}, 400, "prompt"),
    ("POST", "/v1/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 33}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"model": NAME, "prompt": PROMPT, "temperature": 0.7}, 400, "temperature"),
    ("POST", "/v1/completions", {"model": NAME, "prompt": PROMPT, "top_p": 0.5}, 400, "top_p"),
    ("POST", "/v1/completions", {"model": NAME, "prompt": PROMPT, "colour": "red"}, 400, "colour"),
    ("POST", "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user"}]}, 400, "messages"),
    ("POST", "/v1/memories", {"name": "alice2", "texts": [""]}, 400, "texts"),
    ("POST", "/v1/memories", {"name": "alice2", "texts": []}, 400, "texts"),
    ("POST", "/v1/memories", {"name": "alice2", "texts": "the cat"}, 400, "texts"),
    ("POST", "/v1/memories", {"name": "alice2", "texts": ["x" * 2001]}, 413, "texts"),
    ("POST", "/v1/memories", {"name": "alice2", "texts": ["x" * 30000]}, 413, "body"),
    ("POST", "/v1/memories", {"name": "alice2", "texts": ["the cat"], "extra": 1}, 400, "extra"),
    ("POST", "/v1/memories", {"name": "alice", "texts": ["the cat"]}, 409, "name"),
    ("POST", "/v1/memories/alice-nope/learn", {"texts": ["the cat"]}, 404, "name"),
    ("POST", "/v1/memories/alice.x/learn", {"texts": ["the cat"]}, 400, "name"),
    ("POST", "/v1/memories/alice/forget", {"texts": ["never learned, this one"]}, 400, "texts"),
    ("POST", "/v1/memories/merge", {"sources": ["alice", "alice"], "into": "alice3"}, 400, "sources"),
    ("POST", "/v1/memories/merge", {"sources": ["alice"], "into": "alice"}, 409, "into"),
    ("POST", "/v1/memories/merge", {"sources": ["alice-nope"], "into": "alice3"}, 404, "sources"),
    ("DELETE", "/v1/memories/alice-nope", None, 404, "name"),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "field"), BAD, ids=[f"{b[1]}-{b[4]}-{b[3]}" for b in BAD]
)
def test_bad_input_is_a_4xx_json_error_naming_the_field_and_changes_nothing(server, method, path, body, status, field):
    server, folder = server
    before = folder_state(folder)
    with server.http(ALICE) as http:
        raw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {}
        answer = http.request(method, path, **(raw or ({"json": body} if body is not None else {})))
        assert answer.status_code == status, answer.text
        error = answer.json()["error"]
        assert error["param"] == field and error["message"].startswith(field), error
        assert [m["name"] for m in http.get("/v1/memories").json()["data"]] == ["alice"]
    assert folder_state(folder) == before
