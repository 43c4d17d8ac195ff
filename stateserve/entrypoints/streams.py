"""What the engine thread hands the event loop: the per-step news of a submission (GroupUpdate, one SeqUpdate per
sample) in a RequestStream, and the two ways a submission can be refused for the engine's sake."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable

import numpy as np

from stateserve.outputs import Logprob


class EngineOverloaded(Exception):
    """The waiting queue is full: the client should retry later (HTTP 503)."""


class EngineDead(RuntimeError):
    """The engine thread stopped (shut down, or a step raised); no more requests can run."""


@dataclass
class SeqUpdate:
    """What one sequence (one of a prompt's n samples) produced since its last update."""

    index: int
    new_token_ids: list[int]
    new_logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str | None = None  # the engine's final text (stop strings cut), only once finished
    new_text: str | None = None  # streamed requests: the text since the last update (what the engine decoded)
    error: str | None = None  # why, when finish_reason is "error" (the engine step running it failed)


@dataclass
class GroupUpdate:
    """One engine step's news about one prompt of a submission."""

    prompt_index: int
    seqs: list[SeqUpdate]
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int
    time: float  # time.perf_counter() when the step that produced it ended
    embedding: np.ndarray | None = None  # an embedding request's float32 vector, once it ran
    prompt_logprobs: list | None = None  # SamplingParams.prompt_logprobs' entries, on the group's last update


class RequestStream:
    """The updates of one submission (one or more prompts), in step order; lives on the event loop."""

    def __init__(self, abort: Callable[[list[str]], None], group_ids: list[str]) -> None:
        self._abort = abort  # AsyncEngine.abort: thread-safe
        self.group_ids = group_ids
        self._queue: asyncio.Queue[GroupUpdate | BaseException] = asyncio.Queue()
        self._unfinished = set(group_ids)

    def _put(self, item: GroupUpdate | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> GroupUpdate:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._unfinished.clear()
            raise item
        if item.finished:
            self._unfinished.discard(self.group_ids[item.prompt_index])
        return item

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def abort(self) -> None:
        """Stop whatever has not finished (client gone, error); frees its cache on the next engine turn."""
        if self._unfinished:
            self._abort(list(self._unfinished))
            self._unfinished.clear()
