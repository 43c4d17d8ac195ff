"""FalconH1: every layer runs attention and a Mamba2 mixer in parallel on the same normed input and adds both
outputs to the residual stream, then a SwiGLU MLP.

Per transformers' FalconH1ForCausalLM, with all of its muP multipliers:
    x = embed(ids) * embedding_multiplier
    h = input_layernorm(x)
    x = x + mamba(h * ssm_in_multiplier) * ssm_out_multiplier + attn(h * attention_in_multiplier) * attention_out_multiplier
    x = x + down(up(h') * act(gate(h') * mlp_multipliers[0])) * mlp_multipliers[1],   h' = pre_ff_layernorm(x)
    logits = lm_head(final_layernorm(x)) * lm_head_multiplier
Attention scales keys by key_multiplier (scores keep head_dim ** -0.5); the mixer's in_proj output is scaled per
section (z, x, B, C, dt) by ssm_multipliers (transformers' mup_vector); its width is mamba_d_ssm, its gated
RMSNorm is optional (mamba_rms_norm, else y * silu(z)), out_proj has projectors_bias, in_proj mamba_proj_bias."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stateserve.layers.mamba2_mixer import Mamba2Mixer
from stateserve.layers.metadata import ForwardMeta
from stateserve.layers.moe import activation_fn
from stateserve.layers.norm import RMSNorm
from stateserve.layers.rotary import RotaryEmbedding, rope_parameters
from stateserve.layers.markers import stacked
from stateserve.layers.qkv_attention import QKVAttention, map_qkv_name
from stateserve.models.base import ModelBase, multiplier
from stateserve.layers.decoder_layer import rope_seq_lens

_GATE_UP = {"gate_proj": 0, "up_proj": 1}


def _multiplier_list(cfg: Any, name: str, length: int) -> list[float]:
    values = getattr(cfg, name, None)
    values = [1.0] * length if values is None else [float(v) for v in values]
    if len(values) != length:
        raise ValueError(f"FalconH1: {name} needs {length} values, got {values}")
    return values


def falcon_mamba_mixer(cfg: Any, dtype: torch.dtype) -> Mamba2Mixer:
    d_ssm = cfg.mamba_d_ssm if cfg.mamba_d_ssm is not None else int(cfg.mamba_expand * cfg.hidden_size)
    if cfg.mamba_d_head == "auto" or cfg.mamba_n_heads * cfg.mamba_d_head != d_ssm:
        raise ValueError(f"FalconH1: mamba_n_heads * mamba_d_head must equal the mixer width (mamba_d_ssm, or "
                         f"mamba_expand * hidden_size) = {d_ssm}")
    limit = getattr(cfg, "time_step_limit", None)
    return Mamba2Mixer(
        hidden_size=cfg.hidden_size, num_heads=cfg.mamba_n_heads, head_dim=cfg.mamba_d_head,
        state_size=cfg.mamba_d_state, n_groups=cfg.mamba_n_groups, conv_kernel=cfg.mamba_d_conv,
        chunk_size=cfg.mamba_chunk_size, intermediate_size=d_ssm, use_conv_bias=bool(cfg.mamba_conv_bias),
        use_bias=bool(cfg.mamba_proj_bias), out_proj_bias=bool(cfg.projectors_bias), activation=cfg.hidden_act,
        norm_eps=cfg.rms_norm_eps, norm_before_gate=bool(cfg.mamba_norm_before_gate),
        use_norm=bool(cfg.mamba_rms_norm),
        time_step_limit=(0.0, float("inf")) if limit is None else (float(limit[0]), float(limit[1])),
        dt_bias_init=1.0, zxbcdt_multipliers=_multiplier_list(cfg, "ssm_multipliers", 5), dtype=dtype)


class FalconH1MLP(nn.Module):
    """down(up(x) * act(gate(x) * gate_multiplier)) * down_multiplier, gate and up fused into one matmul."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        inter, bias = cfg.intermediate_size, bool(getattr(cfg, "mlp_bias", False))
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=bias)
        stacked(self.gate_up_proj.weight, [inter, inter])
        if bias:
            stacked(self.gate_up_proj.bias, [inter, inter])
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=bias)
        self.act = activation_fn(cfg.hidden_act)
        self.gate_multiplier, self.down_multiplier = _multiplier_list(cfg, "mlp_multipliers", 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * self.act(gate * self.gate_multiplier)) * self.down_multiplier


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, rotary: RotaryEmbedding, head_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        heads = cfg.num_attention_heads
        self.self_attn = QKVAttention(
            cfg.hidden_size, heads, cfg.num_key_value_heads or heads, head_dim, bias=bool(cfg.attention_bias),
            scale=head_dim ** -0.5, rotary=rotary, dtype=dtype, key_multiplier=multiplier(cfg, "key_multiplier"))
        self.mamba = falcon_mamba_mixer(cfg, dtype)
        self.feed_forward = FalconH1MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ssm_in, self.ssm_out = multiplier(cfg, "ssm_in_multiplier"), multiplier(cfg, "ssm_out_multiplier")
        self.attn_in = multiplier(cfg, "attention_in_multiplier")
        self.attn_out = multiplier(cfg, "attention_out_multiplier")

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta,
                rope_lens: torch.Tensor | None) -> torch.Tensor:
        # x: [T, hidden]
        h = self.input_layernorm(x)
        ssm = self.mamba(h * self.ssm_in, meta.state) * self.ssm_out
        attn = self.self_attn(h * self.attn_in, meta.attn, positions, rope_lens) * self.attn_out
        x = x + (ssm + attn)  # transformers sums the two branches before the residual
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class FalconH1Model(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # one rotary table shared by all layers (it holds no weights)
        rotary = RotaryEmbedding(head_dim, rope_parameters(cfg), cfg.max_position_embeddings)
        self.layers = nn.ModuleList(FalconH1DecoderLayer(cfg, rotary, head_dim, dtype)
                                    for _ in range(cfg.num_hidden_layers))
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class FalconH1ForCausalLM(ModelBase):
    pipeline_layers, pipeline_carry = "model.layers", 1
    is_hybrid = True

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__(hf_config)
        cfg = hf_config
        self.embedding_multiplier = multiplier(cfg, "embedding_multiplier")
        self.lm_head_multiplier = multiplier(cfg, "lm_head_multiplier")
        self.dynamic_rope = rope_parameters(cfg)["rope_type"] == "dynamic"
        self.model = FalconH1Model(cfg, dtype)
        self.add_lm_head(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids) * self.embedding_multiplier  # [T, hidden]
        rope_lens = rope_seq_lens(meta.attn, x.device) if self.dynamic_rope else None
        for layer in self.model.layers:
            x = layer(x, positions, meta, rope_lens)
        return self.model.final_layernorm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) * self.lm_head_multiplier

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        if "rotary_emb" in name or name.endswith("mup_vector"):
            return None  # derived from the config, not learned
        parts = name.split(".")
        if ".feed_forward." in name and len(parts) >= 2 and parts[-2] in _GATE_UP:
            return ".".join(parts[:-2] + ["gate_up_proj", parts[-1]]), _GATE_UP[parts[-2]]
        if ".self_attn." in name:
            fused = map_qkv_name(name)
            if fused is not None:
                return fused
        return name, None
