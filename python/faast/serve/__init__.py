"""`faast serve`: an OpenAI-compatible server of a FaastModel's memories (docs/serving.md, "The server").

A request's `model` names the memory it reads (`<base>:<memory>`; the bare `<base>` reads the base model alone);
requests on different memories that arrive together are generated in one batch, each row on its own memory. Memories
are created by learning posted texts or files (with progress streamed, if asked), learn more, forget texts exactly,
merge and are deleted over HTTP; every change is committed to the memories folder before the answer. Needs the
`serve` extra (fastapi, uvicorn, openai, python-multipart).

- faast.serve.memories.MemoryHouse: the folder, the resident memories (capped, least recently used evicted) and the
  commits.
- faast.serve.batching.Batcher: the batching loop.
- faast.serve.uploads: the bodies of create / learn / forget (JSON, files, a bare text); faast.serve.pieces: learning
  them a batch at a time, for progress.
- faast.serve.app.create_app: the FastAPI app.
- faast.serve.tenants: API keys and the memories each may touch.
- `faast serve ...` / `python -m faast.serve ...`: faast.serve.__main__.main.
"""
