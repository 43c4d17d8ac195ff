"""RecurrentGemma (Griffin): residual blocks whose temporal mixer is either a recurrent block (conv1d + RG-LRU,
layers/rg_lru.py: a conv state and an LRU state per sequence) or local attention over the last
`attention_window_size` positions, as transformers' RecurrentGemmaForCausalLM defines it.

Per block: x += temporal_block(temporal_pre_norm(x)); x += mlp_block(channel_pre_norm(x)). `block_types` ("recurrent"
/ "attention") repeats over num_hidden_layers. Gemma details kept from transformers:
- the embeddings are scaled by sqrt(hidden_size) rounded to bfloat16 (its `normalizer` buffer is bfloat16);
- the norms multiply by (1 + weight), computed in float32;
- attention: head_dim = hidden / heads, GQA, rotary on the first partial_rotary_factor of each head (default 0.5),
  no q/k/v biases unless attention_bias, o_proj always with a bias;
- the MLP is gelu_tanh(gate(x)) * up(x) -> down, each with a bias, at intermediate_size // 2;
- the logits are soft-capped: tanh(logits / cap) * cap.
The attention window is a score mask (the PositionBias path of layers/attention.py, as LFM3's sliding layers),
built only in steps where some sequence is longer than the window. Every attention layer declares the window in its
cache spec, so the cache manager gives back the KV blocks that leave it: a sequence holds about
(window + chunk) / block_size blocks however long it grows."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stateserve.layers.attention import Attention
from stateserve.layers.metadata import ForwardMeta
from stateserve.layers.position_bias import PositionBias
from stateserve.layers.rg_lru import RGLRUBlock
from stateserve.layers.rotary import RotaryEmbedding, rope_parameters
from stateserve.models.base import ModelBase
from stateserve.models.lfm2 import sliding_window_bias

RECURRENT, ATTENTION = "recurrent", "attention"
_ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_new": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}
_ARCH = "RecurrentGemmaForCausalLM"


def block_types(cfg: Any) -> list[str]:
    """Each layer's temporal block type: cfg.block_types repeated over num_hidden_layers, validated (transformers'
    config silently turns any name but "recurrent" into attention)."""
    pattern = list(getattr(cfg, "block_types", None) or [])
    if not pattern:
        raise ValueError(f"{_ARCH}: the config's block_types is empty; it must list {RECURRENT!r} / {ATTENTION!r}")
    bad = [t for t in pattern if t not in (RECURRENT, ATTENTION)]
    if bad:
        raise ValueError(f"{_ARCH}: unknown block type {bad[0]!r} in block_types; supported: "
                         f"({RECURRENT!r}, {ATTENTION!r})")
    return [pattern[i % len(pattern)] for i in range(cfg.num_hidden_layers)]


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight) in float32, rounded once to x's dtype (weight stored zero-centred)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class LocalAttention(nn.Module):
    """q/k/v -> partial rotary -> paged attention within the window (the step's mask) -> o_proj (with bias)."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = cfg.hidden_size // self.num_heads
        bias = bool(getattr(cfg, "attention_bias", False))
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=True)
        params = rope_parameters(cfg)
        if params["rope_type"] != "default":
            raise ValueError(f"{_ARCH}: rope_type {params['rope_type']!r} is not supported (transformers' "
                             f"RecurrentGemma takes only 'default')")
        factor = float(params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 0.5)))
        rotary_dim = int(self.head_dim * factor)
        if rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(f"{_ARCH}: partial_rotary_factor={factor} gives {rotary_dim} rotary dims of a "
                             f"{self.head_dim}-wide head; it must be a positive even number")
        self.rotary = RotaryEmbedding(self.head_dim, params, int(cfg.attention_window_size), rotary_dim=rotary_dim)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5, dtype,
                              sliding_window=int(cfg.attention_window_size))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta,
                window: PositionBias | None) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]; window: the step's window mask (None: no key of the step is outside it)
        T, D = x.shape[0], self.head_dim
        q = self.q_proj(x).view(T, self.num_heads, D)
        k = self.k_proj(x).view(T, self.num_kv_heads, D)
        v = self.v_proj(x).view(T, self.num_kv_heads, D)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta.attn, window).flatten(1))


class GemmaMLP(nn.Module):
    def __init__(self, cfg: Any, act) -> None:
        super().__init__()
        width = int(cfg.intermediate_size) // 2  # transformers halves intermediate_size
        self.gate_proj = nn.Linear(cfg.hidden_size, width, bias=True)
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=True)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=True)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class ResidualBlock(nn.Module):
    def __init__(self, cfg: Any, block_type: str, dtype: torch.dtype, act) -> None:
        super().__init__()
        self.block_type = block_type
        self.temporal_pre_norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.temporal_block = (
            RGLRUBlock(cfg.hidden_size, int(cfg.lru_width or cfg.hidden_size), cfg.num_attention_heads,
                       int(cfg.conv1d_width), dtype)
            if block_type == RECURRENT else LocalAttention(cfg, dtype))
        self.channel_pre_norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp_block = GemmaMLP(cfg, act)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta,
                window: PositionBias | None) -> torch.Tensor:
        # x: [T, hidden] the residual stream -> [T, hidden]
        h = self.temporal_pre_norm(x)
        if self.block_type == RECURRENT:
            h = self.temporal_block(h, meta.state)
        else:
            h = self.temporal_block(h, positions, meta, window)
        x = x + h
        return x + self.mlp_block(self.channel_pre_norm(x))


class RecurrentGemmaModel(nn.Module):
    def __init__(self, cfg: Any, layers: list[ResidualBlock]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.final_norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class RecurrentGemmaForCausalLM(ModelBase):
    is_hybrid = True

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__(hf_config)
        cfg = hf_config
        act_name = getattr(cfg, "hidden_activation", "gelu_pytorch_tanh")
        if act_name not in _ACTIVATIONS:
            raise ValueError(f"{_ARCH}: hidden_activation {act_name!r} is not supported; supported: "
                             f"{sorted(_ACTIVATIONS)}")
        types = block_types(cfg)
        self.model = RecurrentGemmaModel(cfg, [ResidualBlock(cfg, t, dtype, _ACTIVATIONS[act_name]) for t in types])
        self.add_lm_head(cfg, tie_default=True)
        # transformers multiplies the embeddings by a bfloat16 buffer: sqrt(hidden) rounded to bfloat16
        self.embed_scale = float(torch.tensor(cfg.hidden_size ** 0.5, dtype=torch.bfloat16, device="cpu"))
        self.soft_cap = getattr(cfg, "logits_soft_cap", None)
        self.window = int(cfg.attention_window_size) if ATTENTION in types else None
        if self.window is not None:  # built only in steps with a sequence past the window, from host-side lengths
            self.graph_blocker = "the sliding-window mask is built from host-side sequence lengths each step"

    @classmethod
    def resolve_flags(cls, hf_config: Any) -> tuple[bool, bool]:
        """(is_attention_free, is_hybrid): a block pattern may be all recurrent (Hawk) or all attention."""
        types = set(block_types(hf_config))
        return ATTENTION not in types, RECURRENT in types and ATTENTION in types

    @classmethod
    def max_positions(cls, hf_config: Any) -> int | None:
        return None  # no max_position_embeddings: rotary and the RG-LRU take any position (the engine's default
        # max_model_len applies)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        x = x * self.embed_scale  # exact in every float dtype served (a bfloat16 value)
        attn = meta.attn
        window = None
        if self.window is not None and attn is not None and attn.seq_lens and max(attn.seq_lens) > self.window:
            window = sliding_window_bias(self.window)  # some query of the step has a key outside its window
        for layer in self.model.layers:
            x = layer(x, positions, meta, window)
        return self.model.final_norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.soft_cap:
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        return logits

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        if "rotary_emb" in name or name.endswith("normalizer"):
            return None  # buffers transformers does not save (tolerated if a file has them)
        if ".temporal_block.conv_1d." in name:
            return name.replace(".conv_1d.", ".conv1d."), None
        if ".rg_lru." in name:
            return name.replace(".rg_lru.", "."), None
        return name, None
