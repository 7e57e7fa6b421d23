"""`faast serve` / `python -m faast.serve`: serve a base model with a folder of memories (docs/serving.md)."""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

DESCRIPTION = """Serve a model with a folder of faast memories over an OpenAI-compatible API: a request's model is
<base>:<memory> (the bare <base>: no memory). Memories are learned, forgotten, merged and deleted under /v1/memories.
See docs/serving.md."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="faast serve", description=DESCRIPTION)
    p.add_argument(
        "--base",
        default="smollm2",
        help="'smollm2' (the embedded default, SmolLM2-135M-Instruct) or a transformers model folder",
    )
    p.add_argument(
        "--name", default=None, help="the model id clients name (default: 'smollm2', or the base folder's name)"
    )
    p.add_argument(
        "--memories",
        default="faast-memories",
        help="the memories folder (a save_pretrained folder; created when missing)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-keys", default=None, help="a JSON file of API keys and the memories each may touch")
    p.add_argument("--max-resident", type=int, default=8, help="memories kept in the model at once (others on disk)")
    p.add_argument("--max-learning", type=int, default=2, help="learn / forget / merge jobs at once (more: 429)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--max-text-chars", type=int, default=200_000, help="characters to learn or forget per request")
    p.add_argument("--max-prompt-tokens", type=int, default=4096)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--batch-window-ms", type=float, default=5.0, help="how long a batch waits for more requests")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument(
        "--exit-after", type=float, default=None, help="stop the server after this many seconds (tests and benchmarks)"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        import uvicorn
    except ImportError:
        print("faast serve needs the serve extra: pip install 'faast[serve]'", file=sys.stderr)
        return 2
    import torch

    from ..hf.default import load_base_model
    from .app import create_app
    from .memories import MemoryHouse
    from .schemas import Limits
    from .tenants import Gate, load_keys

    if args.threads:
        torch.set_num_threads(args.threads)
    name = args.name or ("smollm2" if args.base == "smollm2" else Path(args.base).name)
    gate = Gate(load_keys(args.api_keys) if args.api_keys else None)
    base_model, tokenizer, _ = load_base_model(args.base)
    house = MemoryHouse(base_model, tokenizer, args.memories, max_resident=args.max_resident)
    limits = Limits(args.max_body_bytes, args.max_text_chars, args.max_prompt_tokens, args.max_new_tokens)
    app = create_app(
        house,
        base=name,
        limits=limits,
        tenants=gate,
        max_learning=args.max_learning,
        window_s=args.batch_window_ms / 1000,
        max_batch=args.max_batch,
    )
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"))
    if args.exit_after is not None:
        timer = threading.Timer(args.exit_after, lambda: setattr(server, "should_exit", True))
        timer.daemon = True
        timer.start()
    print(
        f"faast serve: {name} with {len(house.names)} memories from {args.memories} on "
        f"http://{args.host}:{args.port}/v1",
        flush=True,
    )
    server.run()
    return 0


def cli() -> int:
    """The `faast` console script: `faast serve [options]` (the one subcommand so far)."""
    if len(sys.argv) < 2 or sys.argv[1] != "serve":
        print("usage: faast serve [options]   (faast serve --help)", file=sys.stderr)
        return 2
    return main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
