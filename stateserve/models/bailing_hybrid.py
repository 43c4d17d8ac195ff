"""Bailing Hybrid (Ling 3): Kimi Linear's layout with three differences, so it is built from kimi_linear.py's parts.

Per transformers' BailingHybridForCausalLM:
- the linear-attention layers are Kimi Delta Attention (layers/kda.py) with full-rank forget / output gates (f_proj,
  g_proj) and, with `kda_safe_gate`, a bounded log decay `kda_lower_bound * sigmoid(exp(A) * (f + dt_bias))`;
- the full-attention layers are DeepSeek-V3 MLA *with* an interleaved rotary part (Kimi's is NoPE) and a per-head
  sigmoid output gate (g_proj [H, hidden]) before o_proj;
- every `layer_group_size`-th layer is MLA unless `layer_types` says otherwise; MoE layers (sigmoid router with a
  correction bias, group-limited top-k, shared experts) after the first `first_k_dense_replace`.

The MLA cache is Kimi's: one latent row per token (the normed kv latent and the *rotated* shared key), with the
rotary half kept de-interleaved ([even | odd] pairs), a layout-only change that leaves every q.k product as it is.

Checkpoint names (what transformers 5.24 saves, the original Ling layout): word_embeddings, layers.N.attention.*
(`dense` is o_proj), q/k/v_conv1d, mlp.gate.expert_bias; they are renamed to Kimi's and mapped by its loader."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from stateserve.layers.kda import KimiDeltaAttention
from stateserve.layers.metadata import ForwardMeta
from stateserve.layers.moe import GatedMLPExpert
from stateserve.layers.rotary import RotaryEmbedding, rope_parameters
from stateserve.models.kimi_linear import (KimiLinearForCausalLM, KimiMLA, KimiMoE, KimiRMSNorm, layer_types,
                                           mlp_types)

FAMILY = "Bailing Hybrid"


def _yarn_mscale(params: dict[str, Any]) -> float:
    """transformers' yarn_apply_mscale factor on the score scale (1 unless a scaled rope sets mscale_all_dim)."""
    factor, mscale = params.get("factor", 1.0), params.get("mscale_all_dim", 0)
    if params["rope_type"] == "default" or not mscale or factor <= 1:
        return 1.0
    m = 0.1 * mscale * math.log(factor) + 1.0
    return m * m


class BailingMLA(KimiMLA):
    """Kimi's absorbed MLA plus the interleaved rotary embedding on q_rope / k_rot and the per-head output gate."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__(cfg, dtype)
        params = rope_parameters(cfg)
        # de-interleaving the pairs turns DeepSeek's interleaved rotation into the rotate-half one RotaryEmbedding does
        # yarn as transformers runs it: attention_factor on cos and sin here, mscale_all dim on the score scale below
        self.rotary = RotaryEmbedding(self.rope, params, getattr(cfg, "max_position_embeddings", 4096) or 4096,
                                      yarn=True)
        self.attn.scale = self.qk_dim ** -0.5 * _yarn_mscale(params)
        self.g_proj = nn.Linear(cfg.hidden_size, self.num_heads, bias=False)

    def encode_positions(self, q_rope: torch.Tensor, k_rot: torch.Tensor,
                         positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # q_rope [T, H, rope], k_rot [T, rope] -> the same shapes, rotated, pairs de-interleaved
        if positions is None:
            raise ValueError(f"{FAMILY} MLA needs token positions for its rotary part")
        q = torch.cat([q_rope[..., 0::2], q_rope[..., 1::2]], dim=-1)
        k = torch.cat([k_rot[..., 0::2], k_rot[..., 1::2]], dim=-1).unsqueeze(1)  # [T, 1, rope]
        q, k = self.rotary(positions, q, k)
        return q, k.squeeze(1)

    def gate_heads(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        # x [T, hidden], out [T, H, v]: each head's output times sigmoid of its gate (float32, then rounded)
        gate = torch.sigmoid(self.g_proj(x).float()).to(out.dtype)
        return out * gate.unsqueeze(-1)


class BailingDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, layer_type: str, mlp_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            # linear_* as the config derives them: head_dim itself is overwritten with qk_rope_head_dim (DeepSeek-V3's
            # config), so the KDA heads' width is only in linear_head_dim
            self.self_attn: nn.Module = KimiDeltaAttention(
                cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim,
                cfg.rms_norm_eps, cfg.hidden_act, dtype, low_rank_gates=False,
                gate_lower_bound=float(cfg.kda_lower_bound) if cfg.kda_safe_gate else None)
        else:
            self.self_attn = BailingMLA(cfg, dtype)
        self.mlp = KimiMoE(cfg) if mlp_type == "sparse" else GatedMLPExpert(
            cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, fused_checkpoint=False)
        self.input_layernorm = KimiRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = KimiRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        # x: [T, hidden], positions: [T] -> [T, hidden]
        h = self.input_layernorm(x)
        if self.layer_type == "linear_attention":
            h = self.self_attn(h, meta.state)
        else:
            h = self.self_attn(h, meta.attn, positions)
        h, x = self.post_attention_layernorm.add_forward(h, x)  # x += h (x is this forward's own stream), norm
        return x + self.mlp(h)


class BailingHybridModel(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(BailingDecoderLayer(cfg, t, m, dtype)
                                    for t, m in zip(layer_types(cfg, FAMILY), mlp_types(cfg, FAMILY)))
        self.norm = KimiRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def _check_config(cfg: Any) -> None:
    """Options this implementation does not run, refused by name rather than computed wrongly."""
    for key in ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"):
        if not isinstance(getattr(cfg, key, None), int):  # set by BailingHybridConfig.__post_init__
            raise ValueError(f"{FAMILY}: the config lacks {key} (derived from num_attention_heads, head_dim and "
                             "short_conv_kernel_size by transformers' BailingHybridConfig)")
    if cfg.linear_head_dim <= 0 or cfg.linear_conv_kernel_dim < 2:
        raise ValueError(f"{FAMILY}: linear_head_dim={cfg.linear_head_dim} must be positive and "
                         f"linear_conv_kernel_dim={cfg.linear_conv_kernel_dim} at least 2")
    if cfg.kda_safe_gate and not float(cfg.kda_lower_bound) < 0:
        raise ValueError(f"{FAMILY}: kda_lower_bound={cfg.kda_lower_bound} must be negative (a log decay bound)")
    if cfg.qk_rope_head_dim % 2:
        raise ValueError(f"{FAMILY}: qk_rope_head_dim={cfg.qk_rope_head_dim} must be even (rotary pairs)")


class BailingHybridForCausalLM(KimiLinearForCausalLM):
    """Kimi Linear's engine-facing behaviour (hybrid flags, weight mapping) over Bailing's layers."""

    is_hybrid = True
    family = FAMILY

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        _check_config(hf_config)
        super(KimiLinearForCausalLM, self).__init__(hf_config)  # ModelBase's: the model below is Bailing's own
        self.model = BailingHybridModel(hf_config, dtype)
        self.add_lm_head(hf_config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden [T, hidden]; positions feed only the MLA layers' rotary part
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, meta)
        return self.model.norm(x)

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        """Ling's checkpoint names (and transformers' in-memory ones) -> Kimi Linear's, then its mapping."""
        parts = name.split(".")
        if (len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
                and int(parts[2]) >= len(self.model.layers)):
            return None  # multi-token-prediction layers stored after the decoder: not used for inference
        if name.startswith("model.word_embeddings."):
            name = "model.embed_tokens." + name[len("model.word_embeddings."):]
        name = name.replace(".attention.", ".self_attn.").replace(".self_attn.dense.", ".self_attn.o_proj.")
        name = name.replace(".mlp.gate.expert_bias", ".mlp.gate.e_score_correction_bias")
        return super().map_weight_name(name)
