"""MiniMax (MiniMax-Text-01): a hybrid decoder of lightning attention layers (linear attention with a fixed decay
per head, a recurrent [H, D, D] state; layers/lightning.py) and full softmax attention layers (GQA, rotary), each
followed by a top-k softmax MoE (block_sparse_moe, Mixtral's experts w1/w2/w3).

Per transformers' MiniMaxForCausalLM: `layer_types` picks each layer's mixer ("linear_attention" or
"full_attention"). A layer's residual is the *normed* input, and both residual sums are weighted:

    h = norm1(x);  h = alpha_attn * h + beta_attn * attn(h);  h = norm2(h);  out = alpha_mlp * h + beta_mlp * moe(h)

(linear_attn_* or full_attn_* factors by the layer's kind, mlp_* for the MoE)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stateserve.layers.lightning import LightningAttention
from stateserve.layers.metadata import ForwardMeta
from stateserve.layers.moe import SparseMoE
from stateserve.layers.norm import RMSNorm
from stateserve.layers.qkv_attention import QKV_SHARDS, QKVAttention
from stateserve.layers.rotary import RotaryEmbedding, rope_parameters
from stateserve.models.base import ModelBase

LAYER_TYPES = ("linear_attention", "full_attention")
# copies of the lightning layers' decay rates that transformers saves as buffers: recomputed here, not loaded
_DECAY_BUFFERS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")


def layer_types(cfg: Any) -> list[str]:
    types = list(getattr(cfg, "layer_types", None) or [])[:cfg.num_hidden_layers]
    bad = sorted({str(t) for t in types} - set(LAYER_TYPES))
    if bad:
        raise ValueError(f"MiniMax: layer_types has unknown layer type(s) {bad}; each layer must be one of "
                         f"{LAYER_TYPES}")
    if len(types) != cfg.num_hidden_layers:
        raise ValueError(f"MiniMax: layer_types must name {cfg.num_hidden_layers} layers; got {types}")
    return types


def _check_config(cfg: Any) -> None:
    """Options this implementation does not run, refused by name rather than computed wrongly."""
    if getattr(cfg, "sliding_window", None) is not None:
        raise ValueError(f"MiniMax: sliding_window={cfg.sliding_window} is not supported (the released models use "
                         "full attention; set it to null)")


class MiniMaxDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, layer_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_type = layer_type
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        if layer_type == "linear_attention":
            self.self_attn: nn.Module = LightningAttention(cfg.hidden_size, heads, head_dim, layer_idx,
                                                           cfg.num_hidden_layers, cfg.hidden_act)
            self.attn_alpha, self.attn_beta = cfg.linear_attn_alpha_factor, cfg.linear_attn_beta_factor
        else:
            # yarn as transformers' MiniMaxRotaryEmbedding runs it (attention_factor on cos and sin)
            rotary = RotaryEmbedding(head_dim, rope_parameters(cfg), cfg.max_position_embeddings, yarn=True)
            self.self_attn = QKVAttention(cfg.hidden_size, heads, cfg.num_key_value_heads or heads, head_dim,
                                          dtype=dtype, rotary=rotary)
            self.attn_alpha, self.attn_beta = cfg.full_attn_alpha_factor, cfg.full_attn_beta_factor
        self.mlp_alpha, self.mlp_beta = cfg.mlp_alpha_factor, cfg.mlp_beta_factor
        self.mlp = SparseMoE(cfg.num_local_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.intermediate_size,
                             norm_topk_prob=True, activation=cfg.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        # x: [T, hidden], positions: [T] -> [T, hidden]
        h = self.input_layernorm(x)
        if self.layer_type == "linear_attention":
            mixed = self.self_attn(h, meta.state)
        else:
            mixed = self.self_attn(h, meta.attn, positions)
        h = self.post_attention_layernorm(h * self.attn_alpha + mixed * self.attn_beta)
        return h * self.mlp_alpha + self.mlp(h) * self.mlp_beta


class MiniMaxModel(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(MiniMaxDecoderLayer(cfg, i, t, dtype) for i, t in enumerate(layer_types(cfg)))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MiniMaxForCausalLM(ModelBase):
    fused_experts = "gated"  # 3-D fused expert tensors load too, split per expert (ModelBase.expand_weight)
    is_hybrid = True

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__(hf_config)
        _check_config(hf_config)
        self.model = MiniMaxModel(hf_config, dtype)
        self.add_lm_head(hf_config)

    @classmethod
    def resolve_flags(cls, hf_config: Any) -> tuple[bool, bool]:
        """(is_attention_free, is_hybrid): a config may use only one kind of mixer."""
        types = set(layer_types(hf_config))
        return "full_attention" not in types, types == set(LAYER_TYPES)

    @classmethod
    def max_positions(cls, hf_config: Any) -> int | None:
        return getattr(hf_config, "max_position_embeddings", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden [T, hidden]; positions feed only the full-attention layers' rotary
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, meta)
        return self.model.norm(x)

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        """transformers 5.24's saved names (block_sparse_moe, experts.N.w1/w2/w3, q/k/v_proj) and its in-memory ones
        (mlp, experts.gate_up_proj / down_proj, split per expert by expand_weight); the lightning layers' decay
        buffers are skipped (recomputed)."""
        name = name.replace(".block_sparse_moe.", ".mlp.")
        parts = name.split(".")
        if len(parts) < 5 or parts[:2] != ["model", "layers"]:
            return name, None
        prefix, rest = ".".join(parts[:4]), ".".join(parts[4:])
        if parts[3] == "mlp":
            target = self.model.layers[int(parts[2])].mlp.map_weight_name(rest)
            return None if target is None else (f"{prefix}.{target[0]}", target[1])
        if parts[3] == "self_attn" and parts[4] in _DECAY_BUFFERS:
            return None
        if parts[3] == "self_attn" and parts[4] in QKV_SHARDS:
            return f"{prefix}.qkv_proj.{parts[-1]}", QKV_SHARDS[parts[4]]
        return name, None
