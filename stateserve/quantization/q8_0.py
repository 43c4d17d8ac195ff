"""llama.cpp's Q8_0 format: blocks of 32 values along K, each 32 int8 codes and one float16 scale d.

Quantizing follows ggml's reference (quantize_row_q8_0_ref) bit for bit, so codes can be compared with GGUF files:
d = amax / 127 in float32, codes = roundf(x * (1 / d)) (ties away from zero; 0 when d is 0), then d is stored as
float16. Activations are quantized by the same rule in the kernels' A8 mode; `fake_quantize` is that rounding in
PyTorch, for references.

Symbols: N output features (rows of W), K input features (a multiple of BLOCK), B = K / BLOCK blocks per row."""
from __future__ import annotations

import torch

BLOCK = 32


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """C's roundf on float32. floor(|v| + 0.5) is not it: for the largest float below 0.5 the sum rounds up to 1."""
    a = v.abs()
    whole = a.floor()
    return torch.copysign(whole + (a - whole >= 0.5).to(v.dtype), v)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype) -> (codes int8 [N, K], scales float16 [N, B])."""
    if w.dim() != 2 or w.shape[1] % BLOCK:
        raise ValueError(f"Q8_0 needs a 2-D weight whose last dimension is a multiple of {BLOCK}, got "
                         f"{tuple(w.shape)}")
    n, k = w.shape
    blocks = w.detach().to(torch.float32).reshape(n, k // BLOCK, BLOCK)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    codes = _round_half_away(blocks * inv).to(torch.int8).reshape(n, k)
    return codes, d.squeeze(-1).to(torch.float16)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(codes [N, K], scales [N, B]) -> W [N, K] in dtype (each value code * float(scale), exact in float32)."""
    n, k = codes.shape
    values = codes.reshape(n, k // BLOCK, BLOCK).to(torch.float32) * scales.to(torch.float32).unsqueeze(-1)
    return values.reshape(n, k).to(dtype)


def fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """What the A8 kernels compute with in place of activations x [..., K]: each block of 32 quantized as Q8_0 and
    dequantized again, as float32."""
    shape = x.shape
    codes, scales = quantize(x.reshape(-1, shape[-1]))
    return dequantize(codes, scales).reshape(shape)
