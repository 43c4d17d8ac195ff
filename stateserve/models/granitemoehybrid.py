"""GraniteMoeHybrid (Granite 4.0-H): a decoder whose layers are Mamba2 mixers or attention (`layer_types`), each
followed by a top-k MoE with a shared expert (or only the shared MLP when num_local_experts is 0).

Per transformers' GraniteMoeHybridForCausalLM: embeddings are scaled by embedding_multiplier; every sub-block
output is scaled by residual_multiplier before it joins the residual stream; attention scores use
attention_multiplier as their scale (not head_dim ** -0.5); rotary only with position_embedding_type "rope";
logits are divided by logits_scaling. The Mamba2 layers are transformers' Bamba mixer (gated RMSNorm with eps
rms_norm_eps, dt_bias initialised to ones).

Checkpoint names are transformers' (model.layers.N.{mamba, self_attn, block_sparse_moe, shared_mlp,
input_layernorm, post_attention_layernorm}); the fused expert tensors and the shared MLP load into SparseMoE."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stateserve.layers.mamba2_mixer import Mamba2Mixer
from stateserve.layers.metadata import ForwardMeta
from stateserve.layers.moe import GatedMLPExpert, SparseMoE
from stateserve.layers.norm import RMSNorm
from stateserve.layers.rotary import RotaryEmbedding, rope_parameters
from stateserve.layers.qkv_attention import QKVAttention, map_qkv_name
from stateserve.models.base import ModelBase, multiplier
from stateserve.layers.decoder_layer import rope_seq_lens

# transformers >= 5 spells the layer kinds linear_attention / full_attention; older configs say mamba / attention
_LAYER_KINDS = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention", "attention": "attention"}


def layer_kinds(cfg: Any) -> list[str]:
    """'mamba' or 'attention' per layer, from layer_types (transformers' default: all Mamba)."""
    types = getattr(cfg, "layer_types", None)
    if types is None:
        types = getattr(cfg, "layers_block_type", None)
    types = list(types) if types is not None else ["linear_attention"] * cfg.num_hidden_layers
    bad = sorted({t for t in types if t not in _LAYER_KINDS})
    if bad or len(types) != cfg.num_hidden_layers:
        raise ValueError(f"GraniteMoeHybrid: layer_types must name {cfg.num_hidden_layers} layers from "
                         f"{sorted(_LAYER_KINDS)}; got {types}")
    return [_LAYER_KINDS[t] for t in types]


def _time_step_limit(cfg: Any) -> tuple[float, float]:
    limit = getattr(cfg, "time_step_limit", None)
    return (0.0, float("inf")) if limit is None else (float(limit[0]), float(limit[1]))


def granite_mamba_mixer(cfg: Any, dtype: torch.dtype) -> Mamba2Mixer:
    intermediate = int(cfg.mamba_expand * cfg.hidden_size)
    return Mamba2Mixer(
        hidden_size=cfg.hidden_size, num_heads=cfg.mamba_n_heads, head_dim=cfg.mamba_d_head,
        state_size=cfg.mamba_d_state, n_groups=cfg.mamba_n_groups, conv_kernel=cfg.mamba_d_conv,
        chunk_size=cfg.mamba_chunk_size, intermediate_size=intermediate, use_conv_bias=bool(cfg.mamba_conv_bias),
        use_bias=bool(cfg.mamba_proj_bias), activation=cfg.hidden_act, norm_eps=cfg.rms_norm_eps,
        time_step_limit=_time_step_limit(cfg), dt_bias_init=1.0, dtype=dtype)


class GraniteMoeHybridDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, kind: str, rotary: RotaryEmbedding | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.kind = kind
        self.residual_multiplier = multiplier(cfg, "residual_multiplier")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if kind == "mamba":
            self.mamba = granite_mamba_mixer(cfg, dtype)
        else:
            heads = cfg.num_attention_heads
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
            self.self_attn = QKVAttention(
                cfg.hidden_size, heads, cfg.num_key_value_heads or heads, head_dim,
                bias=bool(cfg.attention_bias), scale=multiplier(cfg, "attention_multiplier"), rotary=rotary,
                dtype=dtype)
        shared = int(cfg.shared_intermediate_size or 0)
        if cfg.num_local_experts:
            # The shared MLP sits beside the MoE in transformers; SparseMoE adds it as its shared expert.
            self.block_sparse_moe: nn.Module | None = SparseMoE(
                cfg.num_local_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.intermediate_size,
                norm_topk_prob=True, activation=cfg.hidden_act, router_mode="topk_softmax",
                shared_intermediate_size=shared or None, checkpoint_format="fused")
            self.shared_mlp: nn.Module | None = None
        else:
            self.block_sparse_moe = None
            self.shared_mlp = GatedMLPExpert(cfg.hidden_size, shared, cfg.hidden_act, fused_checkpoint=True)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta,
                rope_lens: torch.Tensor | None) -> torch.Tensor:
        # x: [T, hidden]
        h = self.input_layernorm(x)
        if self.kind == "mamba":
            h = self.mamba(h, meta.state)
        else:
            h = self.self_attn(h, meta.attn, positions, rope_lens)
        x = x + h * self.residual_multiplier
        h = self.post_attention_layernorm(x)
        h = self.block_sparse_moe(h) if self.block_sparse_moe is not None else self.shared_mlp(h)
        return x + h * self.residual_multiplier


class GraniteMoeHybridModel(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        pos_type = getattr(cfg, "position_embedding_type", None)
        if pos_type not in (None, "rope"):
            raise ValueError(f"GraniteMoeHybrid: position_embedding_type {pos_type!r} is not supported "
                             f"(None or 'rope')")
        kinds = layer_kinds(cfg)
        rotary = None
        if pos_type == "rope" and "attention" in kinds:
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            # one rotary table shared by every attention layer (the module holds no weights)
            rotary = RotaryEmbedding(head_dim, rope_parameters(cfg), cfg.max_position_embeddings)
        self.layers = nn.ModuleList(GraniteMoeHybridDecoderLayer(cfg, kind, rotary, dtype) for kind in kinds)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def _check_config(cfg: Any) -> None:
    if not cfg.num_local_experts and not cfg.shared_intermediate_size:
        raise ValueError("GraniteMoeHybrid: a config with neither experts (num_local_experts) nor a shared MLP "
                         "(shared_intermediate_size) is not supported")
    if cfg.num_local_experts and not 0 < cfg.num_experts_per_tok <= cfg.num_local_experts:
        raise ValueError(f"GraniteMoeHybrid: num_experts_per_tok={cfg.num_experts_per_tok} must be in "
                         f"1..num_local_experts={cfg.num_local_experts}")
    if "mamba" in layer_kinds(cfg):
        intermediate = int(cfg.mamba_expand * cfg.hidden_size)
        if cfg.mamba_d_head == "auto" or cfg.mamba_n_heads * cfg.mamba_d_head != intermediate:
            raise ValueError(f"GraniteMoeHybrid: mamba_n_heads * mamba_d_head must equal mamba_expand * "
                             f"hidden_size = {intermediate}")


class GraniteMoeHybridForCausalLM(ModelBase):
    pipeline_layers, pipeline_carry = "model.layers", 1
    is_hybrid = True

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__(hf_config)
        cfg = hf_config
        _check_config(cfg)
        self.embedding_multiplier = multiplier(cfg, "embedding_multiplier")
        self.logits_scaling = multiplier(cfg, "logits_scaling")
        self.dynamic_rope = (getattr(cfg, "position_embedding_type", None) == "rope"
                             and rope_parameters(cfg)["rope_type"] == "dynamic")
        self.model = GraniteMoeHybridModel(cfg, dtype)
        self.add_lm_head(cfg)

    @classmethod
    def resolve_flags(cls, hf_config: Any) -> tuple[bool, bool]:
        """(is_attention_free, is_hybrid): all-attention configs are plain decoders, all-Mamba ones recurrent."""
        kinds = set(layer_kinds(hf_config))
        return "attention" not in kinds, kinds == {"mamba", "attention"}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids) * self.embedding_multiplier  # [T, hidden]
        rope_lens = rope_seq_lens(meta.attn, x.device) if self.dynamic_rope and meta.attn is not None else None
        for layer in self.model.layers:
            x = layer(x, positions, meta, rope_lens)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) / self.logits_scaling

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        if "rotary_emb" in name:
            return None
        parts = name.split(".")
        if len(parts) > 4 and parts[:2] == ["model", "layers"] and parts[3] in ("block_sparse_moe", "shared_mlp"):
            prefix, rest = ".".join(parts[:3]), ".".join(parts[4:])
            layer = self.model.layers[int(parts[2])]
            if layer.block_sparse_moe is not None:
                if parts[3] == "shared_mlp":
                    rest = "shared_expert." + rest
                target = layer.block_sparse_moe.map_weight_name(rest)
                return None if target is None else (f"{prefix}.block_sparse_moe.{target[0]}", target[1])
            dense = {"input_linear.weight": "gate_up_proj.weight", "output_linear.weight": "down_proj.weight"}
            if parts[3] == "shared_mlp" and rest in dense:
                return f"{prefix}.shared_mlp.{dense[rest]}", None
            return name, None  # not ours: the strict loader names it
        if ".self_attn." in name:
            fused = map_qkv_name(name)
            if fused is not None:
                return fused
        return name, None
