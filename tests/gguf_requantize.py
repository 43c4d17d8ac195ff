"""A GGUF file rewritten with other tensor types, as llama.cpp's llama-quantize would write it (which CI does not
have: the tests get the converter's float32 file and rewrite it here). Q4_0, Q4_1, Q5_0 and Q8_0 come from gguf's
quantizers, Q4_K from
ours (tests/test_ggml_types.py holds it equal to llama.cpp's C reference bit for bit); Q6_K, which neither
quantizes, is written from random blocks with moderate scales, so that a file holds one (its values are whatever
those blocks dequantize to, which the reference model then holds too)."""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize as gguf_quantize

from stateserve.quantization import q4


def _q6_k_blocks(rows: int, cols: int, seed: int) -> np.ndarray:
    """Random Q6_K rows: 210 bytes per 256 values (ql 128, qh 64, int8 scales 16, float16 d)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // 256, 210), dtype=np.uint8)
    blocks[..., 192:208] = rng.integers(-20, 21, size=(rows, cols // 256, 16)).astype(np.int8).view(np.uint8)
    blocks[..., 208:210] = np.full((rows, cols // 256, 1), 2e-3, np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def _encode(values: np.ndarray, kind: str, seed: int) -> tuple[np.ndarray, GGMLQuantizationType]:
    """values [N, K] float32 -> (the raw rows, their type)."""
    if kind == "Q4_0":
        return gguf_quantize(values, GGMLQuantizationType.Q4_0), GGMLQuantizationType.Q4_0
    if kind == "Q4_K":
        return q4.pack_q4_k(*q4.quantize_q4_k(torch.from_numpy(values.copy()))).numpy(), GGMLQuantizationType.Q4_K
    if kind in ("Q8_0", "Q4_1", "Q5_0"):
        qtype = GGMLQuantizationType[kind]
        return gguf_quantize(values, qtype), qtype
    if kind == "Q6_K":
        return _q6_k_blocks(*values.shape, seed), GGMLQuantizationType.Q6_K
    raise ValueError(kind)


def requantize(src: str, dst: str, type_of: Callable[[str, tuple[int, int]], str | None]) -> None:
    """dst: src's metadata and tensors, each 2-D float tensor written in type_of(name, (N, K)) (None: as it is)."""
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub)
    for i, t in enumerate(reader.tensors):
        shape = tuple(int(n) for n in reversed(t.shape))
        kind = type_of(t.name, shape) if len(shape) == 2 and t.tensor_type.name == "F32" else None
        if kind is None:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
            continue
        raw, qtype = _encode(np.asarray(t.data, dtype=np.float32).reshape(shape), kind, seed=i)
        writer.add_tensor(t.name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
