"""Results returned by LLM.generate / LLM.embed (vLLM's names)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # finish_reason "error": why (the step running this sample raised; its cache and state were discarded and it
    # keeps the tokens it had before). vLLM reports such request-level failures with finish_reason "error" too.
    error: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Speculative decoding counters of a request (summed over its n samples); RequestOutput.metrics is None
    when speculation is off."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verify step emitted on average: the accepted drafts plus the one every step samples."""
        return 1 + self.num_accepted_tokens / self.num_verify_steps if self.num_verify_steps else None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # SamplingParams.prompt_logprobs: None first
    metrics: RequestMetrics | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]
    error: str | None = None  # set (and the embedding empty) when the step running the prompt failed


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    prompt: str | None = field(default=None)
