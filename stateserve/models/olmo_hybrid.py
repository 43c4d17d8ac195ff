"""OLMo Hybrid (transformers 5.24 OlmoHybridForCausalLM): Gated DeltaNet layers interleaved with OLMo-3-style full
attention layers (paged KV), every layer with a dense SwiGLU feed-forward.

What differs from Qwen3-Next / Qwen3.5 (models/qwen3_next.py), and who owns it:
- the delta net (layers/delta_rule.py's GatedDeltaNet, "separate" layout): the checkpoint keeps q/k/v/g/b/a as six
  matrices (g is the output gate Qwen calls z); beta = 2 * sigmoid(b) under linear_allow_neg_eigval; the gated
  output norm has eps 1e-5 (FLA's default, not rms_norm_eps); the norm and output projection are named o_norm and
  o_proj; the conv weight is stored per projection (q_conv1d, k_conv1d, v_conv1d). The conv (hidden_act), the
  l2-normed q/k, the 1/sqrt(head_k_dim) query scale, the decay and the grouped value heads are Qwen's.
- attention (here): no output gate; q and k are RMS-normalised over their full projection width (all heads
  together, OLMo 2/3 style, not per head) with plain weights (not 1 + w), before rotary; rotary is full-width, or
  absent altogether (NoPE) when rope_parameters is null or has rope_theta null, as the released checkpoints do.
- the layers (here): a linear-attention layer is pre-norm (input_layernorm, post_attention_layernorm before the
  MLP); an attention layer is OLMo's post-norm: x + post_attention_layernorm(attn(x)), then
  x + post_feedforward_layernorm(mlp(x)). Norms multiply the weight in float32 and cast once (OLMo's RMSNorm).
  Checkpoints name input_layernorm / post_attention_layernorm attention_layer_norm / feedforward_layer_norm
  (transformers renames them on load; both spellings load here).
transformers 5.24 saves q/k/v_conv1d by cutting its fused conv (loaded as their concatenation) into three equal parts
(its Concatenate's reverse, a torch.chunk), which are the real [key_dim, key_dim, value_dim] shards only when
value_dim == key_dim; OLMo-core's own files hold the real shards. Either way the fused conv is the three parts
concatenated in q, k, v order, so expand_weight keeps each layer's parts back until all three have come, then
cuts their concatenation at the real sizes."""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from stateserve.layers.attention import Attention
from stateserve.layers.decoder_layer import rope_seq_lens
from stateserve.layers.delta_rule import SEPARATE_PROJECTION_SHARDS, GatedDeltaNet
from stateserve.layers.markers import stacked
from stateserve.layers.metadata import AttnMetadata, ForwardMeta
from stateserve.layers.moe import GatedMLPExpert
from stateserve.layers.qkv_attention import map_qkv_name
from stateserve.layers.rotary import RotaryEmbedding, rope_parameters
from stateserve.models.base import ModelBase
from stateserve.models.qwen3_next import LAYER_TYPES, layer_types

_GATE_UP = {"gate_proj": 0, "up_proj": 1}
# transformers' delta-net names -> GatedDeltaNet's
_DELTA_NET_RENAMES = {"o_norm": "norm", "o_proj": "out_proj"}
# the checkpoints' (OLMo-core's) layer norm names, which transformers renames on load
_NORM_RENAMES = {"attention_layer_norm": "input_layernorm", "feedforward_layer_norm": "post_attention_layernorm"}
# the per-projection conv parts of the delta net, in the order transformers concatenates them into its fused conv
_CONV_PARTS = ("q_conv1d", "k_conv1d", "v_conv1d")
# the gated output norm's eps: transformers fixes it at FLA's default, whatever rms_norm_eps says
DELTA_NET_NORM_EPS = 1e-5


class OlmoRMSNorm(nn.Module):
    """RMSNorm whose weight multiplies the float32 normalised values before the cast back (OLMo 2/3's order; Llama
    casts first). Same numbers in float32, closer to transformers in bf16."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).to(x.dtype)


def uses_rope(cfg: Any) -> bool:
    """transformers builds no rotary embedding (NoPE) when rope_parameters is missing or its rope_theta is null."""
    params = getattr(cfg, "rope_parameters", None)
    return params is not None and params.get("rope_theta") is not None


class OlmoHybridAttention(nn.Module):
    """q/k/v fused into one matmul; q and k RMS-normed over their whole width; optional rotary; no output gate."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        bias = bool(getattr(cfg, "attention_bias", False))
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.sizes), bias=bias)
        stacked(self.qkv_proj.weight, self.sizes)
        if bias:
            stacked(self.qkv_proj.bias, self.sizes)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=bias)
        self.q_norm = OlmoRMSNorm(q_size, cfg.rms_norm_eps)  # over all heads at once
        self.k_norm = OlmoRMSNorm(kv_size, cfg.rms_norm_eps)
        self.rotary = (RotaryEmbedding(self.head_dim, rope_parameters(cfg), cfg.max_position_embeddings)
                       if uses_rope(cfg) else None)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5, dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                rope_lens: torch.Tensor | None) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = self.q_norm(q).view(-1, self.num_heads, self.head_dim)  # normed before the split into heads
        k = self.k_norm(k).view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k, rope_lens)
        return self.o_proj(self.attn(q, k, v, meta).flatten(1))


def olmo_delta_net(cfg: Any, dtype: torch.dtype) -> GatedDeltaNet:
    return GatedDeltaNet(
        cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
        cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim, DELTA_NET_NORM_EPS, cfg.hidden_act, dtype,
        layout="separate", beta_scale=2.0 if getattr(cfg, "linear_allow_neg_eigval", True) else 1.0)


class OlmoHybridDecoderLayer(nn.Module):
    """A linear-attention layer (pre-norm) or a full-attention layer (OLMo post-norm), by `layer_type`; the norm
    names are transformers' for each kind."""

    def __init__(self, cfg: Any, layer_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_type = layer_type
        eps = cfg.rms_norm_eps
        self.mlp = GatedMLPExpert(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, fused_checkpoint=False)
        self.post_attention_layernorm = OlmoRMSNorm(cfg.hidden_size, eps)
        if layer_type == "linear_attention":
            self.linear_attn = olmo_delta_net(cfg, dtype)
            self.input_layernorm = OlmoRMSNorm(cfg.hidden_size, eps)
        else:
            self.self_attn = OlmoHybridAttention(cfg, dtype)
            self.post_feedforward_layernorm = OlmoRMSNorm(cfg.hidden_size, eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta,
                rope_lens: torch.Tensor | None) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        if self.layer_type == "linear_attention":
            x = x + self.linear_attn(self.input_layernorm(x), meta.state)
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(self.self_attn(x, positions, meta.attn, rope_lens))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class OlmoHybridModel(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(OlmoHybridDecoderLayer(cfg, t, dtype) for t in layer_types(cfg))
        self.norm = OlmoRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def _check_config(cfg: Any) -> None:
    """Options transformers' OlmoHybrid has no code for: refused by name rather than silently ignored."""
    window = getattr(cfg, "sliding_window", None)
    if window is not None:
        raise ValueError(f"OlmoHybridForCausalLM: sliding_window={window} is not supported (OLMo Hybrid's attention "
                         "layers are full attention)")
    if getattr(cfg, "linear_num_key_heads", None) is None or getattr(cfg, "linear_key_head_dim", None) is None:
        raise ValueError("OlmoHybridForCausalLM: the config lacks linear_num_key_heads / linear_key_head_dim")


class OlmoHybridForCausalLM(ModelBase):
    is_hybrid = True

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__(hf_config)
        cfg = hf_config
        _check_config(cfg)
        self.dynamic_rope = uses_rope(cfg) and rope_parameters(cfg)["rope_type"] == "dynamic"
        self.model = OlmoHybridModel(cfg, dtype)
        self.add_lm_head(cfg)
        # expand_weight's conv parts kept back per layer prefix until all three have been read
        self._conv_parts: dict[str, dict[str, torch.Tensor]] = {}

    @classmethod
    def resolve_flags(cls, hf_config: Any) -> tuple[bool, bool]:
        """(is_attention_free, is_hybrid) from the layer types (transformers requires both kinds; a hand-edited
        config with one kind routes as that kind)."""
        types = set(layer_types(hf_config))
        return "full_attention" not in types, types == set(LAYER_TYPES)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        rope_lens = rope_seq_lens(meta.attn, x.device) if self.dynamic_rope and meta.attn is not None else None
        for layer in self.model.layers:
            x = layer(x, positions, meta, rope_lens)
        return self.model.norm(x)

    def expand_weight(self, name: str, tensor: Any) -> Iterable[tuple[str, Any]]:
        """q/k/v_conv1d parts are kept back until a layer's three are in, then re-cut at the real shard sizes
        (module docstring: transformers' saved parts are equal thirds, not the shards)."""
        prefix, _, leaf = name.rpartition(".linear_attn.")
        part, _, suffix = leaf.partition(".")
        if not prefix or part not in _CONV_PARTS or not isinstance(tensor, torch.Tensor):
            return super().expand_weight(name, tensor)
        key = f"{prefix}.linear_attn.conv1d.{suffix}"
        parts = self._conv_parts.setdefault(key, {})
        parts[part] = tensor
        if len(parts) < len(_CONV_PARTS):
            return ()
        del self._conv_parts[key]
        fused = torch.cat([parts[p] for p in _CONV_PARTS])
        sizes = self.get_parameter(key).shard_sizes
        if fused.shape[0] != sum(sizes):
            raise ValueError(f"{prefix}.linear_attn.{{q,k,v}}_conv1d hold {fused.shape[0]} channels in all; the "
                             f"config's conv has {sum(sizes)} (2 * key_dim + value_dim = "
                             f"{' + '.join(map(str, sizes))})")
        return [(f"{prefix}.linear_attn.{p}.{suffix}", t) for p, t in zip(_CONV_PARTS, fused.split(sizes))]

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        if "rotary_emb.inv_freq" in name:
            return None
        parts = name.split(".")
        if len(parts) == 5 and parts[:2] == ["model", "layers"] and parts[3] in _NORM_RENAMES:
            return ".".join(parts[:3] + [_NORM_RENAMES[parts[3]], parts[4]]), None
        if len(parts) == 6 and parts[:2] == ["model", "layers"]:
            block, proj = parts[3], parts[4]
            if block == "linear_attn" and proj in SEPARATE_PROJECTION_SHARDS:
                fused, shard = SEPARATE_PROJECTION_SHARDS[proj]
                return ".".join(parts[:4] + [fused, parts[5]]), shard
            if block == "linear_attn" and proj in _DELTA_NET_RENAMES:
                return ".".join(parts[:4] + [_DELTA_NET_RENAMES[proj], parts[5]]), None
            if block == "self_attn":
                fused = map_qkv_name(name)
                if fused is not None:
                    return fused
            if block == "mlp" and proj in _GATE_UP:
                return ".".join(parts[:4] + ["gate_up_proj", parts[5]]), _GATE_UP[proj]
        return name, None
