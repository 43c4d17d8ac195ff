"""QuantEmbedding: a token embedding kept in a GGUF file's block format (formats.py), its rows dequantized on
lookup. A GGUF file stores the embedding at the file's type (Q4_0 in a Q4_0 file); held in bfloat16 it would be the
largest tensor in memory (llama-base at Q4_0: 47 MiB of a 79 MiB file), so it stays as stored.

Lookup gathers the selected rows' fields and dequantizes them as formats.QuantizedWeight does (gguf.quants' float32
values bit for bit), then casts to the model dtype: the same values an nn.Embedding loaded from the file holds.
4-bit codes are held two to a byte (the fields keep one code per byte for the kernels' packing)."""
from __future__ import annotations

import torch
from torch import nn

from stateserve.quantization.formats import QuantizedWeight

_NIBBLE_FORMATS = ("q4_0", "q4_1", "q4_k")  # codes 0 .. 15


class QuantEmbedding(nn.Module):
    """ids [...] int -> [..., H] in `dtype`; weight [V, H] in a block format."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.fmt = weight.fmt
        self.num_embeddings, self.embedding_dim = weight.shape
        self.dtype = dtype
        self._names = list(weight.fields)
        for name, t in weight.fields.items():
            if name == "codes" and self.fmt in _NIBBLE_FORMATS:
                t = t[:, 0::2] | (t[:, 1::2] << 4)  # [V, H / 2]: even columns low, odd columns high
            self.register_buffer(f"field_{name}", t.contiguous(), persistent=False)

    @property
    def weight_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.fmt}"

    def rows(self, ids: torch.Tensor) -> QuantizedWeight:
        """The selected rows as a weight of their own (ids: 1-D)."""
        fields = {}
        for name in self._names:
            t = getattr(self, f"field_{name}").index_select(0, ids)
            if name == "codes" and self.fmt in _NIBBLE_FORMATS:
                t = torch.stack((t & 15, t >> 4), dim=-1).flatten(1)
            fields[name] = t
        return QuantizedWeight(self.fmt, fields)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(ids.reshape(-1)).dequantize().to(self.dtype).view(*ids.shape, self.embedding_dim)
