"""Mamba (Mamba1) and FalconMamba causal LMs: attention-free stacks of RMSNorm + selective-SSM mixer blocks.

FalconMamba differs only by parameter-free RMS norms on the mixer's dt, B and C (eps = mixer_rms_eps).
Parameter names match transformers' checkpoints (backbone.embeddings, backbone.layers.N.mixer.*, backbone.norm_f,
lm_head). With residual_in_fp32 the residual stream between blocks is kept in float32, as transformers does."""
from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import nn

from stateserve.layers.metadata import ForwardMeta, StateMetadata
from stateserve.layers.norm import RMSNorm
from stateserve.layers.selective_scan import MambaMixer
from stateserve.models.base import ModelBase


def _time_step_rank(cfg: Any) -> int:
    rank = getattr(cfg, "time_step_rank", "auto")
    return math.ceil(cfg.hidden_size / 16) if rank == "auto" else int(rank)


class MambaBlock(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, bcdt_norm: str | None, mixer_eps: float) -> None:
        super().__init__()
        self.residual_in_fp32 = bool(getattr(cfg, "residual_in_fp32", True))
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        intermediate = getattr(cfg, "intermediate_size", None) or int(cfg.expand * cfg.hidden_size)
        self.mixer = MambaMixer(
            hidden_size=cfg.hidden_size, intermediate_size=int(intermediate), state_size=cfg.state_size,
            conv_kernel=cfg.conv_kernel, time_step_rank=_time_step_rank(cfg), use_conv_bias=cfg.use_conv_bias,
            use_bias=cfg.use_bias, bcdt_norm=bcdt_norm, rms_eps=mixer_eps, dtype=dtype,
            activation=getattr(cfg, "hidden_act", "silu"))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, meta: StateMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden_size] the previous block's mixer output (the embeddings for the first block, residual
        None); residual: the stream so far, float32 with residual_in_fp32. -> (this mixer's output, the stream
        including x): the add happens here, fused with the norm."""
        normed, residual = self.norm.add_forward(x, residual, stream_float32=self.residual_in_fp32)
        return self.mixer(normed, meta), residual


class MambaBackbone(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, bcdt_norm: str | None, mixer_eps: float) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(MambaBlock(cfg, dtype, bcdt_norm, mixer_eps)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)


class MambaForCausalLM(ModelBase):
    pipeline_layers, pipeline_carry = "backbone.layers", 2
    is_attention_free: ClassVar[bool] = True
    bcdt_norm: ClassVar[str | None] = None

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__(hf_config)
        cfg = hf_config
        act = getattr(cfg, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"{type(self).__name__}: hidden_act={act!r} is not supported (only 'silu')")
        self.backbone = MambaBackbone(cfg, dtype, self.bcdt_norm, self._mixer_eps(cfg))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # transformers' Mamba configs default to tied embeddings
        if getattr(cfg, "tie_word_embeddings", True):
            self.tied_params = {"lm_head.weight": "backbone.embeddings.weight"}
            self.tie_weights_()

    @staticmethod
    def _mixer_eps(cfg: Any) -> float:
        return 1e-6

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        if meta.state is None:
            raise RuntimeError(f"{type(self).__name__} needs StateMetadata (a recurrent model state)")
        x = self.backbone.embeddings(input_ids)  # [T, hidden]
        residual = None
        for layer in self.backbone.layers:
            x, residual = layer(x, residual, meta.state)
        # transformers normalises the (possibly float32) stream, then casts to the head's dtype
        return self.backbone.norm_f(residual + x).to(self.backbone.norm_f.weight.dtype)  # the model dtype

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # the model dtype, as transformers casts it (the final norm's: a quantized head or embedding has no
        # float weight)
        return self.lm_head(hidden.to(self.backbone.norm_f.weight.dtype))

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        # old Mamba checkpoints call the embedding "embedding"; transformers renames it on load
        if "backbone.embedding." in name:
            name = name.replace("backbone.embedding.", "backbone.embeddings.")
        return name, None


class FalconMambaForCausalLM(MambaForCausalLM):
    bcdt_norm: ClassVar[str | None] = "weightless"

    @staticmethod
    def _mixer_eps(cfg: Any) -> float:
        return float(getattr(cfg, "mixer_rms_eps", 1e-6))

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        # the dt/B/C norms have no weights; a checkpoint may still carry their dummy all-ones buffers
        if name.endswith(("dt_layernorm.weight", "b_layernorm.weight", "c_layernorm.weight")):
            return None
        return name, None
