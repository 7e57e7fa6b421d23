"""The bodies of the requests that create, learn into or forget from a memory: JSON, a file upload or a bare text
(docs/serving.md, "Learning from a file, with progress").

- `application/json` (or no content type): {"name" (create), "texts": [...], "stream" (create and learn)}.
- `multipart/form-data`: form fields `name` and `stream` ("true" or "false"), and one or more `file` parts, each
  one text (curl -F name=notes -F file=@notes.txt).
- `text/plain`: the body is one text; `name` and `stream` are query parameters.

Files and bare texts must be UTF-8 (a leading byte-order mark is dropped). The request's bytes are capped before
they are parsed (Limits.max_body_bytes, 413), and the texts by Limits.max_text_chars (413), whatever their form.
Every refusal is a ServeError naming the field at fault: `file` for a file part, `body` for a bare text.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass

from fastapi import Request

from .schemas import Limits, ServeError, name_field, only_fields, parse_body, texts_field

FILE = "file"  # the form field of an uploaded text


@dataclass
class TextsRequest:
    """A checked create / learn / forget request: the memory name (create only, else None), the texts, whether to
    stream progress, and the field the texts came in (`texts`, `file` or `body`: errors about them name it)."""

    name: str | None
    texts: list[str]
    stream: bool
    field: str


async def read_capped(request: Request, limits: Limits) -> bytes:
    """The request's body, refused (413, `body`) past limits.max_body_bytes: at once when its Content-Length says so,
    else as soon as the bytes received pass it (a chunked upload is never held whole past the cap)."""
    cap = limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > cap:
        raise ServeError(f"body: {declared} bytes, the server takes at most {cap}", "body", 413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise ServeError(f"body: over {cap} bytes, the server takes at most {cap}", "body", 413)
        chunks.append(chunk)
    return b"".join(chunks)


def _flag(value: object, field: str) -> bool:
    """A form or query flag: 'true' or 'false'."""
    if value in ("true", "false"):
        return value == "true"
    raise ServeError(f"{field}: expected 'true' or 'false', got {value!r}", field)


def _text(raw: bytes, field: str, what: str) -> str:
    """`raw` as a UTF-8 text, refused when it is not UTF-8 or holds nothing but white space."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ServeError(f"{field}: {what} is not UTF-8 text (byte {err.start}: {err.reason})", field) from None
    if not text.strip():
        raise ServeError(f"{field}: {what} is empty", field)
    return text


async def texts_request(request: Request, limits: Limits, allowed: set[str]) -> TextsRequest:
    """Read and check a create / learn / forget request of any of the three forms (module docstring). `allowed`: the
    JSON fields the endpoint takes ({"name", "texts", "stream"} for a create); the form and query fields follow
    from it."""
    raw = await read_capped(request, limits)
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind == "multipart/form-data":
        return await _multipart(request, raw, limits, allowed)
    if kind == "text/plain":
        query = dict(request.query_params)
        only_fields(query, allowed - {"texts"})
        name = name_field(query, "name") if "name" in allowed else None
        stream = _flag(query["stream"], "stream") if "stream" in query else False
        texts = _checked([_text(raw, "body", "the body")], limits, "body")
        return TextsRequest(name, texts, stream, "body")
    body = parse_body(raw, limits)
    only_fields(body, allowed)
    name = name_field(body, "name") if "name" in allowed else None
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ServeError(f"stream: expected true or false, got {stream!r}", "stream")
    return TextsRequest(name, texts_field(body, limits), stream, "texts")


async def _multipart(request: Request, raw: bytes, limits: Limits, allowed: set[str]) -> TextsRequest:
    try:
        from starlette.formparsers import MultiPartException, MultiPartParser
    except ImportError:  # pragma: no cover - starlette comes with fastapi
        raise ServeError("body: this server cannot read multipart bodies", "body", 415) from None

    async def body() -> AsyncGenerator[bytes, None]:
        yield raw

    fields = (allowed - {"texts"}) | {FILE}
    try:
        form = await MultiPartParser(request.headers, body(), max_fields=len(fields)).parse()
    except AssertionError:  # starlette's way of saying that python-multipart is not installed
        raise ServeError("body: multipart bodies need python-multipart on the server", "body", 415) from None
    except MultiPartException as err:
        raise ServeError(f"body: not a valid multipart body ({err.message})", "body") from None
    try:
        only_fields(dict(form), fields)
        values = {k: v for k, v in form.multi_items() if k != FILE}
        for key, value in values.items():
            if not isinstance(value, str):
                raise ServeError(f"{key}: expected a form field, got a file", key)
        name = name_field(values, "name") if "name" in allowed else None
        stream = _flag(values["stream"], "stream") if "stream" in values else False
        files = form.getlist(FILE)
        if not files:
            raise ServeError(f"{FILE}: expected one or more files", FILE)
        texts = []
        for n, part in enumerate(files):
            if isinstance(part, str):
                raise ServeError(f"{FILE}: expected a file, got a form field", FILE)
            label = f"file {n} ({part.filename!r})" if len(files) > 1 else f"the file {part.filename!r}"
            texts.append(_text(await part.read(), FILE, label))
    finally:
        await form.close()
    return TextsRequest(name, _checked(texts, limits, FILE), stream, FILE)


def _checked(texts: list[str], limits: Limits, field: str) -> list[str]:
    total = sum(len(t) for t in texts)
    if total > limits.max_text_chars:
        raise ServeError(f"{field}: {total} characters, the server takes at most {limits.max_text_chars}", field, 413)
    return texts
