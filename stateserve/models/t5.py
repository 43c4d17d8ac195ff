"""T5 (T5ForConditionalGeneration: original T5, v1.1 and Flan-T5): pre-RMSNorm encoder-decoder with no position
embeddings; instead a learned bias per (relative-position bucket, head) is added to the self-attention scores
(computed by the first block of each stack and shared by all blocks). Attention is unscaled (scale 1.0).

The decoder's bias goes to the paged attention layer as a PositionBias: this file maps (key - query) positions to
bias values, the layer picks the positions of each step (absolute ones, so chunked prefill and decode see exactly
the scores a full recompute would).
Feed-forward: relu / gelu_new (`feed_forward_proj`), or the gated variant ("gated-gelu", v1.1/Flan).
Output: the LM head is tied to the shared embedding unless the checkpoint has its own lm_head.weight (the rule
transformers applies), and the decoder output is scaled by d_model**-0.5 when config.scale_decoder_outputs
(transformers' name for "tie_word_embeddings was not False")."""
from __future__ import annotations

import json
import math
import os
from typing import Any

import torch
from torch import nn

from stateserve.layers.attention import Attention
from stateserve.layers.cross_attention import (KV, CrossAttention, CrossAttnMetadata, activation, encoder_attention,
                                               padding_mask)
from stateserve.layers.encoder_decoder_blocks import pad_ids, text_encoder_input
from stateserve.layers.metadata import AttnMetadata, ForwardMeta
from stateserve.layers.norm import RMSNorm
from stateserve.layers.position_bias import PositionBias
from stateserve.models.base import ModelBase


def relative_position_bucket(relative: torch.Tensor, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """key_pos - query_pos -> bucket in [0, num_buckets): exact buckets for small distances, log-spaced ones up to
    max_distance. Unidirectional (decoder) buckets only distinguish keys at or before the query."""
    buckets = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative > 0).long() * num_buckets
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)
    max_exact = num_buckets // 2
    log_ratio = torch.log(distance.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
    large = (max_exact + (log_ratio * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < max_exact, distance, large)


class T5Attention(nn.Module):
    def __init__(self, cfg: Any, has_bias_table: bool) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.d_kv
        inner = self.num_heads * self.head_dim
        self.q, self.k, self.v = (nn.Linear(cfg.d_model, inner, bias=False) for _ in range(3))
        self.o = nn.Linear(inner, cfg.d_model, bias=False)
        if has_bias_table:
            self.relative_attention_bias = nn.Embedding(cfg.relative_attention_num_buckets, self.num_heads)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:-1], self.num_heads, self.head_dim)


class T5EncoderSelfAttention(T5Attention):
    def forward(self, x: torch.Tensor, valid: torch.Tensor | None, bias: torch.Tensor) -> torch.Tensor:
        # x: [B, L, d]; bias: [1, H, L, L]
        q, k, v = self.heads(self.q(x)), self.heads(self.k(x)), self.heads(self.v(x))
        return self.o(encoder_attention(q, k, v, valid, 1.0, bias).flatten(2))


class T5DecoderSelfAttention(T5Attention):
    def __init__(self, cfg: Any, has_bias_table: bool, dtype: torch.dtype) -> None:
        super().__init__(cfg, has_bias_table)
        self.attn = Attention(self.num_heads, self.num_heads, self.head_dim, 1.0, dtype)

    def forward(self, x: torch.Tensor, meta: AttnMetadata, bias: PositionBias) -> torch.Tensor:
        q, k, v = self.heads(self.q(x)), self.heads(self.k(x)), self.heads(self.v(x))
        return self.o(self.attn(q, k, v, meta, bias).flatten(1))


class T5CrossAttention(T5Attention):
    def __init__(self, cfg: Any, layer_idx: int) -> None:
        super().__init__(cfg, False)
        self.attn = CrossAttention(self.num_heads, self.num_heads, self.head_dim, 1.0, layer_idx)

    def project_kv(self, encoder_hidden: torch.Tensor) -> KV:
        # [L, d] -> k, v: [H, L, D]
        return (self.heads(self.k(encoder_hidden)).transpose(0, 1).contiguous(),
                self.heads(self.v(encoder_hidden)).transpose(0, 1).contiguous())

    def forward(self, x: torch.Tensor, meta: CrossAttnMetadata) -> torch.Tensor:
        return self.o(self.attn(self.heads(self.q(x)), meta).flatten(1))


class T5DenseReluDense(nn.Module):
    def __init__(self, cfg: Any, gated: bool) -> None:
        super().__init__()
        self.gated = gated
        if gated:
            self.wi_0 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
            self.wi_1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        else:
            self.wi = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.wo = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)
        self.act = activation(cfg.dense_act_fn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.wi_0(x)) * self.wi_1(x) if self.gated else self.act(self.wi(x))
        return self.wo(h)


class _Sublayer(nn.Module):
    """One residual branch with its pre-norm; `inner` keeps transformers' attribute name."""

    def __init__(self, name: str, inner: nn.Module, cfg: Any) -> None:
        super().__init__()
        setattr(self, name, inner)
        self.inner_name = name
        self.layer_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def forward(self, x: torch.Tensor, *args) -> torch.Tensor:
        return x + getattr(self, self.inner_name)(self.layer_norm(x), *args)


class T5Block(nn.Module):
    def __init__(self, cfg: Any, index: int, decoder: bool, dtype: torch.dtype, gated: bool) -> None:
        super().__init__()
        first = index == 0
        attn = T5DecoderSelfAttention(cfg, first, dtype) if decoder else T5EncoderSelfAttention(cfg, first)
        layers = [_Sublayer("SelfAttention", attn, cfg)]
        if decoder:
            layers.append(_Sublayer("EncDecAttention", T5CrossAttention(cfg, index), cfg))
        layers.append(_Sublayer("DenseReluDense", T5DenseReluDense(cfg, gated), cfg))
        self.layer = nn.ModuleList(layers)


class T5Stack(nn.Module):
    def __init__(self, cfg: Any, num_layers: int, decoder: bool, dtype: torch.dtype, gated: bool) -> None:
        super().__init__()
        self.block = nn.ModuleList(T5Block(cfg, i, decoder, dtype, gated) for i in range(num_layers))
        self.final_layer_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)

    @property
    def bias_table(self) -> nn.Embedding:
        return self.block[0].layer[0].SelfAttention.relative_attention_bias


def checkpoint_has_tensor(path: str, name: str) -> bool:
    """Whether the safetensors checkpoint in `path` holds `name` (reads only headers / the index)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return name in json.load(f).get("weight_map", {})
    from safetensors import safe_open

    for file in sorted(os.listdir(path)) if os.path.isdir(path) else []:
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(path, file), framework="pt") as f:
                if name in f.keys():
                    return True
    return False


class T5ForConditionalGeneration(ModelBase):
    prepends_decoder_start = True

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__(hf_config)
        cfg = hf_config
        proj = cfg.feed_forward_proj.split("-")
        if len(proj) > 2 or (len(proj) == 2 and proj[0] != "gated"):
            raise ValueError(f"feed_forward_proj={cfg.feed_forward_proj!r} is not supported: use 'ACT' or 'gated-ACT'")
        gated = getattr(cfg, "is_gated_act", len(proj) == 2)
        if not hasattr(cfg, "dense_act_fn"):
            cfg.dense_act_fn = "gelu_new" if cfg.feed_forward_proj == "gated-gelu" else proj[-1]
        self.decoder_start_token_id = cfg.decoder_start_token_id
        self.num_buckets, self.max_distance = cfg.relative_attention_num_buckets, cfg.relative_attention_max_distance
        self.output_scale = cfg.d_model ** -0.5 if getattr(cfg, "scale_decoder_outputs",
                                                            getattr(cfg, "tie_word_embeddings", True)) else 1.0
        self.dtype = dtype
        self.shared = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.encoder = T5Stack(cfg, cfg.num_layers, False, dtype, gated)
        num_decoder_layers = getattr(cfg, "num_decoder_layers", None) or cfg.num_layers
        self.decoder = T5Stack(cfg, num_decoder_layers, True, dtype, gated)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        path = getattr(cfg, "_name_or_path", "") or ""
        if not checkpoint_has_tensor(path, "lm_head.weight"):
            self.tied_params = {"lm_head.weight": "shared.weight"}
            self.tie_weights_()

    # ---- encoder -------------------------------------------------------------------------------
    def prepare_encoder_input(self, raw: dict[str, Any], model_path: str, max_len: int) -> tuple[dict, int]:
        # relative positions have no table to run out of: the engine's max_model_len bounds the encoder too
        return text_encoder_input(raw, self.config.vocab_size, max_len, "max_model_len")

    def encode(self, inputs: list[dict[str, Any]]) -> list[torch.Tensor]:
        """Run the encoder over a batch of requests; each output [L_i, d_model]."""
        device = self.lm_head.weight.device
        ids, lens = pad_ids([d["input_ids"] for d in inputs], device)
        positions = torch.arange(ids.shape[1], device=device)
        rel = positions[None, :] - positions[:, None]  # [L, L] key - query
        buckets = relative_position_bucket(rel, True, self.num_buckets, self.max_distance)
        bias = self.encoder.bias_table(buckets).permute(2, 0, 1).unsqueeze(0)  # [1, H, L, L]
        valid = padding_mask(lens, device)
        x = self.shared(ids)  # [B, L, d]
        for block in self.encoder.block:
            x = block.layer[0](x, valid, bias)
            x = block.layer[1](x)
        x = self.encoder.final_layer_norm(x)
        return [x[i, :n] for i, n in enumerate(lens)]

    def cross_kv(self, encoder_hidden: torch.Tensor) -> list[KV]:
        return [block.layer[1].EncDecAttention.project_kv(encoder_hidden) for block in self.decoder.block]

    # ---- decoder -------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        x = self.shared(input_ids)  # [T, d]
        table = self.decoder.bias_table
        # the attention layer picks the (key - query) positions of this step; the bias of each is looked up here
        bias = PositionBias(lambda rel: table(relative_position_bucket(rel, False, self.num_buckets,
                                                                       self.max_distance)))
        cross = meta.extra["cross"]
        for block in self.decoder.block:
            x = block.layer[0](x, meta.attn, bias)
            x = block.layer[1](x, cross)
            x = block.layer[2](x)
        return self.decoder.final_layer_norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden * self.output_scale)

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        if name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
            return None  # copies of shared.weight in older checkpoints
        if name.endswith("EncDecAttention.relative_attention_bias.weight"):
            return None  # unused by transformers too
        return name, None
