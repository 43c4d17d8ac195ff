"""Zamba (v1, transformers 5.24 ZambaForCausalLM): a stack of multi-head Mamba1 layers where the "hybrid" layers
first run one shared transformer block whose output, through a per-layer linear, is added to that Mamba layer's
input. The structure is Zamba2's (models/zamba2.py owns it: the hybrid layer, the per-depth KV caches, the
tie-or-copy rule for the shared block's weights, the forward); what Zamba v1 changes is owned here:
- one shared block (Zamba2's num_mem_blocks = 1), with no LoRA adapters and no rotary (the attention has no
  positional encoding: the Mamba layers carry position); attention over the 2 * hidden concatenation with score
  scale (head_dim / 2) ** -0.5, as Zamba2's;
- the shared MLP is a gated MLP with hidden_act (gelu by default) whose gate and up are separate tensors;
- the Mamba layers are layers/zamba_mamba.py's ZambaMambaMixer (Mamba1 split into n_mamba_heads heads with their
  own x_proj / dt_proj, in_proj rows interleaved), not Mamba2;
- checkpoint names say shared_transf where Zamba2 says shared_transformer."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from stateserve.layers.attention import Attention
from stateserve.layers.metadata import AttnMetadata
from stateserve.layers.moe import GatedMLPExpert
from stateserve.layers.norm import RMSNorm
from stateserve.layers.zamba_mamba import ZambaMambaMixer
from stateserve.models.base import ModelBase
from stateserve.models.zamba2 import (Zamba2ForCausalLM, Zamba2MambaLayer, Zamba2Model, Zamba2SharedAttention,
                                      layer_kinds)

_GATE_UP = {"gate_proj": 0, "up_proj": 1}


class ZambaSharedBlock(nn.Module):
    """input_layernorm over concat[x, embeddings] -> attention -> pre_ff_layernorm -> gated MLP."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.self_attn = Zamba2SharedAttention(cfg, num_depths=0, block_id=0)  # no adapters, no rotary
        self.feed_forward = GatedMLPExpert(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act,
                                           fused_checkpoint=False)
        self.input_layernorm = RMSNorm(cfg.attention_hidden_size, cfg.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, embeddings: torch.Tensor, depth: int, attn: Attention,
                positions: torch.Tensor, meta: AttnMetadata, rope_lens: torch.Tensor | None) -> torch.Tensor:
        # x, embeddings: [T, hidden] -> [T, hidden]; `depth` is unused (no per-depth adapters in v1)
        h = self.input_layernorm(torch.cat([x, embeddings], dim=-1))
        h = self.self_attn(h, depth, attn, positions, meta, rope_lens)
        return self.feed_forward(self.pre_ff_layernorm(h))


def _dt_rank(cfg: Any) -> int:
    rank = getattr(cfg, "mamba_dt_rank", "auto")
    return math.ceil(cfg.hidden_size / 16) if rank == "auto" else int(rank)


def zamba_mamba_layer(cfg: Any, dtype: torch.dtype) -> Zamba2MambaLayer:
    mixer = ZambaMambaMixer(
        hidden_size=cfg.hidden_size, intermediate_size=int(cfg.mamba_expand * cfg.hidden_size),
        state_size=cfg.mamba_d_state, conv_kernel=cfg.mamba_d_conv, time_step_rank=_dt_rank(cfg),
        num_heads=cfg.n_mamba_heads, use_conv_bias=bool(cfg.mamba_conv_bias), use_bias=bool(cfg.mamba_proj_bias),
        dtype=dtype, activation=getattr(cfg, "hidden_mamba_act", "silu"))
    return Zamba2MambaLayer(cfg, dtype, mixer)


def _check_config(cfg: Any) -> None:
    expected = 2 * cfg.hidden_size
    if getattr(cfg, "attention_hidden_size", expected) != expected:
        raise ValueError(f"Zamba: attention_hidden_size={cfg.attention_hidden_size} is not supported; the shared "
                         f"block attends over concat[hidden, embeddings], so it must be 2 * hidden_size = {expected}")
    act = getattr(cfg, "hidden_mamba_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"Zamba: hidden_mamba_act={act!r} is not supported (only 'silu')")


class ZambaForCausalLM(Zamba2ForCausalLM):
    """Zamba2's forward over a model built from Zamba v1's pieces (see the module docstring)."""
    is_hybrid = True

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        ModelBase.__init__(self, hf_config)  # Zamba2's __init__ builds Zamba2's pieces and checks Zamba2's options
        cfg = hf_config
        _check_config(cfg)
        self.dynamic_rope = False  # no rotary anywhere
        self.model = Zamba2Model(cfg, dtype, family="Zamba", num_blocks=1,
                                 make_block=lambda depths, block_id: ZambaSharedBlock(cfg),
                                 make_mamba=lambda: zamba_mamba_layer(cfg, dtype))
        self.add_lm_head(cfg, tie_default=True)  # ZambaConfig ties by default

    @classmethod
    def resolve_flags(cls, hf_config: Any) -> tuple[bool, bool]:
        """(is_attention_free, is_hybrid): without hybrid layers Zamba is a pure (multi-head) Mamba stack."""
        has_attention = "hybrid" in layer_kinds(hf_config, "Zamba")
        return not has_attention, has_attention

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        name = name.replace(".shared_transf.", ".shared_transformer.")
        parts = name.split(".")
        if (len(parts) == 7 and parts[3] == "shared_transformer" and parts[4] == "feed_forward"
                and parts[5] in _GATE_UP):
            layer = int(parts[2])
            if self.model.first_use.get(layer, layer) != layer:
                return None  # a tied copy of the block's weights at its first depth
            return ".".join(parts[:5] + ["gate_up_proj", parts[6]]), _GATE_UP[parts[5]]
        return super().map_weight_name(name)
