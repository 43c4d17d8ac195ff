"""Mamba2ForCausalLM: embeddings, pre-norm blocks of one Mamba2 mixer each, final RMSNorm, LM head.

Weight names are transformers' (backbone.embeddings, backbone.layers.N.{norm, mixer.*}, backbone.norm_f, lm_head);
older checkpoints that call the embeddings `backbone.embedding` load too. With residual_in_fp32 the residual stream
is kept in float32 and each block's norm sees it cast back to the model dtype, as in transformers."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stateserve.layers.mamba2_mixer import Mamba2Mixer
from stateserve.layers.metadata import ForwardMeta, StateMetadata
from stateserve.layers.norm import RMSNorm
from stateserve.models.base import ModelBase


def mamba2_mixer_from_config(cfg: Any, dtype: torch.dtype) -> Mamba2Mixer:
    intermediate = int(cfg.expand * cfg.hidden_size)
    if intermediate != cfg.num_heads * cfg.head_dim:
        raise ValueError(f"Mamba2 config: hidden_size * expand ({intermediate}) must equal num_heads * head_dim "
                         f"({cfg.num_heads * cfg.head_dim})")
    return Mamba2Mixer(
        hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, head_dim=cfg.head_dim, state_size=cfg.state_size,
        n_groups=cfg.n_groups, conv_kernel=cfg.conv_kernel, chunk_size=cfg.chunk_size,
        intermediate_size=intermediate, use_conv_bias=cfg.use_conv_bias, use_bias=cfg.use_bias,
        activation=cfg.hidden_act, norm_eps=cfg.layer_norm_epsilon,
        time_step_limit=tuple(cfg.time_step_limit), time_step_min=cfg.time_step_min,
        time_step_max=cfg.time_step_max, time_step_floor=cfg.time_step_floor, dtype=dtype)


class Mamba2Block(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.mixer = mamba2_mixer_from_config(cfg, dtype)
        self.residual_in_fp32 = bool(cfg.residual_in_fp32)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, meta: StateMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] the previous block's mixer output (the embeddings for the first block, residual None);
        residual: the stream so far, float32 with residual_in_fp32. -> (this mixer's output, the stream including x).
        The add x + residual happens here, fused with the norm, rather than at the end of the previous block."""
        normed, residual = self.norm.add_forward(x, residual, stream_float32=self.residual_in_fp32)
        return self.mixer(normed, meta), residual


class Mamba2Backbone(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Mamba2Block(cfg, dtype) for _ in range(cfg.num_hidden_layers))
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)


class Mamba2ForCausalLM(ModelBase):
    pipeline_layers, pipeline_carry = "backbone.layers", 2
    is_attention_free = True

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__(hf_config)
        self.backbone = Mamba2Backbone(hf_config, dtype)
        self.lm_head = nn.Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False)
        if getattr(hf_config, "tie_word_embeddings", False):
            self.tied_params = {"lm_head.weight": "backbone.embeddings.weight"}
            self.tie_weights_()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        if meta.state is None:
            raise RuntimeError("Mamba2ForCausalLM needs state metadata (ForwardMeta.state)")
        x = self.backbone.embeddings(input_ids)  # [T, hidden]
        residual = None
        for layer in self.backbone.layers:
            x, residual = layer(x, residual, meta.state)
        # norm_f sees the float32 stream itself (not cast to the model dtype), as in transformers
        return self.backbone.norm_f(residual + x)  # [T, hidden]; float32 when residual_in_fp32

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # the model dtype, as transformers casts it (the final norm's: a quantized head or embedding has no
        # float weight)
        return self.lm_head(hidden.to(self.backbone.norm_f.weight.dtype))

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        if name.startswith("backbone.embedding."):
            name = "backbone.embeddings." + name[len("backbone.embedding."):]
        return name, None
