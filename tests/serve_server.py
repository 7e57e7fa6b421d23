"""A `faast serve` process on 127.0.0.1 for the tests: a tiny Llama checkpoint with a character tokenizer, a free
port, and a server that stops by itself (--exit-after) even when a test does not stop it; and the in-process
reference the answers are compared with (the same checkpoint, FaastModel.generate, greedy)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from faast.hf import FaastConfig, apply_faast
from faast.hf.default import load_base_model
from faast.hf.memory_store import BASE
from hf_models import PROSE, save_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
NAME = "tiny"
# Texts each memory learns: repeated phrases, so that a memory changes what the tiny model says after its prompt.
TEXTS = {
    "a": ["the cat sat on the mat and the cat was happy. " * 12],
    "b": ["a bird flew over the river in the morning. " * 12],
    "c": ["my dog likes long walks in the park, every day. " * 12],
}
PROMPT = "the cat"


def checkpoint(folder: Path) -> str:
    """The tiny checkpoint (model + tokenizer of PROSE characters) in `folder`, made once."""
    if not (folder / "config.json").is_file():
        save_tiny_checkpoint("llama", folder, PROSE)
    return str(folder)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m faast.serve` on a free port, with torch's thread count of this process (bit-for-bit answers need
    the same GEMM kernels and summation order)."""

    def __init__(
        self, ckpt: str, memories: Path, *extra: str, exit_after: float = 600, name: str = NAME, start_s: float = 120
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "faast.serve", "--base", ckpt, "--name", name, "--memories", str(memories),
                "--port", str(self.port), "--threads", str(torch.get_num_threads()), "--exit-after",
                str(exit_after), "--batch-window-ms", "200", *extra]  # fmt: skip
        self.log = memories.parent / f"server-{self.port}.log"
        self.process = subprocess.Popen(args, cwd=ROOT, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})  # fmt: skip
        self._wait_ready(start_s)

    def _wait_ready(self, timeout: float) -> None:
        import httpx2 as httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited ({self.process.returncode}): {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"the server did not start within {timeout} s: {self.log.read_text()[-3000:]}")

    def http(self, key: str | None = None):  # noqa: ANN201 - an httpx2.Client
        import httpx2 as httpx

        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        return httpx.Client(base_url=self.url, timeout=120, headers=headers)

    def openai(self, key: str = "none"):  # noqa: ANN201 - an openai.OpenAI client
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key=key, timeout=120, max_retries=0)

    def kill(self) -> None:
        """SIGKILL: no cleanup of any kind, as a crash."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


class Reference:
    """The same checkpoint in this process with faast applied: what the server must answer."""

    def __init__(self, ckpt: str) -> None:
        base, self.tokenizer, _ = load_base_model(ckpt)
        self.model = apply_faast(base, FaastConfig())

    def learn(self, name: str, texts: list[str]) -> None:
        self.model.learn(texts, tokenizer=self.tokenizer, memory=name, solve=True, progress=False)

    def complete(self, memory: str | None, prompt: str = PROMPT, max_tokens: int = 12) -> str:
        ids = torch.tensor([self.tokenizer(prompt)["input_ids"]])
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), memory_names=[memory or BASE],
                                      max_new_tokens=max_tokens, do_sample=False)  # fmt: skip
        new = out[0, ids.shape[1] :].tolist()
        eos = self.model.base_model.generation_config.eos_token_id
        if eos in new:
            new = new[: new.index(eos)]
        return self.tokenizer.decode(new, skip_special_tokens=True)
