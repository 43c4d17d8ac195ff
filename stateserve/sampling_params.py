"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM's names and meaning)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Validated once, when built; an unknown keyword raises TypeError naming it."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, vLLM's spelling) = no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    # Filled by the engine from the model (eos, generation_config) and not part of the user API.
    _all_stop_token_ids: frozenset[int] = field(default=frozenset(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        if self.stop is None:
            object.__setattr__(self, "stop", [])
        if self.stop_token_ids is None:
            object.__setattr__(self, "stop_token_ids", [])
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"SamplingParams: {msg}")

        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top_k must be 0 or -1 (off) or a positive integer, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0:
            bad(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            bad(f"logprobs must be a non-negative integer, got {self.logprobs!r}")
        if not -2 <= self.presence_penalty <= 2:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            bad(f"stop must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad(f"seed must be an integer, got {self.seed!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def with_stop_ids(self, ids: frozenset[int]) -> "SamplingParams":
        import dataclasses

        return dataclasses.replace(self, _all_stop_token_ids=ids)
