"""GGUF tensor types (llama.cpp's ggml block formats) decoded in PyTorch: `dequantize` gives float32 values bit for
bit equal to gguf.quants.dequantize, and the `*_fields` functions give the codes and scales of the formats that stay
quantized, as plain tensors (rows along N, blocks along K) for the kernels' packing (q4_0, q4_1, q4_k, q6_k and
int8 for Q8_0, Q5_0, IQ4_NL and IQ4_XS).

Raw data is the file's bytes, one row of N per line (uint8 [N, row_bytes], numpy or torch; any dtype is read as its
bytes, so gguf's float16 views of F16 tensors do too). Values are computed in float32 in gguf's order, e.g. Q4_K as
(d*sc)*q - dmin*m. The order cannot change a result here: a float16 scale (11 significant bits) times integers of
at most 13 bits is exact in float32, so every type is exact but for one rounding, the final addition of Q4_1, Q4_K
and Q5_K (a fused multiply-add rounds the same exact value once too).

Symbols: N rows (output features), K values per row (input features), d/dmin float16 block scales, sc/mn 6-bit
sub-block scales and mins, ls IQ4_XS' 6-bit sub-block scales (used as ls - 32), kvalues IQ4's 16 levels."""
from __future__ import annotations

import math
import warnings
from typing import Any, Sequence

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

TAKEN = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
INT8_TYPES = ("Q8_0", "Q5_0", "IQ4_NL", "IQ4_XS")  # exactly int8 codes times one float32 scale per 32 values
QK_K = 256  # values per K-quant (and IQ4_XS) super-block
IQ4_KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def type_name(type: Any) -> str:
    """A GGMLQuantizationType, its name or its number -> its name."""
    if isinstance(type, str):
        return type
    return GGMLQuantizationType(int(type)).name


def check_type(type: Any, tensor_name: str) -> None:
    """Raises ValueError for a tensor type not in TAKEN, the message starting with tensor_name."""
    name = type_name(type)
    if name not in TAKEN:
        raise ValueError(f"{tensor_name}: GGUF type {name} is not supported; supported types: {', '.join(TAKEN)}")


def _blocks(raw: Any, name: str, shape: Sequence[int]) -> torch.Tensor:
    """The raw bytes as uint8 [R, B, type_size]: R rows of shape[-1] values, B blocks per row."""
    if isinstance(raw, np.ndarray):
        with warnings.catch_warnings():  # a read-only memmap: nothing here writes to it
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1).view(np.uint8))
    raw = raw.contiguous().reshape(-1).view(torch.uint8)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    k = int(shape[-1])
    if k % block:
        raise ValueError(f"{name} rows hold whole blocks of {block} values, got {k} values per row")
    rows = math.prod(int(s) for s in shape[:-1])
    if raw.numel() != rows * (k // block) * size:
        raise ValueError(f"{name} tensor of shape {tuple(shape)} needs {rows * (k // block) * size} bytes, got "
                         f"{raw.numel()}")
    return raw.reshape(rows, k // block, size)


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The little-endian float16 at byte `at` of every block: [R, B]."""
    return blocks[..., at:at + 2].contiguous().view(torch.float16).squeeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n] values: the n low nibbles, then the n high ones (ggml's order within a group)."""
    return torch.cat((qs & 15, qs >> 4), dim=-1)


def _bits(b: torch.Tensor, width: int) -> torch.Tensor:
    """[..., n] bytes -> [..., n, 8 // width] fields of `width` bits, lowest first."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=b.device)
    return (b.unsqueeze(-1) >> shifts) & ((1 << width) - 1)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1)


def _kvalues(idx: torch.Tensor) -> torch.Tensor:
    """4-bit indices (uint8) -> IQ4's int8 levels; int32 indices, a quarter of int64's memory."""
    table = torch.tensor(IQ4_KVALUES, dtype=torch.int8, device=idx.device)
    return table.index_select(0, idx.reshape(-1).to(torch.int32)).reshape(idx.shape)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes [..., 12] -> (sc, mn) [..., 8], 6 bits each (ggml's get_scale_min_k4): sub-blocks
    0-3 in the low 6 bits of bytes 0-3 / 4-7, sub-blocks 4-7 in the nibbles of bytes 8-11 plus those bytes' top 2."""
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat((a & 63, (c & 15) | ((a >> 6) << 4)), dim=-1)
    mn = torch.cat((b & 63, (c >> 4) | ((b >> 6) << 4)), dim=-1)
    return sc, mn


def _per(values: torch.Tensor, group: int) -> torch.Tensor:
    """[R, K] -> [R, K / group, group], to broadcast one scale [R, K / group, 1] per group."""
    return values.reshape(values.shape[0], -1, group)


# ---- fields ------------------------------------------------------------------------------------------------------
def q4_0_fields(raw: Any, shape: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 (18-byte blocks: d, 16 bytes of nibbles) -> (codes uint8 [N, K] in 0..15, d float16 [N, K/32]);
    w = d * (codes - 8)."""
    b = _blocks(raw, "Q4_0", shape)
    return _rows(_nibbles(b[..., 2:])), _f16(b, 0)


def q4_1_fields(raw: Any, shape: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 (20-byte blocks: d, m, nibbles) -> (codes uint8 [N, K] in 0..15, d, m float16 [N, K/32]);
    w = d * codes + m."""
    b = _blocks(raw, "Q4_1", shape)
    return _rows(_nibbles(b[..., 4:])), _f16(b, 0), _f16(b, 2)


def q4_k_fields(raw: Any, shape: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """Q4_K (144-byte super-blocks of 256: d, dmin, 12 scale bytes, 128 bytes of nibbles, each 32 bytes holding
    sub-blocks 2c (low) and 2c+1 (high)) -> (codes uint8 [N, K] in 0..15, d float16 [N, K/256], dmin float16
    [N, K/256], sc uint8 [N, K/32] in 0..63, mn uint8 [N, K/32] in 0..63); w = (d*sc) * codes - dmin*mn."""
    b = _blocks(raw, "Q4_K", shape)
    sc, mn = _k_scales(b[..., 4:16])
    codes = _nibbles(b[..., 16:].unflatten(-1, (4, 32)))
    return _rows(codes), _f16(b, 0), _f16(b, 2), _rows(sc), _rows(mn)


def _q5_k_fields(raw: Any, shape: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """Q5_K (176 bytes: d, dmin, scales as Q4_K, 32 bytes qh whose bit j is sub-block j's 5th bit, 128 bytes as
    Q4_K) -> (codes 0..31, d, dmin, sc, mn) as q4_k_fields; w = (d*sc) * codes - dmin*mn."""
    b = _blocks(raw, "Q5_K", shape)
    sc, mn = _k_scales(b[..., 4:16])
    low = _nibbles(b[..., 48:].unflatten(-1, (4, 32))).flatten(-2)
    high = _bits(b[..., 16:48], 1).transpose(-1, -2).flatten(-2)  # [R, B, 8 sub-blocks, 32] -> 256
    return _rows(low | (high << 4)), _f16(b, 0), _f16(b, 2), _rows(sc), _rows(mn)


def q6_k_fields(raw: Any, shape: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q6_K (210 bytes: 128 bytes low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, d) -> (codes uint8 [N, K] in
    0..63, sc int8 [N, K/16], d float16 [N, K/256]); w = (d*sc) * (codes - 32). Per half of 128 values: low nibbles
    of 64 bytes then their high nibbles; 2-bit fields of 32 bytes at shifts 0, 2, 4, 6 for quarters 0-3."""
    b = _blocks(raw, "Q6_K", shape)
    low = _nibbles(b[..., :128].unflatten(-1, (2, 64))).flatten(-2)
    high = _bits(b[..., 128:192].unflatten(-1, (2, 32)), 2).transpose(-1, -2).flatten(-3)
    return _rows(low | (high << 4)), _rows(b[..., 192:208].contiguous().view(torch.int8)), _f16(b, 208)


def int8_fields(raw: Any, type: Any, shape: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0, Q5_0, IQ4_NL, IQ4_XS -> (codes int8 [N, K], scales float32 [N, K/32]); w = codes * scale exactly as
    gguf computes it (one float32 product):
    Q8_0: codes q, scale d.  Q5_0: codes q - 16 (4 low bits as Q4_0, 5th bit j of the uint32 qh), scale d.
    IQ4_NL: codes kvalues[q], scale d.  IQ4_XS: codes kvalues[q], scale d * (ls - 32), which float32 holds
    exactly (11 by 6 significant bits)."""
    name = type_name(type)
    if name not in INT8_TYPES:
        raise ValueError(f"int8_fields takes {', '.join(INT8_TYPES)}, got {name}")
    b = _blocks(raw, name, shape)
    if name == "Q8_0":
        return _rows(b[..., 2:].contiguous().view(torch.int8)), _f16(b, 0).float()
    if name == "Q5_0":
        high = _bits(b[..., 2:6], 1).flatten(-2)  # bit j of the little-endian uint32: byte j // 8, bit j % 8
        return _rows((_nibbles(b[..., 6:]) | (high << 4)).to(torch.int8) - 16), _f16(b, 0).float()
    if name == "IQ4_NL":
        return _rows(_kvalues(_nibbles(b[..., 2:]))), _f16(b, 0).float()
    ls = _bits(b[..., 4:8], 4).flatten(-2) | (_bits(b[..., 2:4], 2).flatten(-2) << 4)  # [R, B, 8] in 0..63
    scales = _f16(b, 0).float().unsqueeze(-1) * (ls.to(torch.float32) - 32)
    codes = _kvalues(_nibbles(b[..., 8:].unflatten(-1, (8, 16))))
    return _rows(codes), _rows(scales)


# ---- values (in place on one float32 copy of the codes: the peak is the output, not three of its size) ------------
def _scaled(codes: torch.Tensor, group: int, scale: torch.Tensor) -> torch.Tensor:
    """float(codes) [N, K] with each group of values times its scale [N, K / group], as [N, K / group, group]."""
    return _per(codes.to(torch.float32, copy=True), group).mul_(scale.to(torch.float32).unsqueeze(-1))


def q4_0_values(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """d * (codes - 8) in float32, [N, K]."""
    return _per(codes.to(torch.float32, copy=True), 32).sub_(8).mul_(d.to(torch.float32).unsqueeze(-1)).flatten(1)


def q4_1_values(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """d * codes + m in float32, [N, K]."""
    return _scaled(codes, 32, d).add_(m.to(torch.float32).unsqueeze(-1)).flatten(1)


def q4_k_values(codes: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor,
                mn: torch.Tensor) -> torch.Tensor:
    """(d*sc) * codes - dmin*mn in float32, [N, K] (Q4_K and Q5_K)."""
    scale = _scaled(sc, 8, d).flatten(1)  # d*sc and dmin*mn are exact in float32 (11 by 6 significant bits)
    low = _scaled(mn, 8, dmin).flatten(1)
    return _scaled(codes, 32, scale).sub_(low.unsqueeze(-1)).flatten(1)


def int8_values(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes * scale in float32, [N, K]."""
    return _scaled(codes, 32, scales).flatten(1)


def q6_k_values(codes: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """(d*sc) * (codes - 32) in float32, [N, K]: every value exact (11, 7 and 5 significant bits at most)."""
    scale = _scaled(sc, 16, d).flatten(1)
    return _per(codes.to(torch.float32, copy=True), 16).sub_(32).mul_(scale.unsqueeze(-1)).flatten(1)


def dequantize(raw: Any, type: Any, shape: Sequence[int]) -> torch.Tensor:
    """Raw GGUF bytes of a TAKEN type -> float32 tensor of `shape`, equal bit for bit to gguf.quants.dequantize."""
    name = type_name(type)
    check_type(name, "<dequantize>")
    b = _blocks(raw, name, shape)
    if name == "F32":
        out = b.view(torch.float32)
    elif name == "F16":
        out = b.view(torch.float16).to(torch.float32)
    elif name == "BF16":  # the 16 bits are a float32's top half
        out = (b.view(torch.int16).to(torch.int32) << 16).view(torch.float32)
    elif name == "Q4_0":
        out = q4_0_values(*q4_0_fields(b, shape))
    elif name == "Q4_1":
        out = q4_1_values(*q4_1_fields(b, shape))
    elif name == "Q4_K":
        out = q4_k_values(*q4_k_fields(b, shape))
    elif name == "Q5_K":
        out = q4_k_values(*_q5_k_fields(b, shape))
    elif name == "Q6_K":
        out = q6_k_values(*q6_k_fields(b, shape))
    else:
        out = int8_values(*int8_fields(b, name, shape))
    return out.reshape(tuple(int(s) for s in shape))
