"""PoolingLoop: an embedding model's PoolingEngine behind the engine-loop surface that AsyncEngine drives.

AsyncEngine steps the engine it holds on a thread of its own (`has_unfinished`, `step`) and reads a few things
between steps (the scheduler's queues, the caches, the counters). A PoolingEngine has no scheduler and no cache
and its requests end after one forward, so this wrapper gives it that surface. `submit` (run on the engine thread
through AsyncEngine.call) tokenizes, truncates and validates every input of one HTTP request and queues them; each
`step` runs the queued prompts, in arrival order, as one batch of at most max_num_batched_tokens tokens and
max_num_seqs sequences (PoolingEngine.plan_batches), so the prompts of concurrent requests share a forward. A
request's future gets its vectors once its last prompt has run. Nothing is kept between steps, so there is
nothing to free; at shutdown every unanswered future fails with EngineDead."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from stateserve.engine.pooling import PoolingEngine, PoolingRequest
from stateserve.entrypoints.async_engine import EngineDead


def is_pooling(engine: Any) -> bool:
    """True for the engine `stateserve serve` builds for an embedding model."""
    return isinstance(engine, PoolingLoop)


@dataclass
class EmbedResult:
    vectors: list[np.ndarray]  # one float32 vector per input, as the model pools (and normalises) it
    num_tokens: list[int]  # tokens each input ran with (after tokenization and truncation)


@dataclass(eq=False)
class _Job:
    """The inputs of one HTTP request."""

    future: concurrent.futures.Future
    requests: list[PoolingRequest]
    vectors: list[np.ndarray | None]
    left: int


class _Queues:
    """What AsyncEngine reads of a scheduler: prompts waiting to be embedded, and the batch being embedded."""

    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[tuple[_Job, int]] = deque()
        self.running: list[tuple[_Job, int]] = []


class _NoCache:
    """An encoder keeps no KV blocks and no state slots."""

    block_pool = None
    slot_pool = None

    @staticmethod
    def is_idle_and_full() -> bool:
        return True


class PoolingLoop:
    def __init__(self, engine: PoolingEngine) -> None:
        self.pooling = engine
        self.config = engine.config
        # clients see the encoder's real prompt limit (sentence-transformers' max_seq_length, say), as vLLM reports
        self.model_config = dataclasses.replace(engine.model_config, max_model_len=engine.max_len)
        hf = engine.model_config.hf_config
        # the pooler concatenates one hidden-size vector per pooling mode
        self.embedding_size = int(hf.hidden_size) * len(engine.pooling_config.modes)
        self.normalize = engine.pooling_config.normalize
        # Matryoshka support, declared as vLLM reads it from config.json: is_matryoshka (any size up to the full
        # one) or matryoshka_dimensions (only those sizes)
        dims = getattr(hf, "matryoshka_dimensions", None)
        self.matryoshka_dimensions = sorted(int(d) for d in dims) if dims else None
        self.is_matryoshka = bool(dims) or bool(getattr(hf, "is_matryoshka", False))
        self.scheduler = _Queues(self.config.max_num_seqs)
        self.cache = _NoCache()
        self.groups: dict[str, Any] = {}  # generation requests: never any here
        self.last_updated: list[str] = []
        self.stats = {"prompt_tokens": 0}
        self._jobs: set[_Job] = set()

    # ---- pure checks of the request's options (config reads only: safe from the event loop) --------------
    def resolve_truncation(self, truncate_prompt_tokens: int | None) -> int | None:
        """How many last tokens to keep (None: all); ValueError for a value the encoder cannot take."""
        return self.pooling._truncation(truncate_prompt_tokens)

    def resolve_dimensions(self, dimensions: int | None) -> int:
        """The vector size to answer with; ValueError unless the model can give it."""
        full = self.embedding_size
        if dimensions is None or dimensions == full:
            return full
        if dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {dimensions}")
        if not self.is_matryoshka:
            raise ValueError(f"this model does not support matryoshka representation, so its {full}-dimensional "
                             f"vectors cannot be shortened: dimensions must be omitted or {full}, got {dimensions}")
        if self.matryoshka_dimensions is not None and dimensions not in self.matryoshka_dimensions:
            raise ValueError(f"this model supports dimensions {self.matryoshka_dimensions} (or {full}), "
                             f"got {dimensions}")
        if dimensions > full:
            raise ValueError(f"dimensions must be at most this model's size {full}, got {dimensions}")
        return dimensions

    # ---- engine thread -----------------------------------------------------------------------------------
    def submit(self, inputs: list[str | list[int]], keep_last: int | None) -> concurrent.futures.Future:
        """Tokenize, truncate to the last `keep_last` tokens and validate every input, then queue them all; a bad
        input raises ValueError naming it and queues nothing. The future resolves to an EmbedResult."""
        requests = []
        for i, item in enumerate(inputs):
            prompt = item if isinstance(item, str) else {"prompt_token_ids": item}
            try:
                requests.append(self.pooling.make_request(prompt, keep_last))
            except ValueError as e:
                raise ValueError(f"input[{i}]: {e}") from None
        job = _Job(concurrent.futures.Future(), requests, [None] * len(requests), len(requests))
        if not requests:
            job.future.set_result(EmbedResult([], []))
            return job.future
        self._jobs.add(job)
        self.scheduler.waiting.extend((job, i) for i in range(len(requests)))
        self.stats["prompt_tokens"] += sum(r.num_tokens for r in requests)
        return job.future

    def validate_prompt(self, token_ids: list[int]) -> None:
        """AsyncEngine's generation path: refused (the server answers 400 before it gets here)."""
        raise ValueError(f"{self.model_config.architecture} is an embedding model: it cannot generate text")

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting)

    def step(self) -> list[str]:
        """Embed the next batch of waiting prompts; returns no generation groups (there are none)."""
        waiting = self.scheduler.waiting
        if any(job.future.cancelled() for job, _ in waiting):  # their clients went away
            self._jobs = {job for job in self._jobs if not job.future.cancelled()}
            self.scheduler.waiting = waiting = deque(x for x in waiting if not x[0].future.cancelled())
        if not waiting:
            return []
        head = [job.requests[i] for job, i in itertools.islice(waiting, self.scheduler.max_num_seqs)]
        count = len(self.pooling.plan_batches(head)[0])
        items = [waiting.popleft() for _ in range(count)]
        self.scheduler.running = items
        try:
            vectors = self.pooling.run_batch([job.requests[i] for job, i in items]).float().cpu().numpy()
        finally:
            self.scheduler.running = []
        for (job, i), vector in zip(items, vectors):
            job.vectors[i] = vector
            job.left -= 1
            if job.left == 0:
                self._jobs.discard(job)
                _settle(job.future, EmbedResult(job.vectors, [r.num_tokens for r in job.requests]))
        return []

    def check_integrity(self) -> None:
        if self.scheduler.running:
            raise RuntimeError(f"{len(self.scheduler.running)} prompt(s) still marked as running")

    def shutdown(self) -> None:
        error = EngineDead("the engine has been shut down")
        for job in self._jobs:
            _settle(job.future, None, error)
        self._jobs.clear()
        self.scheduler.waiting.clear()
        self.pooling.shutdown()


def _settle(future: concurrent.futures.Future, result: Any, error: BaseException | None = None) -> None:
    """Answer a future unless its waiter cancelled it (which may happen at any moment, from the event loop)."""
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass
