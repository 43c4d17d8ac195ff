"""What the model-state router and the weight loader look for on modules and parameters, declared by the layers.

The router (model_states.resolve_model_state_cls) picks the encoder-decoder state for a model with a
CrossAttentionMarker module and the encoder-only state for one with an EncoderOnlyAttentionMarker; the loader
splits a checkpoint's shards into a parameter that `stacked` marked."""
from __future__ import annotations

from torch import nn


class CrossAttentionMarker:
    """Mixin for modules that attend from decoder to encoder outputs."""


class EncoderOnlyAttentionMarker:
    """Mixin for bidirectional encoder attention modules with no KV cache."""


def stacked(param: nn.Parameter, shard_sizes: list[int]) -> nn.Parameter:
    """Mark a fused parameter made of shards stacked on dim 0 (qkv, gate_up)."""
    param.shard_sizes = shard_sizes  # type: ignore[attr-defined]
    return param
