"""PoolingParams: what an embedding request asks besides its prompt, with vLLM's name for it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolingParams:
    """truncate_prompt_tokens: keep the prompt's last k tokens (-1: as many as the model takes; None: all), as
    vLLM's left truncation. Resolved against the model's limit by the engine (LLMEngine.resolve_truncation)."""

    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k == 0 or k < -1):
            raise ValueError(f"truncate_prompt_tokens must be None, -1 (the model's limit) or a positive int, "
                             f"got {k!r}")
