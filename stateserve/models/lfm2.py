"""LFM2 (Liquid AI): a hybrid decoder of gated short-convolution layers (layers/short_conv.py: a conv state per
sequence) and GQA attention layers (paged KV), as transformers' Lfm2ForCausalLM defines it; and the skeleton its
relatives share (models/lfm2_moe.py, models/lfm3.py).

Per layer: x += mixer(operator_norm(x)); x += feed_forward(ffn_norm(x)); the final norm is called
`embedding_norm` (it is applied last, despite the name). `layer_types` names each layer's mixer: "conv" or
"full_attention" (Lfm2Config builds it from `full_attn_idxs`; without either every layer is attention).
Attention normalises q and k per head (RMSNorm over head_dim) before full-width rotary; no biases. The
feed-forward is SwiGLU w2(silu(w1 x) * w3 x) whose width Lfm2 adjusts (block_auto_adjust_ff_dim: 2/3 of
intermediate_size, times block_ffn_dim_multiplier, rounded up to block_multiple_of).
What the relatives change:
- Lfm2-MoE: sparse MoE feed-forwards after the first `num_dense_layers` (sigmoid router with an expert bias for
  selection only), dense layers at intermediate_size unadjusted.
- LFM3: a "sliding_attention" layer type, rotary parameters per attention type ("proportional" for full
  attention), a per-head sigmoid output gate, optional attention biases, sandwich norms after the mixer and the
  feed-forward, intermediate_size unadjusted.
Checkpoint names are transformers'; on load q/k/v become one qkv_proj, w1/w3 one gate_up_proj (w2: down_proj),
`conv.conv` the short conv's conv1d, and Lfm2's out_proj / q_layernorm / k_layernorm the o_proj / q_norm / k_norm
that LFM3 spells that way already."""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from stateserve.layers.attention import Attention
from stateserve.layers.decoder_layer import GatedMLP
from stateserve.layers.markers import stacked
from stateserve.layers.metadata import AttnMetadata, ForwardMeta
from stateserve.layers.moe import SparseMoE
from stateserve.layers.norm import RMSNorm
from stateserve.layers.position_bias import PositionBias
from stateserve.layers.qkv_attention import map_qkv_name
from stateserve.layers.rotary import RotaryEmbedding, rope_parameters
from stateserve.layers.short_conv import ShortConv
from stateserve.models.base import ModelBase

CONV, FULL, SLIDING = "conv", "full_attention", "sliding_attention"
_GATE_UP = {"w1": 0, "w3": 1}  # SwiGLU checkpoint matrices -> shard of gate_up_proj
_ATTN_RENAMES = {"out_proj": "o_proj", "q_layernorm": "q_norm", "k_layernorm": "k_norm", "gate_proj": "g_proj"}
# configs of the vision-language wrappers (LFM2-VL, LFM3-VL): their text model alone is served, from its own folder
_MULTIMODAL_KEYS = ("vision_config", "audio_config")


def check_text_only(cfg: Any, arch: str) -> None:
    """A config with a vision (or audio) tower is not a text model this class can serve: say which key."""
    found = [k for k in _MULTIMODAL_KEYS if getattr(cfg, k, None) is not None]
    if found:
        raise ValueError(f"{arch}: the config has a {found[0]} (a vision/audio tower), which is not supported; "
                         f"only the text decoder is served")


def checked_layer_types(cfg: Any, allowed: tuple[str, ...], arch: str) -> list[str]:
    """cfg.layer_types, validated: one known type per layer (an unknown one is named in the error)."""
    types = getattr(cfg, "layer_types", None)
    if types is None:
        raise ValueError(f"{arch}: the config has no layer_types; it must list each layer's type from {allowed}")
    types = list(types)
    bad = [t for t in types if t not in allowed]
    if bad:
        raise ValueError(f"{arch}: unknown layer type {bad[0]!r} in layer_types; supported: {allowed}")
    if len(types) < cfg.num_hidden_layers:
        raise ValueError(f"{arch}: layer_types names {len(types)} layers, the config has {cfg.num_hidden_layers}")
    return types[:cfg.num_hidden_layers]


def lfm2_ff_dim(cfg: Any) -> int:
    """Lfm2MLP's width: intermediate_size, adjusted as block_auto_adjust_ff_dim says."""
    size = int(cfg.intermediate_size)
    if getattr(cfg, "block_auto_adjust_ff_dim", False):
        size = int(2 * size / 3)
        multiplier = getattr(cfg, "block_ffn_dim_multiplier", None)
        if multiplier is not None:
            multiple = int(cfg.block_multiple_of)
            size = multiple * ((int(multiplier * size) + multiple - 1) // multiple)
    return size


def sliding_window_bias(window: int) -> PositionBias:
    """The score mask of a sliding window: -inf on a key `window` or more positions before its query (transformers
    keeps key j for query i when j > i - window). One head axis of size 1: the same for every head."""
    def values(rel: torch.Tensor) -> torch.Tensor:  # [..., Lk] -> [..., Lk, 1]
        return torch.zeros(rel.shape, device=rel.device).masked_fill(rel <= -window, float("-inf")).unsqueeze(-1)
    return PositionBias(values)


class LfmAttention(nn.Module):
    """q/k/v (fused) -> per-head RMSNorm on q and k -> rotary -> paged attention (within a sliding window when
    `window`) -> optional per-head sigmoid gate of the layer input (LFM3's g_proj) -> o_proj."""

    def __init__(self, cfg: Any, dtype: torch.dtype, rotary: RotaryEmbedding, *, bias: bool = False,
                 gate: bool = False, window: int | None = None) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.sizes), bias=bias)
        stacked(self.qkv_proj.weight, self.sizes)
        if bias:
            stacked(self.qkv_proj.bias, self.sizes)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps)
        self.g_proj = nn.Linear(cfg.hidden_size, self.num_heads, bias=False) if gate else None
        self.rotary = rotary
        self.window = window
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5, dtype,
                              sliding_window=window)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                window_bias: PositionBias | None) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]; window_bias: the step's sliding-window mask (None: no key is outside it)
        T, D = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = self.q_norm(q.reshape(-1, D)).view(T, self.num_heads, D)  # rows of one head: the 2-D norm kernel
        k = self.k_norm(k.reshape(-1, D)).view(T, self.num_kv_heads, D)
        v = v.view(T, self.num_kv_heads, D)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v, meta, window_bias if self.window is not None else None)  # [T, H, D]
        if self.g_proj is not None:
            out = out * torch.sigmoid(self.g_proj(x)).unsqueeze(-1)
        return self.o_proj(out.flatten(1))


class LfmDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, layer_type: str, mixer: nn.Module, feed_forward: nn.Module,
                 sandwich: bool) -> None:
        super().__init__()
        self.layer_type = layer_type
        if layer_type == CONV:
            self.conv = mixer
        else:
            self.self_attn = mixer
        self.feed_forward = feed_forward
        self.operator_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        # LFM3's sandwich norms: the mixer's and the feed-forward's outputs are normalised before the residual add
        self.post_operator_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps) if sandwich else None
        self.post_ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps) if sandwich else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, meta: ForwardMeta,
                window_bias: PositionBias | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] the previous layer's feed-forward output (the embeddings, residual None, for the first);
        residual: the stream so far -> (this layer's feed-forward output, the stream before it). Each add to the
        stream is done with the norm that follows it (one kernel on CPU)."""
        h, residual = self.operator_norm.add_forward(x, residual)
        if self.layer_type == CONV:
            h = self.conv(h, meta.state)
        else:
            h = self.self_attn(h, positions, meta.attn, window_bias)
        if self.post_operator_norm is not None:
            h = self.post_operator_norm(h)
        h, residual = self.ffn_norm.add_forward(h, residual)
        h = self.feed_forward(h)
        if self.post_ffn_norm is not None:
            h = self.post_ffn_norm(h)
        return h, residual


class LfmModel(nn.Module):
    def __init__(self, cfg: Any, layers: list[LfmDecoderLayer]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.embedding_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)


class LfmCausalLMBase(ModelBase):
    """What Lfm2, Lfm2-MoE and LFM3 share; a family says which layer types it has and builds its mixers and
    feed-forwards (`make_attention`, `make_feed_forward`)."""

    is_hybrid = True
    layer_type_names: ClassVar[tuple[str, ...]] = (CONV, FULL)

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__(hf_config)
        cfg = hf_config
        arch = type(self).__name__
        check_text_only(cfg, arch)
        layers = []
        for i, layer_type in enumerate(self.layer_types(cfg)):
            mixer = (ShortConv(cfg.hidden_size, int(cfg.conv_L_cache), bool(cfg.conv_bias), dtype)
                     if layer_type == CONV else self.make_attention(cfg, layer_type, dtype))
            layers.append(LfmDecoderLayer(cfg, layer_type, mixer, self.make_feed_forward(cfg, i),
                                          self.sandwich_norms(cfg)))
        self.model = LfmModel(cfg, layers)
        self.add_lm_head(cfg, tie_default=True)

    # ---- what a family defines -----------------------------------------------------------------
    @classmethod
    def layer_types(cls, cfg: Any) -> list[str]:
        return checked_layer_types(cfg, cls.layer_type_names, cls.__name__)

    def make_attention(self, cfg: Any, layer_type: str, dtype: torch.dtype) -> nn.Module:
        raise NotImplementedError

    def make_feed_forward(self, cfg: Any, index: int) -> nn.Module:
        raise NotImplementedError

    def sandwich_norms(self, cfg: Any) -> bool:
        return False

    def window_bias(self, meta: ForwardMeta) -> PositionBias | None:
        """The step's sliding-window mask for the sliding attention layers (LFM3), None where there is none."""
        return None

    # ---- shared --------------------------------------------------------------------------------
    @classmethod
    def resolve_flags(cls, hf_config: Any) -> tuple[bool, bool]:
        """(is_attention_free, is_hybrid): layer_types may leave only conv layers, or only attention."""
        types = set(cls.layer_types(hf_config))
        attention = types - {CONV}
        return not attention, CONV in types and bool(attention)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        bias = self.window_bias(meta)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, positions, meta, bias)
        return self.model.embedding_norm.add_forward(x, residual)[0]

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        if "rotary_emb" in name or "pos_emb" in name:
            return None  # rotary buffers (transformers does not save them; tolerated if a file has them)
        parts = name.split(".")
        if len(parts) > 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit() \
                and int(parts[2]) < len(self.model.layers):
            prefix, kind, rest = ".".join(parts[:4]), parts[3], parts[4:]
            layer = self.model.layers[int(parts[2])]
            if kind == "feed_forward":
                if isinstance(layer.feed_forward, SparseMoE):
                    target = layer.feed_forward.map_weight_name(".".join(rest))
                    return None if target is None else (f"{prefix}.{target[0]}", target[1])
                if rest[0] in _GATE_UP:
                    return f"{prefix}.gate_up_proj.{rest[-1]}", _GATE_UP[rest[0]]
                if rest[0] == "w2":
                    return f"{prefix}.down_proj.{rest[-1]}", None
            elif kind == "self_attn":
                fused = map_qkv_name(name)
                if fused is not None:
                    return fused
                if rest[0] in _ATTN_RENAMES:
                    return ".".join([prefix, _ATTN_RENAMES[rest[0]], *rest[1:]]), None
            elif kind == "conv" and rest[0] == "conv":
                return ".".join([prefix, "conv1d", *rest[1:]]), None
        return name, None


class Lfm2ForCausalLM(LfmCausalLMBase):
    def make_attention(self, cfg: Any, layer_type: str, dtype: torch.dtype) -> nn.Module:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return LfmAttention(cfg, dtype, RotaryEmbedding(head_dim, rope_parameters(cfg), cfg.max_position_embeddings))

    def make_feed_forward(self, cfg: Any, index: int) -> nn.Module:
        return GatedMLP(cfg.hidden_size, lfm2_ff_dim(cfg))
