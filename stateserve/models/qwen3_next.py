"""Qwen3-Next: a hybrid decoder of Gated DeltaNet (linear attention, recurrent state) layers and gated full
attention layers (paged KV), with sparse MoE feed-forwards (plus a sigmoid-gated shared expert).

Per transformers' Qwen3NextForCausalLM: `layer_types` (or `full_attention_interval`) picks each layer's mixer;
attention projects q together with an output gate, normalises q and k per head with (1 + weight) RMSNorm and
rotates only the first `partial_rotary_factor` of each head; a layer is MoE unless it is in `mlp_only_layers`
or misses `decoder_sparse_step`."""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from stateserve.layers.attention import Attention
from stateserve.layers.delta_rule import GatedDeltaNet
from stateserve.layers.metadata import AttnMetadata, ForwardMeta
from stateserve.layers.moe import GatedMLPExpert, SparseMoE
from stateserve.layers.rotary import RotaryEmbedding, rope_parameters
from stateserve.layers.markers import stacked
from stateserve.layers.param_cache import derived
from stateserve.models.base import ModelBase
from stateserve.platform import kernels
from stateserve.layers.decoder_layer import rope_seq_lens

_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
_GATE_UP = {"gate_proj": 0, "up_proj": 1}
LAYER_TYPES = ("linear_attention", "full_attention")


class OffsetRMSNorm(nn.Module):
    """RMSNorm with weights stored as an offset from one: x_normed * (1 + weight), in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim] -> [..., dim]
        if x.is_contiguous():  # the C++ row kernels: one call instead of ~8 PyTorch ones
            table = kernels.table(x.device)
            kernel = table.rms_norm_f32_weight(x.dtype) if x.dtype != torch.float32 else \
                table.rms_norm(torch.float32, torch.float32)
            if kernel is not None:
                return kernel(x.view(-1, x.shape[-1]), self.offset_weight(), self.eps).view(x.shape)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)

    def offset_weight(self) -> torch.Tensor:
        """1 + weight in float32, made once per version of the weight."""
        weight = self.weight
        return derived(self, "offset", (weight,), lambda: (1.0 + weight.detach().float()).contiguous())


def layer_types(cfg: Any) -> list[str]:
    types = getattr(cfg, "layer_types", None)
    if types is None:
        interval = getattr(cfg, "full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(cfg.num_hidden_layers)]
    types = list(types)[:cfg.num_hidden_layers]
    bad = sorted(set(types) - set(LAYER_TYPES))
    if bad:
        raise ValueError(f"layer_types has unknown layer type(s) {bad}; each layer must be one of {LAYER_TYPES}")
    if len(types) != cfg.num_hidden_layers:
        raise ValueError(f"layer_types must name {cfg.num_hidden_layers} layers from {LAYER_TYPES}; got {types}")
    return types


def partial_rotary_dim(cfg: Any, head_dim: int) -> int:
    params = rope_parameters(cfg)
    factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    dim = int(head_dim * factor)
    if dim <= 0 or dim % 2:
        raise ValueError(f"partial_rotary_factor={factor} gives rotary dim {dim}; it must be even and positive")
    return dim


class Qwen3NextAttention(nn.Module):
    """Full attention with a sigmoid output gate projected alongside q, and per-head q/k (1 + w) RMSNorm."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        bias = bool(getattr(cfg, "attention_bias", False))
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # q_proj rows are grouped per head as [q (D) | gate (D)]
        self.sizes = [2 * q_size, kv_size, kv_size]
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.sizes), bias=bias)
        stacked(self.qkv_proj.weight, self.sizes)
        if bias:
            stacked(self.qkv_proj.bias, self.sizes)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=bias)
        self.q_norm = OffsetRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(self.head_dim, rope_parameters(cfg), cfg.max_position_embeddings,
                                      rotary_dim=partial_rotary_dim(cfg, self.head_dim))
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5, dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                rope_lens: torch.Tensor | None) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        T = x.shape[0]
        q_gate, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q, gate = q_gate.view(T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)  # [T, H, D]
        k = self.k_norm(k.view(T, self.num_kv_heads, self.head_dim))
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k, rope_lens)
        out = self.attn(q, k, v, meta).flatten(1)  # [T, H*D]
        return self.o_proj(out * torch.sigmoid(gate.reshape(T, -1)))


def is_moe_layer(cfg: Any, index: int) -> bool:
    mlp_only = getattr(cfg, "mlp_only_layers", None) or []
    return index not in mlp_only and cfg.num_experts > 0 and (index + 1) % cfg.decoder_sparse_step == 0


class Qwen3NextDecoderLayer(nn.Module):
    """One decoder layer of the Qwen3-Next family (Qwen3.5 too): the mixer its layer type names, then the
    feed-forward the model class built for it (`mlp`), each behind a (1 + w) RMSNorm with a residual."""

    def __init__(self, cfg: Any, layer_type: str, mlp: nn.Module, dtype: torch.dtype,
                 projection_layout: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(
                cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim, cfg.rms_norm_eps, cfg.hidden_act, dtype,
                layout=projection_layout)
        else:
            self.self_attn = Qwen3NextAttention(cfg, dtype)
        self.mlp = mlp
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta,
                rope_lens: torch.Tensor | None) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.layer_type == "linear_attention":
            h = self.linear_attn(h, meta.state)
        else:
            h = self.self_attn(h, positions, meta.attn, rope_lens)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3NextModel(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, mlps: list[nn.Module], projection_layout: str) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3NextDecoderLayer(cfg, t, mlp, dtype, projection_layout)
                                    for t, mlp in zip(layer_types(cfg), mlps))
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3NextForCausalLM(ModelBase):
    pipeline_layers, pipeline_carry = "model.layers", 1
    """Also the base of the Qwen3.5 classes (models/qwen3_5.py), which differ in the delta net's checkpoint
    layout (`projection_layout`), the feed-forward of each layer (`build_mlp`) and checkpoint names."""
    is_hybrid = True
    fused_experts = "gated"  # 3-D fused expert tensors load too, split per expert (ModelBase.expand_weight)
    projection_layout: ClassVar[str] = "grouped"  # delta_rule.PROJECTION_LAYOUTS

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__(hf_config)
        cfg = hf_config
        self.dynamic_rope = rope_parameters(cfg)["rope_type"] == "dynamic"
        mlps = [self.build_mlp(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.model = Qwen3NextModel(cfg, dtype, mlps, self.projection_layout)
        self.add_lm_head(cfg)

    @classmethod
    def build_mlp(cls, cfg: Any, index: int) -> nn.Module:
        """Layer `index`'s feed-forward: sparse MoE with a gated shared expert, or dense on the layers
        `mlp_only_layers` / `decoder_sparse_step` leave out."""
        if is_moe_layer(cfg, index):
            return SparseMoE(
                cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                norm_topk_prob=cfg.norm_topk_prob, activation=cfg.hidden_act,
                shared_intermediate_size=cfg.shared_expert_intermediate_size, shared_expert_gate=True)
        return GatedMLPExpert(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, fused_checkpoint=False)

    @classmethod
    def resolve_flags(cls, hf_config: Any) -> tuple[bool, bool]:
        """(is_attention_free, is_hybrid): a config may use only one kind of mixer."""
        types = set(layer_types(hf_config))
        return "full_attention" not in types, types == set(LAYER_TYPES)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        rope_lens = rope_seq_lens(meta.attn, x.device) if self.dynamic_rope and meta.attn is not None else None
        for layer in self.model.layers:
            x = layer(x, positions, meta, rope_lens)
        return self.model.norm(x)

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        if "rotary_emb.inv_freq" in name or name.startswith("mtp."):
            return None  # multi-token-prediction head: transformers skips it too
        parts = name.split(".")
        if len(parts) > 4 and parts[:2] == ["model", "layers"] and parts[3] == "mlp":
            prefix, rest = ".".join(parts[:4]), ".".join(parts[4:])
            mlp = self.model.layers[int(parts[2])].mlp
            if isinstance(mlp, SparseMoE):
                target = mlp.map_weight_name(rest)
                return None if target is None else (f"{prefix}.{target[0]}", target[1])
            if parts[4] in _GATE_UP:
                return f"{prefix}.gate_up_proj.{parts[-1]}", _GATE_UP[parts[4]]
            return name, None
        if len(parts) >= 2 and parts[-3:-2] == ["self_attn"] and parts[-2] in _QKV:
            return ".".join(parts[:-2] + ["qkv_proj", parts[-1]]), _QKV[parts[-2]]
        return name, None
