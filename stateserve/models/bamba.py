"""Bamba: a hybrid decoder of Mamba2 mixer layers and full attention layers (at `attn_layer_indices`), every layer
followed by a SwiGLU-style feed-forward, as transformers' BambaForCausalLM defines it.

Per layer: x += mixer(input_layernorm(x)); x += feed_forward(pre_ff_layernorm(x)), where the mixer is a Mamba2Mixer
(`mamba`) or GQA attention (`self_attn`) that rotates only the first `partial_rotary_factor` of each head (read
from rope_parameters; BambaConfig defaults it to 0.5). The Mamba2 mixer's activation is `hidden_act`, its gated
norm eps `rms_norm_eps`, in/out projection bias `mamba_proj_bias`, conv bias `mamba_conv_bias`, dt limit
`time_step_limit`; the clamp is applied on every path (see layers/mamba2_mixer.py), which only matters when
time_step_limit is not the default (0, inf). Weight names are transformers' (model.embed_tokens,
model.layers.N.{input_layernorm, pre_ff_layernorm, mamba.*, self_attn.*, feed_forward.*}, model.final_layernorm,
lm_head); q/k/v and gate/up are fused on load."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stateserve.layers.mamba2_mixer import Mamba2Mixer
from stateserve.layers.metadata import AttnMetadata, ForwardMeta
from stateserve.layers.moe import activation_fn
from stateserve.layers.norm import RMSNorm
from stateserve.layers.rotary import RotaryEmbedding, rope_parameters
from stateserve.layers.markers import stacked
from stateserve.models.base import ModelBase
from stateserve.layers.decoder_layer import DecoderAttention, rope_seq_lens

_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
_GATE_UP = {"gate_proj": 0, "up_proj": 1}
MAMBA, ATTENTION = "linear_attention", "full_attention"


def bamba_layer_types(cfg: Any) -> list[str]:
    """transformers' rule: attention at the listed indices, Mamba2 everywhere else (indices past the last layer
    have no effect there either)."""
    indices = set(getattr(cfg, "attn_layer_indices", None) or [])
    return [ATTENTION if i in indices else MAMBA for i in range(cfg.num_hidden_layers)]


def bamba_rotary_dim(cfg: Any, head_dim: int) -> int:
    # transformers' rope init reads the factor from rope_parameters only (BambaConfig writes 0.5 there by default)
    factor = rope_parameters(cfg).get("partial_rotary_factor", 1.0)
    dim = int(head_dim * factor)
    if dim <= 0 or dim % 2 or dim > head_dim:
        raise ValueError(f"Bamba: partial_rotary_factor={factor} with head_dim={head_dim} gives rotary dim {dim}; "
                         f"it must be even and in 2..head_dim")
    return dim


def bamba_mixer(cfg: Any, dtype: torch.dtype) -> Mamba2Mixer:
    intermediate = int(cfg.mamba_expand * cfg.hidden_size)
    head_dim = cfg.mamba_d_head
    if head_dim == "auto":  # BambaConfig resolves this at construction; a hand-edited config may not have
        head_dim = intermediate // cfg.mamba_n_heads
    limit = getattr(cfg, "time_step_limit", None)
    return Mamba2Mixer(
        hidden_size=cfg.hidden_size, num_heads=cfg.mamba_n_heads, head_dim=int(head_dim),
        state_size=cfg.mamba_d_state, n_groups=cfg.mamba_n_groups, conv_kernel=cfg.mamba_d_conv,
        chunk_size=cfg.mamba_chunk_size, intermediate_size=intermediate, use_conv_bias=bool(cfg.mamba_conv_bias),
        use_bias=bool(cfg.mamba_proj_bias), activation=cfg.hidden_act, norm_eps=cfg.rms_norm_eps,
        time_step_limit=tuple(limit) if limit is not None else (0.0, float("inf")),
        dt_bias_init=1.0,  # transformers initialises Bamba's dt_bias to ones (kept by dummy-weight runs)
        dtype=dtype)


class BambaAttention(DecoderAttention):
    """Llama-style GQA attention (bias on q, k, v and o when attention_bias) with partial rotary."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        bias = bool(getattr(cfg, "attention_bias", False))
        super().__init__(cfg, dtype, qkv_bias=bias, o_bias=bias)
        self.rotary = RotaryEmbedding(self.head_dim, rope_parameters(cfg), cfg.max_position_embeddings,
                                      rotary_dim=bamba_rotary_dim(cfg, self.head_dim))


class BambaMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, activation: str, bias: bool) -> None:
        super().__init__()
        self.act = activation_fn(activation)
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        stacked(self.gate_up_proj.weight, [intermediate, intermediate])
        if bias:
            stacked(self.gate_up_proj.bias, [intermediate, intermediate])
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        return self.down_proj(self.act(gate) * up)


class BambaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, layer_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_type = layer_type
        if layer_type == MAMBA:
            self.mamba = bamba_mixer(cfg, dtype)
        else:
            self.self_attn = BambaAttention(cfg, dtype)
        self.feed_forward = BambaMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act,
                                     bool(getattr(cfg, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta,
                rope_lens: torch.Tensor | None) -> torch.Tensor:
        # x: [T, hidden]
        h = self.input_layernorm(x)
        if self.layer_type == MAMBA:
            h = self.mamba(h, meta.state)
        else:
            h = self.self_attn(h, positions, meta.attn, rope_lens)
        x = x + h
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class BambaModel(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(BambaDecoderLayer(cfg, t, dtype) for t in bamba_layer_types(cfg))
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class BambaForCausalLM(ModelBase):
    pipeline_layers, pipeline_carry = "model.layers", 1
    is_hybrid = True

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__(hf_config)
        cfg = hf_config
        self.dynamic_rope = rope_parameters(cfg)["rope_type"] == "dynamic"
        self.model = BambaModel(cfg, dtype)
        self.add_lm_head(cfg)

    @classmethod
    def resolve_flags(cls, hf_config: Any) -> tuple[bool, bool]:
        """(is_attention_free, is_hybrid): without attn_layer_indices every layer is Mamba2."""
        types = set(bamba_layer_types(hf_config))
        return ATTENTION not in types, types == {MAMBA, ATTENTION}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        attn: AttnMetadata | None = meta.attn
        rope_lens = rope_seq_lens(attn, x.device) if self.dynamic_rope and attn is not None else None
        for layer in self.model.layers:
            x = layer(x, positions, meta, rope_lens)
        return self.model.final_layernorm(x)

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        if "rotary_emb.inv_freq" in name:
            return None
        parts = name.split(".")
        if len(parts) >= 3 and parts[-3] == "self_attn" and parts[-2] in _QKV:
            return ".".join(parts[:-2] + ["qkv_proj", parts[-1]]), _QKV[parts[-2]]
        if len(parts) >= 3 and parts[-3] == "feed_forward" and parts[-2] in _GATE_UP:
            return ".".join(parts[:-2] + ["gate_up_proj", parts[-1]]), _GATE_UP[parts[-2]]
        return name, None
