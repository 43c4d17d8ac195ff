"""BERT, RoBERTa and XLM-RoBERTa encoders for embeddings: bidirectional attention with no KV cache,
absolute position embeddings, token type embeddings, post-LayerNorm blocks, as transformers computes them.

The encoder attention carries EncoderOnlyAttentionMarker, so the router gives these models the
EncoderOnlyModelState (no cache of any kind). They have no LM head: they are run by the pooling engine.
q/k/v are fused into one matmul (checkpoint shards are stacked on load); checkpoint names load 1:1 with
or without the "bert." / "roberta." prefix of the *For* heads' checkpoints."""
from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from stateserve.layers.attention import Attention
from stateserve.layers.metadata import AttnMetadata, ForwardMeta
from stateserve.layers.markers import EncoderOnlyAttentionMarker
from stateserve.layers.markers import stacked
from stateserve.models.base import ModelBase

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,  # erf form
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
    "tanh": torch.tanh,
}
_QKV = {"query": 0, "key": 1, "value": 2}
# checkpoint tensors that are not part of the encoder: the tanh pooler, MLM / classification heads, buffers
_SKIPPED_PREFIXES = ("pooler.", "cls.", "lm_head.", "classifier.", "qa_outputs.")


def check_encoder_config(cfg: Any) -> None:
    """Refuse configs that ask for something this encoder does not compute."""
    if getattr(cfg, "is_decoder", False):
        raise ValueError("is_decoder=True (a causal BERT decoder) is not supported; only encoders are")
    if getattr(cfg, "add_cross_attention", False):
        raise ValueError("add_cross_attention=True is not supported by the encoder-only BERT family")
    pos_type = getattr(cfg, "position_embedding_type", "absolute")
    if pos_type != "absolute":
        raise ValueError(f"position_embedding_type={pos_type!r} is not supported; only 'absolute' is")
    if cfg.hidden_size % cfg.num_attention_heads:
        raise ValueError(f"hidden_size={cfg.hidden_size} is not a multiple of "
                         f"num_attention_heads={cfg.num_attention_heads}")
    act = cfg.hidden_act
    if not isinstance(act, str) or act not in _ACTIVATIONS:
        raise ValueError(f"hidden_act={act!r} is not supported; supported: {', '.join(sorted(_ACTIVATIONS))}")


class EncoderSelfAttention(EncoderOnlyAttentionMarker, nn.Module):
    """Bidirectional multi-head attention within each sequence of the flat batch; never caches K/V."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // self.num_heads
        size = self.num_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, 3 * size)
        stacked(self.qkv_proj.weight, [size] * 3)
        stacked(self.qkv_proj.bias, [size] * 3)
        self.attn = Attention(self.num_heads, self.num_heads, self.head_dim, self.head_dim ** -0.5, dtype,
                              causal=False, uses_cache=False)

    def forward(self, x: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        # x: [T, hidden] -> [T, H * D]
        q, k, v = self.qkv_proj(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)  # each [T, H, D]
        return self.attn(q, k, v, meta).flatten(1)


class DenseLayerNorm(nn.Module):
    """dense -> (dropout, identity at inference) -> LayerNorm(out + residual): BERT's post-norm residual."""

    def __init__(self, in_size: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(in_size, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class AttentionBlock(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.self = EncoderSelfAttention(cfg, dtype)
        self.output = DenseLayerNorm(cfg.hidden_size, cfg.hidden_size, cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        return self.output(self.self(x, meta), x)


class Intermediate(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.attention = AttentionBlock(cfg, dtype)
        self.intermediate = Intermediate(cfg)
        self.output = DenseLayerNorm(cfg.intermediate_size, cfg.hidden_size, cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        x = self.attention(x, meta)
        return self.output(self.intermediate(x), x)


class Encoder(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = nn.ModuleList(EncoderLayer(cfg, dtype) for _ in range(cfg.num_hidden_layers))


class Embeddings(nn.Module):
    """word + token type + absolute position embeddings, then LayerNorm."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                token_type_ids: torch.Tensor) -> torch.Tensor:
        # all [T] -> [T, hidden]
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x + self.position_embeddings(position_ids))


class BertModel(ModelBase):
    """transformers' BertModel without its tanh pooler; forward returns the last hidden states [T, hidden]."""

    is_pooling_model: ClassVar[bool] = True
    default_pooling_mode: ClassVar[str] = "cls"  # vLLM's default for these architectures
    checkpoint_prefixes: ClassVar[tuple[str, ...]] = ("bert.", "model.")

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(hf_config)
        check_encoder_config(hf_config)
        self.embeddings = Embeddings(hf_config)
        self.encoder = Encoder(hf_config, dtype)

    @classmethod
    def max_encoder_len(cls, hf_config: Any) -> int:
        """The longest sequence the absolute position table can embed."""
        return int(hf_config.max_position_embeddings)

    def position_ids(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        return positions  # 0..L-1 within each sequence, as the runner builds them

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        # input_ids, positions: [T] -> [T, hidden]
        if any(c != 0 for c in meta.attn.context_lens):
            raise RuntimeError("an encoder must see each sequence whole in one step (no chunked prefill)")
        token_type_ids = meta.extra.get("token_type_ids")
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.embeddings(input_ids, self.position_ids(input_ids, positions, meta.attn), token_type_ids)
        for layer in self.encoder.layer:
            x = layer(x, meta.attn)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError(f"{type(self).__name__} is an embedding model with no LM head; it cannot generate text")

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        for prefix in self.checkpoint_prefixes:
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        if name.startswith(_SKIPPED_PREFIXES) or name.endswith(("position_ids", "token_type_ids")):
            return None
        if name.endswith("LayerNorm.gamma"):  # TF-era checkpoint names, renamed as transformers does
            name = name[:-len("gamma")] + "weight"
        elif name.endswith("LayerNorm.beta"):
            name = name[:-len("beta")] + "bias"
        parts = name.split(".")
        if len(parts) >= 3 and parts[-3] == "self" and parts[-2] in _QKV:
            return ".".join(parts[:-2] + ["qkv_proj", parts[-1]]), _QKV[parts[-2]]
        return name, None


class RobertaModel(BertModel):
    """RoBERTa: BERT's encoder with fairseq positions. Position ids start at padding_idx + 1 and count only
    non-padding tokens of a sequence; padding tokens themselves sit at position padding_idx."""

    checkpoint_prefixes: ClassVar[tuple[str, ...]] = ("roberta.", "model.")

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32) -> None:
        if hf_config.pad_token_id is None:
            raise ValueError(f"{type(self).__name__} needs pad_token_id: its position ids are offset by it")
        super().__init__(hf_config, dtype)
        self.padding_idx = int(hf_config.pad_token_id)

    @classmethod
    def max_encoder_len(cls, hf_config: Any) -> int:
        return int(hf_config.max_position_embeddings) - int(hf_config.pad_token_id) - 1

    def position_ids(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        # per sequence: cumsum(not pad) * (not pad) + padding_idx, on the flat batch with no padding
        not_pad = (input_ids != self.padding_idx).long()  # [T]
        running = torch.cumsum(not_pad, 0)
        starts = torch.tensor(meta.query_start_loc[:-1], dtype=torch.long, device=input_ids.device)
        before = torch.cat([running.new_zeros(1), running])[starts]  # non-pad tokens before each sequence
        lens = torch.tensor(meta.query_lens, dtype=torch.long, device=input_ids.device)
        return (running - torch.repeat_interleave(before, lens)) * not_pad + self.padding_idx


class XLMRobertaModel(RobertaModel):
    """XLM-RoBERTa is RoBERTa's network with another vocabulary."""

