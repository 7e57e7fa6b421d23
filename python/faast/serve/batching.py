"""The batching loop: requests that arrive within a few milliseconds of each other are generated together, in one
FaastModel.generate call whose rows each read their own memory (`memory_names`: the mixed-batch path, one batched
product per memory layer, docs/serving.md "Many memories in one batch").

One worker thread owns the model's reading. It takes the first waiting request, collects the others that arrive
within `window_s` (up to `max_batch` rows and the house's cap on resident memories), makes their memories resident,
left-pads their prompts and runs greedy generation for the group. Each generated token is handed to its request's
asyncio queue as it is produced (a StoppingCriteria sees every step), so streaming needs nothing more; a row stops at
its own `max_tokens` or end-of-sequence token, and a request whose client left stops its row. Requests that arrive
while a group runs wait for the next group: this is static batching, not continuous batching.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from ..hf.memory_store import BASE
from .memories import MemoryHouse


@dataclass
class Job:
    """One generation request: its prompt's token ids, its memory (None: the base model), how many new tokens,
    and where its tokens go (`out`: an asyncio queue of token ids, then ('end', finish_reason) or an exception)."""

    prompt: list[int]
    memory: str | None
    max_tokens: int
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    cancelled: bool = False
    emitted: int = 0
    done: bool = False
    tokens: list[int] = field(default_factory=list)

    def send(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:  # the event loop has closed (the server is stopping): nobody is waiting
            self.cancelled = True


class _Emit(StoppingCriteria):
    """Hands each row's new token to its job, and tells generate which rows are finished (their own max_tokens, an
    end-of-sequence token, or a client that left)."""

    def __init__(self, jobs: list[Job], prompt_width: int, eos: set[int]) -> None:
        self.jobs, self.width, self.eos = jobs, prompt_width, eos

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        stop = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        last = input_ids[:, -1].tolist()
        for row, job in enumerate(self.jobs):
            if not job.done:
                token = int(last[row])
                if token in self.eos:
                    job.done = True
                    job.send(("end", "stop"))
                else:
                    job.tokens.append(token)
                    job.send(token)
                    if len(job.tokens) >= job.max_tokens:
                        job.done = True
                        job.send(("end", "length"))
                if job.cancelled and not job.done:
                    job.done = True
            stop[row] = job.done
        return stop  # type: ignore[return-value]


class Batcher:
    """The worker thread that generates every request (see the module docstring).

    Args:
        house: the memories and the model (its lock is held while a group generates).
        window_s: how long to wait for more requests after the first one of a group.
        max_batch: the most rows of one group.
    """

    def __init__(self, house: MemoryHouse, *, window_s: float = 0.005, max_batch: int = 16) -> None:
        self.house, self.window_s, self.max_batch = house, window_s, max_batch
        self.inbox: queue.Queue[Job] = queue.Queue()
        self.waiting: list[Job] = []  # taken from the inbox but left for the next group
        self.stopping = threading.Event()
        # the memories of the last 1,000 groups (None: the base model), for /health, the tests and the benchmark
        self.groups: collections.deque[list[str | None]] = collections.deque(maxlen=1000)
        tokenizer, model = house.tokenizer, house.model
        generation: Any = model.base_model.generation_config  # a transformers GenerationConfig
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = generation.pad_token_id
        self.pad = 0 if pad is None else int(pad)
        eos = generation.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.thread = threading.Thread(target=self._run, name="faast-batcher", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        self.inbox.put(job)

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=30)

    def _take(self, timeout: float) -> Job | None:
        if self.waiting:
            return self.waiting.pop(0)
        try:
            return self.inbox.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return None

    def _run(self) -> None:
        while not self.stopping.is_set():
            first = self._take(0.1)
            if first is None:
                continue
            group, deadline = [first], time.monotonic() + self.window_s
            left: list[Job] = []
            while len(group) < self.max_batch:
                job = self._take(deadline - time.monotonic())
                if job is None:
                    break
                memories = {j.memory for j in group if j.memory is not None}
                if job.memory is not None and job.memory not in memories and len(memories) >= self.house.max_resident:
                    left.append(job)  # one memory too many for this group: the next group takes it
                    continue
                group.append(job)
            self.waiting[:0] = left
            group = [j for j in group if not j.cancelled]
            if group:
                self._generate(group)

    def _generate(self, jobs: list[Job]) -> None:
        try:
            width = max(len(j.prompt) for j in jobs)
            ids = torch.full((len(jobs), width), self.pad, dtype=torch.long)
            mask = torch.zeros((len(jobs), width), dtype=torch.long)
            for row, job in enumerate(jobs):  # left padding: every row's next token is at the last column
                ids[row, width - len(job.prompt) :] = torch.tensor(job.prompt, dtype=torch.long)
                mask[row, width - len(job.prompt) :] = 1
            names = [BASE if j.memory is None else j.memory for j in jobs]
            with self.house.lock:
                self.house.make_resident([j.memory for j in jobs if j.memory is not None])
                self.groups.append([j.memory for j in jobs])
                model = self.house.model
                device = next(model.base_model.parameters()).device
                emit = _Emit(jobs, width, self.eos)
                with torch.no_grad():
                    model.generate(
                        ids.to(device),
                        attention_mask=mask.to(device),
                        memory_names=names,
                        max_new_tokens=max(j.max_tokens for j in jobs),
                        do_sample=False,
                        stopping_criteria=StoppingCriteriaList([emit]),
                        pad_token_id=self.pad,
                    )
        except Exception as err:  # noqa: BLE001 - every waiting client gets the error rather than a hang
            for job in jobs:
                if not job.done:
                    job.done = True
                    job.send(err)
            return
        for job in jobs:  # generate stopped at its max_new_tokens before a row said so
            if not job.done:
                job.done = True
                job.send(("end", "length"))
