"""xLSTM (the 7B "xLSTM Large" architecture of transformers' xLSTMForCausalLM): a stack of mLSTM blocks, attention
free, each with a matrix-memory state per sequence (layers/mlstm.py).

Per block: x += mlstm_layer(norm_mlstm(x)); x += ffn(norm_ffn(x)); then out_norm and the LM head, whose logits are
soft-capped (output_logit_soft_cap). The mLSTM layer: q, k (hidden * qk_dim_factor), v and the output gate
(hidden * v_dim_factor), per-head input and forget gate pre-activations (soft-capped at gate_soft_cap), the cell,
a per-head layer norm of h (weight, no centring bias unless use_bias), sigmoid(output gate) * it, out_proj. The
norms are RMS norms in float32 (norm_reduction_force_float32); the FFN is silu(up_gate) * up -> down at
hidden * ffn_proj_factor rounded up to ffn_round_up_to_multiple_of. Only weight_mode "single" (transformers'
default; separate projections) is supported."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stateserve.layers.metadata import ForwardMeta
from stateserve.layers.mlstm import MLSTMCell, soft_cap
from stateserve.models.base import ModelBase

_ARCH = "xLSTMForCausalLM"


class XRMSNorm(nn.Module):
    """RMS norm in float32, rounded to x's dtype, then * weight (+ bias): transformers' xLSTMRMSNorm."""

    def __init__(self, dim: int, eps: float, bias: bool) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight
        return y if self.bias is None else y + self.bias


class MultiHeadLayerNorm(nn.Module):
    """Layer norm over each head's dv values (float32), then one weight (+ bias) over all heads."""

    def __init__(self, num_heads: int, head_dim: int, eps: float, bias: bool) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(num_heads * head_dim))
        self.bias = nn.Parameter(torch.zeros(num_heads * head_dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H, dv] -> [T, H * dv]
        xf = x.float()
        y = (xf - xf.mean(-1, keepdim=True)) * torch.rsqrt(xf.var(-1, keepdim=True, unbiased=False) + self.eps)
        y = y.to(x.dtype).flatten(1) * self.weight
        return y if self.bias is None else y + self.bias


class MLSTMLayer(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        h, bias, H = cfg.hidden_size, bool(cfg.use_bias), int(cfg.num_heads)
        qk_dim, v_dim = int(h * cfg.qk_dim_factor), int(h * cfg.v_dim_factor)
        if qk_dim % H or v_dim % H:
            raise ValueError(f"{_ARCH}: qk dim {qk_dim} and v dim {v_dim} must be multiples of num_heads={H}")
        self.num_heads, self.gate_cap = H, cfg.gate_soft_cap
        self.q = nn.Linear(h, qk_dim, bias=bias)
        self.k = nn.Linear(h, qk_dim, bias=bias)
        self.v = nn.Linear(h, v_dim, bias=bias)
        self.ogate_preact = nn.Linear(h, v_dim, bias=bias)
        self.igate_preact = nn.Linear(h, H, bias=True)
        self.fgate_preact = nn.Linear(h, H, bias=True)
        self.cell = MLSTMCell(H, qk_dim // H, v_dim // H, float(cfg.eps))
        self.multihead_norm = MultiHeadLayerNorm(H, v_dim // H, cfg.norm_eps, bias)
        self.out_proj = nn.Linear(v_dim, h, bias=bias)

    def forward(self, x: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        T, H = x.shape[0], self.num_heads
        q, k, v = self.q(x).view(T, H, -1), self.k(x).view(T, H, -1), self.v(x).view(T, H, -1)
        i = soft_cap(self.igate_preact(x), self.gate_cap)  # [T, H]
        f = soft_cap(self.fgate_preact(x), self.gate_cap)
        h = self.cell(q, k, v, i, f, meta.state)  # [T, H, dv]
        return self.out_proj(torch.sigmoid(self.ogate_preact(x)) * self.multihead_norm(h))


class XFeedForward(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        multiple = int(cfg.ffn_round_up_to_multiple_of)
        # transformers' round_up_to_next_multiple_of on a float: floor((x + m - 1) / m) * m, kept as it is
        width = int(((cfg.hidden_size * cfg.ffn_proj_factor + multiple - 1) // multiple) * multiple)
        bias = bool(cfg.use_bias)
        self.proj_up_gate = nn.Linear(cfg.hidden_size, width, bias=bias)
        self.proj_up = nn.Linear(cfg.hidden_size, width, bias=bias)
        self.proj_down = nn.Linear(width, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj_down(F.silu(self.proj_up_gate(x)) * self.proj_up(x))


class XLSTMBlock(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        bias = bool(cfg.use_bias)
        self.norm_mlstm = XRMSNorm(cfg.hidden_size, cfg.norm_eps, bias)
        self.mlstm_layer = MLSTMLayer(cfg)
        self.norm_ffn = XRMSNorm(cfg.hidden_size, cfg.norm_eps, bias)
        self.ffn = XFeedForward(cfg)

    def forward(self, x: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        x = x + self.mlstm_layer(self.norm_mlstm(x), meta)
        return x + self.ffn(self.norm_ffn(x))


class XLSTMBackbone(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList([XLSTMBlock(cfg) for _ in range(cfg.num_hidden_layers)])
        self.out_norm = XRMSNorm(cfg.hidden_size, cfg.norm_eps, False)


class XLSTMForCausalLM(ModelBase):
    is_attention_free = True

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__(hf_config)
        cfg = hf_config
        mode = getattr(cfg, "weight_mode", "single")
        if mode != "single":
            raise ValueError(f"{_ARCH}: weight_mode {mode!r} is not supported (only 'single': separate q/k/v/gate "
                             f"projections)")
        if getattr(cfg, "embedding_dim", cfg.hidden_size) != cfg.hidden_size:
            raise ValueError(f"{_ARCH}: embedding_dim={cfg.embedding_dim} differs from hidden_size="
                             f"{cfg.hidden_size}, which is not supported")
        state_dtype = getattr(cfg, "inference_state_dtype", "float32")
        if state_dtype != "float32":
            raise ValueError(f"{_ARCH}: inference_state_dtype {state_dtype!r} is not supported (the mLSTM state "
                             f"is kept in float32)")
        self.backbone = XLSTMBackbone(cfg)
        self.add_lm_head(cfg, embed_param="backbone.embeddings.weight")
        self.soft_cap = getattr(cfg, "output_logit_soft_cap", None)

    @classmethod
    def max_positions(cls, hf_config: Any) -> int | None:
        return None  # a recurrent model: no position limit

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        x = self.backbone.embeddings(input_ids)  # [T, hidden]
        for block in self.backbone.blocks:
            x = block(x, meta)
        return self.backbone.out_norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return soft_cap(self.lm_head(hidden), self.soft_cap)

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        return name, None
