"""BART (BartForConditionalGeneration): a post-LayerNorm encoder-decoder with learned positions (offset 2),
layernorm_embedding, optional sqrt(d_model) embedding scale and final_logits_bias.

The attention modules here (encoder self-attention, paged decoder self-attention, cross-attention) are
shared with Whisper, which differs in pre-LayerNorm placement and a k_proj without bias.
Encoder-decoder protocol (used by EncoderDecoderModelState): prepare_encoder_input, encode, cross_kv."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from stateserve.layers.attention import Attention
from stateserve.layers.cross_attention import (KV, CrossAttention, CrossAttnMetadata, activation, encoder_attention,
                                               padding_mask)
from stateserve.layers.metadata import AttnMetadata, ForwardMeta
from stateserve.models.base import ModelBase

_POSITION_OFFSET = 2  # BART's learned position tables start 2 rows in (a fairseq leftover)


class Projections(nn.Module):
    """q/k/v/out projections of one multi-head attention (names as in transformers' Bart/Whisper)."""

    def __init__(self, d_model: int, num_heads: int, bias: bool = True, k_bias: bool = True) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not a multiple of the attention heads ({num_heads})")
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.scale = self.head_dim ** -0.5
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, d_model, bias=bias and k_bias)
        self.v_proj = nn.Linear(d_model, d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:-1], self.num_heads, self.head_dim)


class EncoderSelfAttention(Projections):
    def forward(self, x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        # x: [B, L, d]; valid: [B, L] or None
        q, k, v = self.heads(self.q_proj(x)), self.heads(self.k_proj(x)), self.heads(self.v_proj(x))
        return self.out_proj(encoder_attention(q, k, v, valid, self.scale).flatten(2))


class DecoderSelfAttention(Projections):
    def __init__(self, d_model: int, num_heads: int, dtype: torch.dtype, k_bias: bool = True) -> None:
        super().__init__(d_model, num_heads, k_bias=k_bias)
        self.attn = Attention(num_heads, num_heads, self.head_dim, self.scale, dtype)

    def forward(self, x: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        # x: [T, d]
        q, k, v = self.heads(self.q_proj(x)), self.heads(self.k_proj(x)), self.heads(self.v_proj(x))
        return self.out_proj(self.attn(q, k, v, meta).flatten(1))


class DecoderCrossAttention(Projections):
    def __init__(self, d_model: int, num_heads: int, layer_idx: int, k_bias: bool = True) -> None:
        super().__init__(d_model, num_heads, k_bias=k_bias)
        self.attn = CrossAttention(num_heads, num_heads, self.head_dim, self.scale, layer_idx)

    def project_kv(self, encoder_hidden: torch.Tensor) -> KV:
        # encoder_hidden: [L, d] -> k, v: [H, L, D]
        k = self.heads(self.k_proj(encoder_hidden)).transpose(0, 1).contiguous()
        v = self.heads(self.v_proj(encoder_hidden)).transpose(0, 1).contiguous()
        return k, v

    def forward(self, x: torch.Tensor, meta: CrossAttnMetadata) -> torch.Tensor:
        return self.out_proj(self.attn(self.heads(self.q_proj(x)), meta).flatten(1))


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


def text_encoder_input(raw: dict[str, Any], vocab_size: int, max_len: int, limit_name: str) -> tuple[dict, int]:
    """Validate {"input_ids": [...]} for a text encoder: non-empty, in the vocabulary, within max_len."""
    unknown = set(raw) - {"input_ids"}
    if unknown or "input_ids" not in raw:
        raise ValueError(f"this model's encoder takes text (an encoder prompt); got encoder input key(s) "
                         f"{sorted(raw)}")
    ids = raw["input_ids"]
    if not isinstance(ids, (list, tuple)) or not ids:
        raise ValueError("encoder prompt is empty: give at least one token")
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"encoder prompt has token id(s) outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if len(ids) > max_len:
        raise ValueError(f"encoder prompt has {len(ids)} tokens, more than the encoder's {limit_name}={max_len}")
    return {"input_ids": list(ids)}, len(ids)


def pad_ids(seqs: list[list[int]], device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """Right-pad token id lists into [B, L_max] (pad id 0; padded keys are masked out)."""
    lens = [len(s) for s in seqs]
    ids = torch.zeros(len(seqs), max(lens), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
    return ids.to(device), lens


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
