"""The FastAPI app of `faast serve`: OpenAI-compatible completions where the request's `model` names the memory, and
the memory endpoints (docs/serving.md, "The server").

- GET /v1/models: the base model and every memory as `<base>:<memory>` (a tenant sees its own).
- POST /v1/completions, /v1/chat/completions: greedy generation, streamed (SSE) or not; responses are the `openai`
  package's types, as `transformers serve` answers.
- GET /v1/memories, GET /v1/memories/{name}: name, file bytes, tokens learned, resident or not.
- POST /v1/memories {name, texts}: a new memory learned from the texts. POST /v1/memories/{name}/learn {texts}: learn
  more. POST /v1/memories/{name}/forget {texts}: unlearn them exactly. The three also take files (multipart) or a
  bare text (text/plain) (faast.serve.uploads); create and learn take `stream`: progress as server-sent events, then
  the answer. POST /v1/memories/merge {sources, into}. DELETE /v1/memories/{name}. Each change is committed to the
  folder before the answer (faast.serve.memories).
- GET /health.

Every refusal is a 4xx with {"error": {"message", "type", "param", "code"}}, `param` naming the field, and changes
nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal, cast

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta

from .batching import Batcher, Job
from .memories import MemoryHouse
from .schemas import Generation, Limits, ServeError, name_field, only_fields, parse_body, parse_generation
from .tenants import Gate, Tenant
from .uploads import TextsRequest, read_capped, texts_request

Reason = Literal["stop", "length"]  # why a generation ended: an end-of-sequence token, or max_tokens
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


def error_response(err: ServeError) -> JSONResponse:
    body = {
        "message": str(err),
        "type": _TYPES.get(err.status, "invalid_request_error"),
        "param": err.field,
        "code": err.status,
    }
    return JSONResponse({"error": body}, status_code=err.status)


def prompt_ids(tokenizer: Any, gen: Generation) -> list[int]:
    """The prompt's token ids: the completion prompt tokenised as the tokenizer does by default, or the chat
    messages through the tokenizer's chat template (without one: `role: content` lines and `assistant:`)."""
    if gen.prompt is not None:
        return list(tokenizer(gen.prompt)["input_ids"])
    messages = gen.messages or []
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    return list(tokenizer(text)["input_ids"])


def create_app(
    house: MemoryHouse,
    *,
    base: str,
    limits: Limits | None = None,
    tenants: Gate | None = None,
    max_learning: int = 2,
    window_s: float = 0.005,
    max_batch: int = 16,
) -> FastAPI:
    """The app serving `house` under the base name `base` (see the module docstring).

    Args:
        house: the model and its memories folder.
        base: the model id clients name (no ':').
        limits: request limits (Limits()).
        tenants: who may touch which memory (Gate(None): everyone everything).
        max_learning: how many learn / forget / merge jobs may wait or run at once (more: 429).
        window_s, max_batch: the batching loop's (faast.serve.batching.Batcher).
    """
    if ":" in base or not base:
        raise ValueError(f"base: expected a non-empty model id without ':', got {base!r}")
    limits = limits or Limits()
    gate = tenants or Gate(None)
    learning = threading.BoundedSemaphore(max_learning)
    batcher = Batcher(house, window_s=window_s, max_batch=max_batch)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        batcher.stop()

    app = FastAPI(title="faast serve", lifespan=lifespan)
    app.state.house, app.state.batcher = house, batcher

    @app.exception_handler(ServeError)
    async def _refused(_request: Request, err: ServeError) -> JSONResponse:
        return error_response(err)

    async def body_of(request: Request) -> dict:
        return parse_body(await read_capped(request, limits), limits)

    def who(request: Request) -> Tenant:
        return gate.tenant(request.headers.get("authorization"))

    async def change(job: Callable[[], dict]) -> dict:
        """Run a learn / forget / merge / delete on a worker thread, holding the model; 429 past max_learning."""
        if not learning.acquire(blocking=False):
            raise ServeError(f"learning: {max_learning} learning jobs already running; retry later", None, 429)

        def run() -> dict:
            with house.lock:
                return job()

        try:
            return await asyncio.to_thread(run)
        finally:
            learning.release()

    async def learned(name: str, request: TextsRequest, create: bool) -> Response:
        """Learn the request's texts into memory `name`: the answer when it is committed, or, with `stream`, an SSE
        stream of progress events that ends with that answer (or an error event, the folder unchanged)."""
        status = 201 if create else 200
        if create and name in house.entries:  # checked again under the lock; here for a plain 409 before a stream
            raise ServeError(f"name: a memory named {name!r} exists already", "name", 409)
        if not create:
            house.require(name, "name")
        if not request.stream:

            def job() -> dict:
                return house.learn(name, request.texts, create=create, field=request.field)

            return JSONResponse(await change(job), status_code=status)
        if not learning.acquire(blocking=False):
            raise ServeError(f"learning: {max_learning} learning jobs already running; retry later", None, 429)
        loop, events = asyncio.get_running_loop(), asyncio.Queue[dict | None]()

        def send(event: dict | None) -> None:
            with contextlib.suppress(RuntimeError):  # the event loop has closed (the server stops): nobody listens
                loop.call_soon_threadsafe(events.put_nowait, event)

        def run() -> None:
            # the job runs to its end (committed or not) even when the client leaves, as a call without `stream` does
            try:
                with house.lock:
                    send(house.learn(name, request.texts, create=create, progress=send, field=request.field))
            except ServeError as err:
                send(json.loads(error_response(err).body))
            except Exception as err:  # noqa: BLE001 - the stream has started: the error goes in it
                send({"error": {"message": str(err), "type": "server_error", "param": None, "code": 500}})
            finally:
                learning.release()
                send(None)

        async def stream() -> AsyncIterator[str]:
            while (event := await events.get()) is not None:
                yield f"data: {json.dumps(event)}\n\n"
            yield "data: [DONE]\n\n"

        threading.Thread(target=run, name=f"faast-learn-{name}", daemon=True).start()
        return StreamingResponse(stream(), status_code=status, media_type="text/event-stream")

    # ---------------------------------------------------------------- models and health

    @app.get("/health")
    async def health() -> dict:
        """ok, and what the batching loop did: batches run, the most rows and memories one batch held."""
        groups = list(batcher.groups)
        return {
            "status": "ok",
            "batches": len(groups),
            "largest_batch": max(map(len, groups), default=0),
            "most_memories_in_a_batch": max((len(set(g)) for g in groups), default=0),
        }

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        tenant = who(request)
        ids = [base] + [f"{base}:{n}" for n in house.names if tenant.covers(n)]
        return {
            "object": "list",
            "data": [{"id": i, "object": "model", "created": 0, "owned_by": "faast"} for i in ids],
        }

    # ---------------------------------------------------------------- completions

    async def generation(request: Request, kind: str) -> Response:
        tenant = who(request)
        gen = parse_generation(await body_of(request), kind, base, limits)
        gate.check(tenant, gen.memory)
        if gen.memory is not None:
            house.require(gen.memory, "model")
        ids = prompt_ids(house.tokenizer, gen)
        if not ids or len(ids) > limits.max_prompt_tokens:
            field = "prompt" if kind == "completion" else "messages"
            raise ServeError(f"{field}: {len(ids)} tokens, expected 1 to {limits.max_prompt_tokens}", field)
        loop = asyncio.get_running_loop()
        job = Job(ids, gen.memory, gen.max_tokens, loop, asyncio.Queue())
        batcher.submit(job)
        rid = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        model_id = base if gen.memory is None else f"{base}:{gen.memory}"
        if gen.stream:
            return StreamingResponse(
                _stream(job, kind, rid, model_id, gen.include_usage), media_type="text/event-stream"
            )
        text, reason = "", "length"
        async for piece, end in _pieces(job):
            text += piece
            reason = end or reason
        finish = cast(Reason, reason)  # the worker sends "stop" or "length"
        usage = CompletionUsage(
            prompt_tokens=len(ids), completion_tokens=len(job.tokens), total_tokens=len(ids) + len(job.tokens)
        )
        if kind == "completion":
            out: Any = Completion(
                id=rid,
                object="text_completion",
                created=int(time.time()),
                model=model_id,
                choices=[CompletionChoice(text=text, index=0, finish_reason=finish)],
                usage=usage,
            )
        else:
            message = ChatCompletionMessage(role="assistant", content=text)
            out = ChatCompletion(
                id=rid,
                object="chat.completion",
                created=int(time.time()),
                model=model_id,
                choices=[Choice(index=0, message=message, finish_reason=finish)],
                usage=usage,
            )
        return JSONResponse(out.model_dump(exclude_none=True))

    async def _pieces(job: Job) -> AsyncIterator[tuple[str, str | None]]:
        """(new text, finish reason or None) as the job's tokens arrive; the text is the decoded whole minus what
        was sent (a token may complete a character only with the next one)."""
        sent = ""
        try:
            while True:
                item = await job.out.get()
                if isinstance(item, Exception):
                    raise item
                # the tokens so far (the worker may be a token or two ahead of this queue; their text comes now)
                text = house.tokenizer.decode(list(job.tokens), skip_special_tokens=True)
                if isinstance(item, tuple):
                    yield text[len(sent) :] if text.startswith(sent) else "", item[1]
                    return
                if text.startswith(sent) and len(text) > len(sent) and not text.endswith("\ufffd"):
                    yield text[len(sent) :], None
                    sent = text
        finally:
            job.cancelled = True  # a client that left stops its row; after the end it changes nothing

    async def _stream(job: Job, kind: str, rid: str, model_id: str, usage: bool) -> AsyncIterator[str]:
        created = int(time.time())

        def event(piece: str, reason: str | None) -> str:
            if kind == "completion":
                chunk: Any = Completion.model_construct(
                    id=rid,
                    object="text_completion",
                    created=created,
                    model=model_id,
                    choices=[CompletionChoice.model_construct(text=piece, index=0, finish_reason=reason)],
                )
            else:
                delta = ChoiceDelta(role="assistant", content=piece) if piece or reason is None else ChoiceDelta()
                chunk = ChatCompletionChunk.model_construct(
                    id=rid,
                    object="chat.completion.chunk",
                    created=created,
                    model=model_id,
                    choices=[ChunkChoice.model_construct(index=0, delta=delta, finish_reason=reason)],
                )
            return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"

        try:
            async for piece, reason in _pieces(job):
                if piece or reason:
                    yield event(piece, reason)
            if usage:
                counts = CompletionUsage(
                    prompt_tokens=len(job.prompt),
                    completion_tokens=len(job.tokens),
                    total_tokens=len(job.prompt) + len(job.tokens),
                )
                last = (Completion if kind == "completion" else ChatCompletionChunk).model_construct(
                    id=rid,
                    object="text_completion" if kind == "completion" else "chat.completion.chunk",
                    created=created,
                    model=model_id,
                    choices=[],
                    usage=counts,
                )
                yield f"data: {last.model_dump_json(exclude_none=True)}\n\n"
        except Exception as err:  # noqa: BLE001 - the stream has started: the error goes in it
            yield f"data: {json.dumps({'error': {'message': str(err), 'type': 'server_error'}})}\n\n"
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generation(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generation(request, "chat")

    # ---------------------------------------------------------------- memories

    @app.get("/v1/memories")
    async def list_memories(request: Request) -> dict:
        tenant = who(request)
        # no lock: a read of the committed entries must not wait for a learn to end
        return {"object": "list", "data": [house.info(n) for n in house.names if tenant.covers(n)]}

    def named(request: Request, name: str) -> str:
        tenant = who(request)
        name = name_field({"name": name}, "name")
        gate.check(tenant, name)  # before existence: a denied tenant learns nothing about the name
        return name

    @app.get("/v1/memories/{name}")
    async def show_memory(request: Request, name: str) -> dict:
        name = named(request, name)
        return house.info(name)

    @app.post("/v1/memories", status_code=201)
    async def create_memory(request: Request) -> Response:
        tenant = who(request)
        asked = await texts_request(request, limits, {"name", "texts", "stream"})
        name = cast(str, asked.name)  # a create's request always has one
        gate.check(tenant, name)
        return await learned(name, asked, create=True)

    @app.post("/v1/memories/merge", status_code=201)
    async def merge_memories(request: Request) -> dict:
        tenant = who(request)
        body = await body_of(request)
        only_fields(body, {"sources", "into"})
        sources = body.get("sources")
        if not isinstance(sources, list) or not sources or len(set(map(str, sources))) != len(sources):
            raise ServeError(
                f"sources: expected a non-empty list of distinct memory names, got {sources!r}", "sources"
            )
        sources = [name_field({"sources": s}, "sources") for s in sources]
        into = name_field(body, "into")
        gate.check(tenant, *sources, into)
        return await change(lambda: house.merge(sources, into))

    @app.post("/v1/memories/{name}/learn")
    async def learn_memory(request: Request, name: str) -> Response:
        name = named(request, name)
        return await learned(name, await texts_request(request, limits, {"texts", "stream"}), create=False)

    @app.post("/v1/memories/{name}/forget")
    async def forget_memory(request: Request, name: str) -> dict:
        name = named(request, name)
        asked = await texts_request(request, limits, {"texts"})
        return await change(lambda: house.forget(name, asked.texts, field=asked.field))

    @app.delete("/v1/memories/{name}")
    async def delete_memory(request: Request, name: str) -> dict:
        name = named(request, name)

        def job() -> dict:
            house.delete(name)
            return {"memory": name, "deleted": True}

        return await change(job)

    return app
