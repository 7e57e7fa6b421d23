"""What the server's requests may hold, checked field by field (docs/serving.md, "The server").

The OpenAI endpoints accept the fields of the OpenAI request types that the `openai` package defines
(`CompletionCreateParamsBase`, the chat `CompletionCreateParamsBase`): `transformers serve` validates its requests
against the same types. A field outside them is refused; a field of them that this server does not implement
(sampling, logprobs, tools, ...) is refused when it is set to anything but its neutral value, so that a client never
silently gets something other than what it asked for. Every refusal is a ServeError naming the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from ..hf.memory_store import check_name


class ServeError(ValueError):
    """A request the server refuses: `field` names the request field at fault and `status` is the HTTP status
    (4xx). The answer is an OpenAI-style error: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, field: str | None, status: int = 400) -> None:
        super().__init__(message)
        self.field, self.status = field, status


@dataclass(frozen=True)
class Limits:
    """What one request may ask: body bytes, characters of text to learn or forget, prompt tokens, new tokens."""

    max_body_bytes: int = 1 << 20
    max_text_chars: int = 200_000
    max_prompt_tokens: int = 4096
    max_new_tokens: int = 512


def _openai_fields(kind: str) -> set[str]:
    """The fields of the OpenAI request type of `kind` ('completion' or 'chat') in the installed `openai` package."""
    if kind == "completion":
        from openai.types.completion_create_params import CompletionCreateParamsBase
    else:
        from openai.types.chat.completion_create_params import CompletionCreateParamsBase  # type: ignore[assignment]
    return set(CompletionCreateParamsBase.__annotations__) | {"stream"}  # `stream` is in its two subtypes


# Fields of the OpenAI types this server implements; any other is refused unless it holds its neutral value.
_SUPPORTED = {
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "stream",
    "stream_options",
    "temperature",
    "user",
    "seed",
}
_NEUTRAL: dict[str, tuple] = {
    "n": (None, 1),
    "top_p": (None, 1, 1.0),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "echo": (None, False),
    "logprobs": (None, False),
    "best_of": (None, 1),
    "stop": (None, []),
}


@dataclass
class Generation:
    """A checked completion request: the memory its model names (None: the base model), the prompt or messages,
    how many new tokens, whether to stream."""

    base: str
    memory: str | None
    prompt: str | None
    messages: list[dict] | None
    max_tokens: int
    stream: bool
    include_usage: bool


def parse_body(raw: bytes, limits: Limits) -> dict:
    """The JSON object of a request body; ServeError naming `body` when it is too long, not JSON, or not an object."""
    if len(raw) > limits.max_body_bytes:
        raise ServeError(f"body: {len(raw)} bytes, the server takes at most {limits.max_body_bytes}", "body", 413)
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise ServeError(f"body: not valid JSON ({err})", "body") from None
    if not isinstance(body, dict):
        raise ServeError(f"body: expected a JSON object, got {type(body).__name__}", "body")
    return body


def split_model(model: object, base: str) -> str | None:
    """The memory named by a request's `model`: `<base>:<memory>`, or None for the bare `<base>`."""
    if not isinstance(model, str):
        raise ServeError(f"model: expected '{base}' or '{base}:<memory>', got {model!r}", "model")
    head, sep, memory = model.partition(":")
    if head != base:
        raise ServeError(f"model: this server serves '{base}' and '{base}:<memory>', got {model!r}", "model", 404)
    if not sep:
        return None
    try:
        return check_name(memory, "model")
    except ValueError as err:
        raise ServeError(str(err), "model") from None


def parse_generation(body: dict, kind: str, base: str, limits: Limits) -> Generation:
    """Check a /v1/completions (`kind` 'completion') or /v1/chat/completions ('chat') request."""
    known = _openai_fields(kind)
    for field, value in body.items():
        if field not in known:
            raise ServeError(f"{field}: not a field of the OpenAI {kind} request", field)
        if field not in _SUPPORTED and value not in _NEUTRAL.get(field, (None,)):
            raise ServeError(f"{field}: not supported by faast serve (leave it out)", field)
    memory = split_model(body.get("model"), base)
    prompt, messages = None, None
    if kind == "completion":
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise ServeError(f"prompt: expected a non-empty string, got {prompt!r}", "prompt")
    else:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ServeError("messages: expected a non-empty list of {role, content}", "messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ServeError(f"messages: expected {{role, content}} with string values, got {m!r}", "messages")
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    count = body.get(field)
    count = 16 if count is None else count
    if type(count) is not int or not 1 <= count <= limits.max_new_tokens:
        raise ServeError(f"{field}: expected an int in [1, {limits.max_new_tokens}], got {count!r}", field)
    temperature = body.get("temperature")
    if temperature is not None and (
        type(temperature) not in (int, float) or not math.isfinite(temperature) or temperature != 0
    ):
        raise ServeError(
            f"temperature: this server decodes greedily: 0 or leave it out, got {temperature!r}", "temperature"
        )
    stream = body.get("stream")
    if stream not in (None, True, False):
        raise ServeError(f"stream: expected true or false, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ServeError(f"stream_options: expected an object, got {options!r}", "stream_options")
    return Generation(base, memory, prompt, messages, count, bool(stream), bool(options.get("include_usage")))


def texts_field(body: dict, limits: Limits, field: str = "texts") -> list[str]:
    """The non-empty list of non-empty texts at `field`, within limits.max_text_chars in all."""
    texts = body.get(field)
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise ServeError(f"{field}: expected a non-empty list of texts, got {_short(texts)}", field)
    if any(not t.strip() for t in texts):
        raise ServeError(f"{field}: a text is empty", field)
    total = sum(len(t) for t in texts)
    if total > limits.max_text_chars:
        raise ServeError(f"{field}: {total} characters, the server takes at most {limits.max_text_chars}", field, 413)
    return texts


def name_field(body: dict, field: str) -> str:
    """A memory name at `field` (faast's rule: 1-64 letters, digits, '_' or '-'; no path can be made of one)."""
    try:
        return check_name(body.get(field), field)
    except ValueError as err:
        raise ServeError(str(err), field) from None


def only_fields(body: dict, allowed: set[str]) -> None:
    """Refuse fields outside `allowed` (a misspelt field would otherwise be ignored)."""
    for field in body:
        if field not in allowed:
            raise ServeError(f"{field}: unknown field; expected {sorted(allowed)}", field)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 80 else text[:77] + "..."
