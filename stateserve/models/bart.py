"""BART (BartForConditionalGeneration): a post-LayerNorm encoder-decoder with learned positions (offset 2),
layernorm_embedding, optional sqrt(d_model) embedding scale and final_logits_bias.

The attention modules (encoder self-attention, paged decoder self-attention, cross-attention) live in
layers/encoder_decoder_blocks.py, shared with Whisper (which differs in pre-LayerNorm placement and a k_proj
without bias).
Encoder-decoder protocol (used by EncoderDecoderModelState): prepare_encoder_input, encode, cross_kv."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from stateserve.layers.cross_attention import KV, CrossAttnMetadata, activation, padding_mask
from stateserve.layers.encoder_decoder_blocks import (DecoderCrossAttention, DecoderSelfAttention,
                                                      EncoderSelfAttention, pad_ids, text_encoder_input)
from stateserve.layers.metadata import AttnMetadata, ForwardMeta
from stateserve.models.base import ModelBase

_POSITION_OFFSET = 2  # BART's learned position tables start 2 rows in (a fairseq leftover)


class BartEncoderLayer(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        d = cfg.d_model
        self.self_attn = EncoderSelfAttention(d, cfg.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, cfg.encoder_ffn_dim), nn.Linear(cfg.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.act = activation(cfg.activation_function)

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        x = self.self_attn_layer_norm(x + self.self_attn(x, valid))
        return self.final_layer_norm(x + self.fc2(self.act(self.fc1(x))))


class BartDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, layer_idx: int) -> None:
        super().__init__()
        d, heads = cfg.d_model, cfg.decoder_attention_heads
        self.self_attn = DecoderSelfAttention(d, heads, dtype)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = DecoderCrossAttention(d, heads, layer_idx)
        self.encoder_attn_layer_norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, cfg.decoder_ffn_dim), nn.Linear(cfg.decoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.act = activation(cfg.activation_function)

    def forward(self, x: torch.Tensor, attn: AttnMetadata, cross: CrossAttnMetadata) -> torch.Tensor:
        x = self.self_attn_layer_norm(x + self.self_attn(x, attn))
        x = self.encoder_attn_layer_norm(x + self.encoder_attn(x, cross))
        return self.final_layer_norm(x + self.fc2(self.act(self.fc1(x))))


class _Stack(nn.Module):
    def __init__(self, cfg: Any, layers: list[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings + _POSITION_OFFSET, cfg.d_model)
        self.layers = nn.ModuleList(layers)
        self.layernorm_embedding = nn.LayerNorm(cfg.d_model)


class _BartModel(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.shared = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.encoder = _Stack(cfg, [BartEncoderLayer(cfg) for _ in range(cfg.encoder_layers)])
        self.decoder = _Stack(cfg, [BartDecoderLayer(cfg, dtype, i) for i in range(cfg.decoder_layers)])


class BartForConditionalGeneration(ModelBase):
    prepends_decoder_start = True

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__(hf_config)
        cfg = hf_config
        self.decoder_start_token_id = cfg.decoder_start_token_id
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.scale_embedding else 1.0
        self.model = _BartModel(cfg, dtype)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.final_logits_bias = nn.Parameter(torch.zeros(1, cfg.vocab_size))  # [1, V], as in checkpoints
        if getattr(cfg, "tie_word_embeddings", True):
            self.tied_params = {"lm_head.weight": "model.shared.weight",
                                "model.encoder.embed_tokens.weight": "model.shared.weight",
                                "model.decoder.embed_tokens.weight": "model.shared.weight"}
            self.tie_weights_()

    # ---- encoder -------------------------------------------------------------------------------
    def prepare_encoder_input(self, raw: dict[str, Any], model_path: str, max_len: int) -> tuple[dict, int]:
        return text_encoder_input(raw, self.config.vocab_size, self.config.max_position_embeddings,
                                  "max_position_embeddings")

    def _embed(self, stack: _Stack, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = stack.embed_tokens(ids) * self.embed_scale + stack.embed_positions(positions + _POSITION_OFFSET)
        return stack.layernorm_embedding(x)

    def encode(self, inputs: list[dict[str, Any]]) -> list[torch.Tensor]:
        """Run the encoder over a batch of requests; each output [L_i, d_model]."""
        device = self.lm_head.weight.device
        ids, lens = pad_ids([d["input_ids"] for d in inputs], device)
        valid = padding_mask(lens, device)
        x = self._embed(self.model.encoder, ids, torch.arange(ids.shape[1], device=device)[None, :])
        for layer in self.model.encoder.layers:
            x = layer(x, valid)
        return [x[i, :n] for i, n in enumerate(lens)]

    def cross_kv(self, encoder_hidden: torch.Tensor) -> list[KV]:
        return [layer.encoder_attn.project_kv(encoder_hidden) for layer in self.model.decoder.layers]

    # ---- decoder -------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        x = self._embed(self.model.decoder, input_ids, positions)  # [T, d]
        cross = meta.extra["cross"]
        for layer in self.model.decoder.layers:
            x = layer(x, meta.attn, cross)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) + self.final_logits_bias

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        if name.endswith(".version"):  # fairseq bookkeeping in old checkpoints
            return None
        return name, None
