"""What every model class provides to the runner.

A model: forward(input_ids [T], positions [T], meta) -> hidden [T, hidden]; compute_logits(hidden [n, hidden])
-> [n, vocab]; class flags is_attention_free / is_hybrid; map_weight_name for checkpoint names.
Layers that need a cache expose cache_spec()/bind_cache(); the model never allocates one."""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from stateserve.layers.metadata import ForwardMeta


class ModelBase(nn.Module):
    is_attention_free: ClassVar[bool] = False
    is_hybrid: ClassVar[bool] = False
    # param name -> the param it shares storage with (tied embeddings); not read from checkpoints
    tied_params: ClassVar[dict[str, str]] = {}

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.config = hf_config

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        """Checkpoint tensor name -> (parameter name, shard index or None); None skips the tensor."""
        return name, None

    def add_lm_head(self, cfg: Any, embed_param: str = "model.embed_tokens.weight", tie_default: bool = False) -> None:
        """The output projection, sharing the embedding matrix when the config ties them."""
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if getattr(cfg, "tie_word_embeddings", tie_default):
            self.tied_params = {"lm_head.weight": embed_param}
            self.tie_weights_()

    def tie_weights_(self) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        for dst, src in self.tied_params.items():
            module_name, _, attr = dst.rpartition(".")
            setattr(self.get_submodule(module_name), attr, params[src])

    def release_caches(self) -> None:
        """Drop module-level caches (rotary tables) and cache views; called at shutdown."""
        for m in self.modules():
            if m is not self and callable(getattr(m, "release", None)):
                m.release()


def stacked(param: nn.Parameter, shard_sizes: list[int]) -> nn.Parameter:
    """Mark a fused parameter made of shards stacked on dim 0 (qkv, gate_up)."""
    param.shard_sizes = shard_sizes  # type: ignore[attr-defined]
    return param
