"""One sequence being generated, or one prompt being embedded (params: PoolingParams). Token ids are prompt +
output; `num_computed_tokens` of them are in the cache."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from stateserve.outputs import Logprob
from stateserve.pooling_params import PoolingParams
from stateserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams
    arrival_index: int
    prompt: str | None = None
    group_id: str = ""  # the user's request id; differs from request_id only when n > 1
    generator: torch.Generator | None = None  # only for requests with their own seed
    fairness_key: str = ""  # admission is fair between keys (engine/fair_queue.py); default: the group id
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    block_ids: list[int] = field(default_factory=list)  # one per logical block; NO_BLOCK where a window gave it back
    num_released_blocks: int = 0  # leading block_ids given back by a sliding-window cache (owned by CacheManager)
    state_slot: int | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # stop | length | abort | error (a pooled prompt ends with stop)
    stop_reason: int | str | None = None
    error: str | None = None  # why it failed, when finish_reason is "error"
    output_text: str = ""
    detok: Any = None  # engine.detokenizer.IncrementalDetokenizer, for stop strings and streamed text
    num_preemptions: int = 0
    # speculative decoding: draft tokens to verify after the last known token in this step (never in token_ids, so
    # block keys, snapshots and outputs only ever see committed tokens), and the request's counters (SpecStats)
    spec_token_ids: list[int] = field(default_factory=list)
    spec: Any = None
    constraint: Any = None  # runner.structured.Constraint of a request with structured_outputs
    # prefix cache bookkeeping (owned by CacheManager)
    cache_extra: bytes = b""  # folded into every block key: anything besides tokens that changes the cache
    block_hashes: list[bytes] = field(default_factory=list)
    num_published_blocks: int = 0
    restore_key: bytes | None = None  # snapshot to load into the state slot when it is allocated
    prefix_matched: bool = False
    # encoder-decoder models: the processed encoder input (model_states.encoder_decoder.EncoderInput)
    encoder_input: Any = None
    # pooling models: segment ids of the prompt's tokens (optional), and the pooled vector once it ran
    token_type_ids: list[int] | None = None
    embedding: torch.Tensor | None = None  # [D] float32, on the CPU

    # prompt_logprobs: None for the first prompt token, then each one's entry, filled as the prompt's chunks run
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def __post_init__(self) -> None:
        self.group_id = self.group_id or self.request_id
        self.fairness_key = self.fairness_key or self.group_id
        self.token_ids = list(self.prompt_token_ids)
        if not self.is_pooling and self.params.logprobs is not None:
            self.logprobs = []
        if self.wants_prompt_logprobs:
            self.prompt_logprobs = [None]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt's logits are needed, so no prefix-cache hit may skip computing them."""
        return not self.is_pooling and self.params.prompt_logprobs is not None

    @property
    def is_pooling(self) -> bool:
        return isinstance(self.params, PoolingParams)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
