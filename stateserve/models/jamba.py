"""Jamba: a hybrid decoder of Mamba1 layers (selective SSM with RMS-normed dt, B and C; recurrent state) and
plain attention layers (paged KV, no positional encoding at all), with sparse MoE feed-forwards on some layers.

Per transformers' JambaForCausalLM:
  layer i is attention when i % attn_layer_period == attn_layer_offset, else Mamba;
  layer i is MoE when i % expert_layer_period == expert_layer_offset (and num_experts > 1), else a gated MLP;
  the router is softmax over all experts, then the top k, *not* renormalised;
  every block is x + mixer(input_layernorm(x)), then x + ffn(pre_ff_layernorm(x)); final_layernorm at the end.
Checkpoint names load 1:1 (transformers saves the experts per expert: experts.N.{gate,up,down}_proj.weight; its
in-memory 3-D experts.gate_up_proj / down_proj are split per expert on load, ModelBase.expand_weight);
only q/k/v and gate/up are fused into one matmul here. use_mamba_kernels / use_mambapy / use_associative_scan
pick implementations in transformers and do not change the arithmetic, so they are accepted and ignored."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from stateserve.layers.metadata import ForwardMeta
from stateserve.layers.moe import GatedMLPExpert, SparseMoE
from stateserve.layers.norm import RMSNorm
from stateserve.layers.qkv_attention import QKV_SHARDS, QKVAttention
from stateserve.layers.selective_scan import MambaMixer
from stateserve.models.base import ModelBase

_GATE_UP = {"gate_proj": 0, "up_proj": 1}


def block_types(cfg: Any) -> list[str]:
    """'attention' or 'mamba' per layer, as JambaConfig.layers_block_type."""
    period, offset = int(cfg.attn_layer_period), int(cfg.attn_layer_offset)
    if not 0 <= offset < period:
        raise ValueError(f"attn_layer_offset={offset} must be in [0, attn_layer_period={period})")
    return ["attention" if i % period == offset else "mamba" for i in range(cfg.num_hidden_layers)]


def experts_of_layer(cfg: Any, index: int) -> int:
    """Routed experts of layer `index` (1 means a dense MLP), as JambaConfig.layers_num_experts."""
    period, offset = int(cfg.expert_layer_period), int(cfg.expert_layer_offset)
    if not 0 <= offset < period:
        raise ValueError(f"expert_layer_offset={offset} must be in [0, expert_layer_period={period})")
    return int(cfg.num_experts) if index % period == offset else 1


def mamba_dt_rank(cfg: Any) -> int:
    rank = getattr(cfg, "mamba_dt_rank", "auto")
    return math.ceil(cfg.hidden_size / 16) if rank == "auto" else int(rank)


class JambaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, index: int, block_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.block_type = block_type
        if block_type == "attention":
            self.self_attn = QKVAttention.from_config(cfg, dtype)
        else:
            self.mamba = MambaMixer(
                hidden_size=cfg.hidden_size, intermediate_size=int(cfg.mamba_expand * cfg.hidden_size),
                state_size=cfg.mamba_d_state, conv_kernel=cfg.mamba_d_conv, time_step_rank=mamba_dt_rank(cfg),
                use_conv_bias=bool(cfg.mamba_conv_bias), use_bias=bool(cfg.mamba_proj_bias), bcdt_norm="weighted",
                rms_eps=cfg.rms_norm_eps, dtype=dtype, activation=cfg.hidden_act)
        num_experts = experts_of_layer(cfg, index)
        if num_experts > 1:
            self.feed_forward: nn.Module = SparseMoE(
                num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.intermediate_size,
                norm_topk_prob=False, activation=cfg.hidden_act, router_mode="softmax_topk")
        else:
            self.feed_forward = GatedMLPExpert(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act,
                                               fused_checkpoint=False)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        h = self.input_layernorm(x)
        h = self.self_attn(h, meta.attn) if self.block_type == "attention" else self.mamba(h, meta.state)
        x = x + h
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class JambaModel(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(JambaDecoderLayer(cfg, i, t, dtype) for i, t in enumerate(block_types(cfg)))
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class JambaForCausalLM(ModelBase):
    pipeline_layers, pipeline_carry = "model.layers", 1
    fused_experts = "gated"  # 3-D fused expert tensors load too, split per expert (ModelBase.expand_weight)
    is_hybrid = True

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__(hf_config)
        cfg = hf_config
        self.model = JambaModel(cfg, dtype)
        self.add_lm_head(cfg)

    @classmethod
    def resolve_flags(cls, hf_config: Any) -> tuple[bool, bool]:
        """(is_attention_free, is_hybrid): a period/offset may leave only one kind of layer in a short stack."""
        types = set(block_types(hf_config))
        return "attention" not in types, types == {"attention", "mamba"}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        # positions are unused: Jamba has no positional encoding
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        for layer in self.model.layers:
            x = layer(x, meta)
        return self.model.final_layernorm(x)

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        parts = name.split(".")
        if (len(parts) > 4 and parts[:2] == ["model", "layers"] and parts[3] == "feed_forward"
                and parts[2].isdigit() and int(parts[2]) < len(self.model.layers)):
            prefix, rest = ".".join(parts[:4]), ".".join(parts[4:])
            ffn = self.model.layers[int(parts[2])].feed_forward
            if isinstance(ffn, SparseMoE):
                target = ffn.map_weight_name(rest)
                return None if target is None else (f"{prefix}.{target[0]}", target[1])
            if parts[4] in _GATE_UP:
                return f"{prefix}.gate_up_proj.{parts[-1]}", _GATE_UP[parts[4]]
            return name, None
        if len(parts) >= 3 and parts[-3] == "self_attn" and parts[-2] in QKV_SHARDS:
            return ".".join(parts[:-2] + ["qkv_proj", parts[-1]]), QKV_SHARDS[parts[-2]]
        return name, None
