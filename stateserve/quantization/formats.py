"""The weight formats a QuantLinear keeps, as plain tensors: llama.cpp's Q8_0, Q4_0, Q4_1, Q4_K and Q6_K, whatever
they came from (load-time quantization of a float checkpoint, or a GGUF file's own blocks).

Every field has the weight's rows first ([N, ...]), so the parts of a fused projection (q/k/v, gate/up) are joined
by concatenating their fields, and a permutation of rows (a GGUF file's interleaved rotary halves) applies to each
field alike. Values, in float32 and in gguf.quants' order of operations (so dequantizing gives a GGUF file's
values bit for bit):
  q8_0: codes int8 [N, K] * scales [N, B] (float16; the kernels' packing takes no other)
  q4_0: d [N, B] * (codes - 8), codes uint8 0..15
  q4_1: d [N, B] * codes + m [N, B]
  q4_k: (d [N, S] * sc [N, B]) * codes - dmin [N, S] * mn [N, B], sc and mn 6-bit, d and dmin float16
  q6_k: (d [N, S] * sc [N, K / 16]) * (codes - 32), codes uint8 0..63, sc int8, d float16 (every value exact)
Symbols: N rows (output features), K columns (input features), B = K / 32 blocks, S = K / 256 super-blocks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from stateserve.quantization import q8_0

FORMATS = ("q8_0", "q4_0", "q4_1", "q4_k", "q6_k")
FIELDS = {"q8_0": ("codes", "scales"), "q4_0": ("codes", "d"), "q4_1": ("codes", "d", "m"),
          "q4_k": ("codes", "d", "dmin", "sc", "mn"), "q6_k": ("codes", "sc", "d")}
BITS = {"q8_0": 8.5, "q4_0": 4.5, "q4_1": 5.0, "q4_k": 4.5, "q6_k": 6.5625}  # per weight, as llama.cpp stores them
SUPER_BLOCK = 256  # Q4_K's values per (d, dmin), Q6_K's per d
Q6_K_GROUP = 16  # Q6_K's values per sc


@dataclass(frozen=True)
class QuantizedWeight:
    fmt: str
    fields: dict[str, torch.Tensor]

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown weight format {self.fmt!r}; formats: {', '.join(FORMATS)}")
        if tuple(self.fields) != FIELDS[self.fmt]:
            raise ValueError(f"a {self.fmt} weight has fields {FIELDS[self.fmt]}, got {tuple(self.fields)}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.fields["codes"].shape)  # type: ignore[return-value]

    def dequantize(self) -> torch.Tensor:
        """W [N, K] float32, each value as gguf.quants computes it."""
        f, (n, k) = self.fields, self.shape
        if self.fmt == "q8_0":
            return q8_0.dequantize(f["codes"], f["scales"])
        if self.fmt == "q6_k":  # (d * sc) * (q - 32), as gguf.quants
            scale = f["d"].float().repeat_interleave(SUPER_BLOCK // Q6_K_GROUP, dim=1) * f["sc"].float()
            codes = f["codes"].to(torch.float32).reshape(n, k // Q6_K_GROUP, Q6_K_GROUP) - 32
            return (scale.unsqueeze(-1) * codes).reshape(n, k)
        codes = f["codes"].to(torch.float32).reshape(n, k // q8_0.BLOCK, q8_0.BLOCK)
        if self.fmt == "q4_0":
            values = f["d"].float().unsqueeze(-1) * (codes - 8)
        elif self.fmt == "q4_1":
            values = f["d"].float().unsqueeze(-1) * codes + f["m"].float().unsqueeze(-1)
        else:
            per = SUPER_BLOCK // q8_0.BLOCK
            scale = f["d"].float().repeat_interleave(per, dim=1) * f["sc"].float()
            offset = f["dmin"].float().repeat_interleave(per, dim=1) * f["mn"].float()
            values = scale.unsqueeze(-1) * codes - offset.unsqueeze(-1)
        return values.reshape(n, k)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedWeight:
        """The same row operation (a permutation, a narrowing) applied to every field."""
        return QuantizedWeight(self.fmt, {name: fn(t) for name, t in self.fields.items()})

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.fields.values())


def quantize(w: torch.Tensor, fmt: str) -> QuantizedWeight:
    """A float weight [N, K] in fmt, by llama.cpp's reference quantizer of that type."""
    if fmt == "q8_0":
        return QuantizedWeight(fmt, dict(zip(FIELDS[fmt], q8_0.quantize(w))))
    from stateserve.quantization import q4

    if fmt == "q4_0":
        return QuantizedWeight(fmt, dict(zip(FIELDS[fmt], q4.quantize_q4_0(w))))
    if fmt == "q4_k":
        return QuantizedWeight(fmt, dict(zip(FIELDS[fmt], q4.quantize_q4_k(w))))
    raise ValueError(f"no load-time quantizer for {fmt!r}; use q8_0, q4_0 or q4_k")


def fits(fmt: str, in_features: int) -> bool:
    """Whether a weight of in_features columns can be held in fmt."""
    return in_features % (SUPER_BLOCK if fmt in ("q4_k", "q6_k") else q8_0.BLOCK) == 0


def concat(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Parts of one format stacked along rows (a fused projection's q/k/v, gate/up)."""
    if len({p.fmt for p in parts}) != 1:
        raise ValueError(f"concat takes parts of one format, got {[p.fmt for p in parts]}")
    if len(parts) == 1:
        return parts[0]
    return QuantizedWeight(parts[0].fmt, {name: torch.cat([p.fields[name] for p in parts])
                                          for name in FIELDS[parts[0].fmt]})
