"""Load-time 4-bit quantizers that follow llama.cpp's reference code (ggml-quants.c) bit for bit, so codes match the
GGUF files llama.cpp's quantize tool writes: Q4_0 (quantize_row_q4_0_ref) and Q4_K (quantize_row_q4_K_ref with its
make_qkx2_quants search for each sub-block's scale and min).

Bit-exactness needs C's float32 arithmetic in C's order: every sum over a sub-block is accumulated one value at a
time (a loop over the 32 positions, each step a tensor over all sub-blocks; torch.sum adds pairwise), products are
not fused, `c / t` is one division (torch's is t.reciprocal() * c), sqrtf is taken in float64 (torch's vectorized
float32 sqrt is not always correctly rounded), and ggml's nearest_int (adding 1.5 * 2^23 and reading the low
mantissa bits) is reproduced on the float's bits, so it agrees even where its argument is out of range or NaN.
Checked on CPU tensors against the C code (tests/test_ggml_types.py).

Symbols: N rows, K values per row; Q4_0 blocks of 32 (B = K / 32); Q4_K super-blocks of 256 (S = K / 256) made of
8 sub-blocks of 32. L the 4-bit codes (0..15), sc/mn the 6-bit sub-block scales and mins, d/dmin the float16
super-block scales: w = (d*sc)*L - dmin*mn."""
from __future__ import annotations

import numpy as np
import torch

from stateserve.platform import kernels
from stateserve.quantization.ggml_types import q4_0_values, q4_k_values

QK4_0 = 32
QK_K = 256
_CHUNK = 1 << 13  # sub-blocks quantized at once: [32, chunk] float32 tensors of 1 MiB stay in cache


def _rows_of(w: torch.Tensor, block: int, name: str) -> torch.Tensor:
    if w.dim() != 2 or w.shape[1] % block:
        raise ValueError(f"{name} needs a 2-D weight whose last dimension is a multiple of {block}, got "
                         f"{tuple(w.shape)}")
    return w.detach().to(torch.float32)


def quantize_q4_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype, taken as float32) -> (codes uint8 [N, K] in 0..15, d float16 [N, K/32]);
    w ~ d * (codes - 8). ggml: max = the first value of largest magnitude (+0 for an all-zero block), d = max / -8,
    codes = min(15, (int8)(x * (1/d) + 8.5)) truncated toward zero."""
    x = _rows_of(w, QK4_0, "Q4_0")
    n, k = x.shape
    blocks = x.reshape(n, k // QK4_0, QK4_0)
    a = blocks.abs()
    amax = a.amax(dim=-1, keepdim=True)
    pos = torch.arange(QK4_0, device=x.device)
    first = torch.where(a == amax, pos, QK4_0).amin(dim=-1, keepdim=True).clamp(max=QK4_0 - 1)
    # C starts from max = 0.0 and replaces it only on a strictly larger |v|: -0.0 never becomes max
    mx = torch.where(amax > 0, blocks.gather(-1, first), torch.zeros_like(amax))
    d = mx / -8
    inv = torch.where(d != 0, _div(1.0, d), torch.zeros_like(d))
    codes = (blocks * inv + 8.5).trunc().clamp(max=15).to(torch.uint8)
    return codes.reshape(n, k), d.squeeze(-1).to(torch.float16)


def _div(num: float, t: torch.Tensor) -> torch.Tensor:
    """num / t as one float32 division (torch's `num / t` is t.reciprocal() * num: two roundings)."""
    return torch.div(torch.tensor(num, dtype=t.dtype, device=t.device), t)


def _over(t: torch.Tensor, den: float) -> torch.Tensor:
    """t / den as a true division on every device (CUDA may multiply by the reciprocal of a scalar divisor)."""
    return torch.div(t, torch.full_like(t, den))


def _nearest_int(v: torch.Tensor) -> torch.Tensor:
    """ggml's nearest_int: round half to even for |v| < 2^22 via the 1.5 * 2^23 magic number (int32)."""
    return ((v + 12582912.0).view(torch.int32) & 0x007FFFFF) - 0x00400000


def _seq_sum(t: torch.Tensor) -> torch.Tensor:
    """t [32, M] -> [M]: t[0] + t[1] + ... + t[31], in that order (C's loop)."""
    acc = t[0].clone()
    for i in range(1, t.shape[0]):
        acc += t[i]
    return acc


def _make_qkx2_quants(x: torch.Tensor, w: torch.Tensor, nmax: int = 15, rmin: float = -1.0, rdelta: float = 0.1,
                      nstep: int = 20) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ggml's make_qkx2_quants(32, nmax, x, weights, L, &min, Laux, rmin, rdelta, nstep, use_mad=false) for every
    sub-block at once. x, w: [32, M] (position, sub-block) -> (L float32 [32, M], scale [M], the_min [M] = -min).
    Fits x ~ scale * L + min (min <= 0) by weighted least squares on the codes of 1 + nstep candidate scales."""
    sum_w, sum_x = _seq_sum(w), _seq_sum(w * x)
    lo, hi = x[0], x[0]  # C's "if (x[i] < min) min = x[i]" from x[0]: a NaN after x[0] is skipped (amin takes it)
    for i in range(1, x.shape[0]):
        lo = torch.where(x[i] < lo, x[i], lo)
        hi = torch.where(x[i] > hi, x[i], hi)
    lo = torch.where(lo > 0, torch.zeros_like(lo), lo)  # then "if (min > 0) min = 0"
    flat = hi == lo
    f32 = np.float32

    def codes(iscale: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
        return _nearest_int(iscale * (x - mn)).clamp(0, nmax).to(torch.float32)

    mn = lo
    iscale = _div(nmax, hi - mn)
    scale = _div(1.0, iscale)
    L = codes(iscale, mn)
    diff = scale * L + mn - x
    best = _seq_sum(w * (diff * diff))
    for step in range(nstep + 1):
        # C reads the running min here: once a candidate wins, the next ones quantize x - that min
        iscale = _div(float(f32(f32(rmin) + f32(rdelta) * f32(step)) + f32(nmax)), hi - mn)
        laux = codes(iscale, mn)
        wl = w * laux
        sum_l, sum_l2, sum_xl = _seq_sum(wl), _seq_sum(wl * laux), _seq_sum(wl * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        positive = this_min > 0
        this_min = torch.where(positive, torch.zeros_like(this_min), this_min)
        this_scale = torch.where(positive, sum_xl / sum_l2, this_scale)
        diff = this_scale * laux + this_min - x
        cur = _seq_sum(w * (diff * diff))
        better = (det > 0) & (cur < best)
        L = torch.where(better, laux, L)
        best = torch.where(better, cur, best)
        scale = torch.where(better, this_scale, scale)
        mn = torch.where(better, this_min, mn)
    L = torch.where(flat, torch.zeros_like(L), L)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    mn = torch.where(flat, lo, mn)
    return L, scale, -mn


def _running_max(v: torch.Tensor) -> torch.Tensor:
    """v [M, 8] -> [M]: C's "if (v > m) m = v" from m = 0 (skips NaN, never below 0)."""
    m = torch.zeros_like(v[:, 0])
    for j in range(v.shape[1]):
        m = torch.where(v[:, j] > m, v[:, j], m)
    return m


def _quantize_q4_k_chunk(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x [M * 8, 32] (M super-blocks' sub-blocks) -> (L uint8 [M*8, 32], d f16 [M], dmin f16 [M], sc, mn [M, 8])."""
    xt = x.t().contiguous()  # [32, sub-blocks]: each C loop position is one contiguous row
    # sqrtf is correctly rounded; torch's vectorized float32 sqrt is not always (float64 then rounding is)
    av_x = torch.sqrt((_seq_sum(xt * xt) / 32).double()).float()
    L, scales, mins = _make_qkx2_quants(xt, av_x + xt.abs())
    L = L.t()
    scales, mins = scales.reshape(-1, 8), mins.reshape(-1, 8)
    max_scale, max_min = _running_max(scales), _running_max(mins)
    zero = torch.zeros_like(max_scale)
    inv_scale = torch.where(max_scale > 0, _div(63.0, max_scale), zero).unsqueeze(-1)
    inv_min = torch.where(max_min > 0, _div(63.0, max_min), zero).unsqueeze(-1)
    # C stores nearest_int into a uint8 (mod 256), then takes MIN(63, .)
    sc = (_nearest_int(inv_scale * scales) & 0xFF).clamp(max=63).to(torch.uint8)
    mn = (_nearest_int(inv_min * mins) & 0xFF).clamp(max=63).to(torch.uint8)
    d16, dmin16 = _over(max_scale, 63.0).to(torch.float16), _over(max_min, 63.0).to(torch.float16)
    # the final codes use the stored (float16, 6-bit) scales; a sub-block whose d is 0 keeps make_qkx2_quants' codes
    d = (d16.to(torch.float32).unsqueeze(-1) * sc.to(torch.float32)).reshape(-1, 1)
    dm = (dmin16.to(torch.float32).unsqueeze(-1) * mn.to(torch.float32)).reshape(-1, 1)
    requant = _nearest_int((x + dm) / d).clamp(0, 15).to(torch.float32)
    L = torch.where(d != 0, requant, L)
    return L.to(torch.uint8), d16, dmin16, sc, mn


def quantize_q4_k(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """w [N, K] (K a multiple of 256; any float dtype, taken as float32) -> (codes uint8 [N, K] in 0..15, d float16
    [N, K/256], dmin float16 [N, K/256], sc uint8 [N, K/32], mn uint8 [N, K/32]); w ~ (d*sc)*codes - dmin*mn.
    ggml's quantize_row_q4_K_ref: each sub-block's scale and min from make_qkx2_quants with weights
    sqrt(mean(x^2)) + |x|, quantized to 6 bits against the super-block's largest (d = max_scale/63,
    dmin = max_min/63 in float16), then every value coded again with those stored scales. On the CPU with the C++
    kernels this runs in csrc/quant_q4k_quantize.cpp, else in the PyTorch code below (the fallback, and the path of
    other devices); both are checked against llama.cpp's C (tests/test_ggml_types.py)."""
    x = _rows_of(w, QK_K, "Q4_K")
    kernel = kernels.table(x.device).quantize_q4_k(x.dtype)
    if kernel is not None:  # csrc/quant_q4k_quantize.cpp: the same arithmetic, SIMD lanes = sub-blocks
        return tuple(kernel(x.contiguous()))
    n, k = x.shape
    sub = x.reshape(-1, 32)
    parts = [_quantize_q4_k_chunk(sub[i:i + _CHUNK]) for i in range(0, sub.shape[0], _CHUNK)]
    codes, d, dmin, sc, mn = (torch.cat(p) for p in zip(*parts))
    return (codes.reshape(n, k), d.reshape(n, k // QK_K), dmin.reshape(n, k // QK_K), sc.reshape(n, k // 32),
            mn.reshape(n, k // 32))


# ---- ggml bytes and values -------------------------------------------------------------------------------------
def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float16).contiguous().view(torch.uint8).reshape(*v.shape, 2)


def pack_q4_0(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """(codes [N, K], d [N, K/32]) -> ggml's Q4_0 bytes uint8 [N, K/32 * 18]: d, then 16 bytes, byte j holding
    code j (low nibble) and code j + 16 (high)."""
    n, k = codes.shape
    c = codes.to(torch.uint8).reshape(n, k // 32, 2, 16)
    return torch.cat((_f16_bytes(d), c[:, :, 0] | (c[:, :, 1] << 4)), dim=-1).reshape(n, -1)


def pack_q4_k(codes: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor,
              mn: torch.Tensor) -> torch.Tensor:
    """Q4_K fields -> ggml's bytes uint8 [N, K/256 * 144]: d, dmin, 12 scale bytes (sub-blocks 0-3 in the low 6 bits
    of bytes 0-3 (sc) and 4-7 (mn), 4-7 in bytes 8-11's nibbles with their top 2 bits in bytes 0-7's), 128 code
    bytes (32 bytes per 64 values: the first 32 in low nibbles)."""
    n, k = codes.shape
    sc, mn = sc.to(torch.uint8).reshape(n, k // QK_K, 8), mn.to(torch.uint8).reshape(n, k // QK_K, 8)
    scales = torch.cat(((sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6), (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6),
                        (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)), dim=-1)
    c = codes.to(torch.uint8).reshape(n, k // QK_K, 4, 2, 32)
    qs = (c[..., 0, :] | (c[..., 1, :] << 4)).reshape(n, k // QK_K, 128)
    return torch.cat((_f16_bytes(d), _f16_bytes(dmin), scales, qs), dim=-1).reshape(n, -1)


def dequantize_q4_0(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Q4_0 fields -> float32 [N, K]: d * (codes - 8), as ggml and gguf compute it."""
    return q4_0_values(codes, d)


def dequantize_q4_k(codes: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor,
                    mn: torch.Tensor) -> torch.Tensor:
    """Q4_K fields -> float32 [N, K]: (d*sc) * codes - dmin*mn, as ggml and gguf compute it."""
    return q4_k_values(codes, d, dmin, sc, mn)
