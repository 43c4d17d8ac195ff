"""LFM3: LFM2's hybrid of short-conv and attention layers (models/lfm2.py) with the changes of transformers'
Lfm3ForCausalLM:
- a third layer type, "sliding_attention": attention over the last `sliding_window` positions only. The window is
  a score mask (the PositionBias path of layers/attention.py) built only in steps where some sequence is longer
  than the window, so short sequences keep the fused kernels. The KV cache still holds every position: the
  full-attention layers share the block tables and read every block, so none can be given back as it leaves the
  window (RecurrentGemma, whose attention layers are all windowed, does give them back);
- rotary parameters per attention type (`rope_parameters[layer_type]`); full attention defaults to
  "proportional" rope, which rotates the first partial_rotary_factor of each head's frequency pairs at
  base^(-2j/head_dim) (exponents over the whole head, unlike partial rotary) and leaves the rest in place;
- attention with optional q/k/v/o biases (attention_bias) and a per-head sigmoid output gate g_proj(x)
  (use_attention_gate; checkpoints spell it `self_attn.gate_proj`);
- sandwich norms (use_sandwich_norm): post_operator_norm and post_ffn_norm on the mixer's and the
  feed-forward's outputs before each residual add;
- the feed-forward at intermediate_size unadjusted; conv_L_cache defaults to 7."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stateserve.layers.decoder_layer import GatedMLP
from stateserve.layers.metadata import ForwardMeta
from stateserve.layers.position_bias import PositionBias
from stateserve.layers.rotary import RotaryEmbedding
from stateserve.models.lfm2 import CONV, FULL, SLIDING, LfmAttention, LfmCausalLMBase, sliding_window_bias


def lfm3_rope_parameters(cfg: Any, layer_type: str) -> dict[str, Any]:
    """The rotary parameters of one attention type: rope_parameters[layer_type] (a flat dict applies to all)."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    if isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    elif any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"Lfm3ForCausalLM: rope_parameters has no entry for the {layer_type!r} layers")
    params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


class ProportionalRotary(RotaryEmbedding):
    """rope_type "proportional" over the whole head (rotate-half pairs i, i + head_dim/2): the first
    int(partial_rotary_factor * head_dim // 2) pairs turn at base^(-2j/head_dim) / factor, the others at
    frequency 0 (cos 1, sin 0: unchanged), as transformers' _compute_proportional_rope_parameters."""

    def __init__(self, head_dim: int, params: dict[str, Any], max_position_embeddings: int) -> None:
        super().__init__(head_dim, {**params, "rope_type": "default"}, max_position_embeddings)
        self.rope_type = "proportional"
        angles = int(float(params.get("partial_rotary_factor", 1.0)) * head_dim // 2)
        inv = torch.zeros(head_dim // 2)
        inv[:angles] = 1.0 / (self.base ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
        self.inv_freq = inv / float(params.get("factor", 1.0))  # [head_dim/2] float32; tables are built from it


class Lfm3ForCausalLM(LfmCausalLMBase):
    layer_type_names = (CONV, FULL, SLIDING)

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__(hf_config, dtype)
        window = getattr(hf_config, "sliding_window", None)
        types = self.layer_types(hf_config)
        self.window = int(window) if window is not None and SLIDING in types else None
        if self.window is not None:  # built only in steps with a sequence past the window, from host-side lengths
            self.graph_blocker = "the sliding-window mask is built from host-side sequence lengths each step"

    def make_attention(self, cfg: Any, layer_type: str, dtype: torch.dtype) -> nn.Module:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        params = lfm3_rope_parameters(cfg, layer_type)
        max_pos = cfg.max_position_embeddings
        rotary = (ProportionalRotary(head_dim, params, max_pos) if params["rope_type"] == "proportional"
                  else RotaryEmbedding(head_dim, params, max_pos))
        window = getattr(cfg, "sliding_window", None) if layer_type == SLIDING else None
        return LfmAttention(cfg, dtype, rotary, bias=bool(getattr(cfg, "attention_bias", False)),
                            gate=bool(getattr(cfg, "use_attention_gate", True)),
                            window=None if window is None else int(window))

    def make_feed_forward(self, cfg: Any, index: int) -> nn.Module:
        return GatedMLP(cfg.hidden_size, int(cfg.intermediate_size))

    def sandwich_norms(self, cfg: Any) -> bool:
        return bool(getattr(cfg, "use_sandwich_norm", True))

    def window_bias(self, meta: ForwardMeta) -> PositionBias | None:
        attn = meta.attn
        if self.window is None or attn is None or not attn.seq_lens or max(attn.seq_lens) <= self.window:
            return None  # no query of the step sees a key outside its window
        return sliding_window_bias(self.window)
