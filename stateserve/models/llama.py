"""Llama and Qwen2 decoders: embeddings, a stack of layers/decoder_layer.py's DecoderLayer (GQA attention with RoPE,
SwiGLU MLP, RMSNorm; Qwen2 adds qkv bias), the final norm and the head; checkpoint names mapped onto the fused q/k/v
and gate/up projections."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stateserve.layers.decoder_layer import DecoderLayer, rope_seq_lens
from stateserve.layers.metadata import ForwardMeta
from stateserve.layers.norm import RMSNorm
from stateserve.layers.rotary import rope_parameters
from stateserve.models.base import ModelBase

_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
_GATE_UP = {"gate_proj": 0, "up_proj": 1}


class LlamaModel(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, qkv_bias: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, qkv_bias) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(ModelBase):
    pipeline_layers, pipeline_carry = "model.layers", 2
    qkv_bias_from_config = True

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__(hf_config)
        cfg = hf_config
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError("sliding-window attention (use_sliding_window=True) is not supported")
        qkv_bias = self._qkv_bias(cfg)
        self.dynamic_rope = rope_parameters(cfg)["rope_type"] == "dynamic"
        self.model = LlamaModel(cfg, dtype, qkv_bias)
        self.add_lm_head(cfg)

    @staticmethod
    def _qkv_bias(cfg: Any) -> bool:
        return bool(getattr(cfg, "attention_bias", False))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        rope_lens = rope_seq_lens(meta.attn, x.device) if self.dynamic_rope else None
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, positions, meta.attn, rope_lens)
        return self.model.norm.add_forward(x, residual)[0]

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        if "rotary_emb.inv_freq" in name:
            return None
        parts = name.split(".")
        if len(parts) >= 2:
            proj = parts[-2]
            if proj in _QKV:
                return ".".join(parts[:-2] + ["qkv_proj", parts[-1]]), _QKV[proj]
            if proj in _GATE_UP:
                return ".".join(parts[:-2] + ["gate_up_proj", parts[-1]]), _GATE_UP[proj]
        return name, None


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def _qkv_bias(cfg: Any) -> bool:
        return True
