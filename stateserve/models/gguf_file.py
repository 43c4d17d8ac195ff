"""GGUF files (llama.cpp's format) as checkpoints: the file's metadata becomes a transformers config of the same
model, its tensors the checkpoint's tensors under Hugging Face names, so every model loads a GGUF file through the
same `map_weight_name` as a folder. This module reads the file; what each architecture's converter wrote
(names, layer layout) is gguf_archs.py's, the config gguf_configs.py's.

What the converter (llama.cpp's convert_hf_to_gguf.py) changed is undone here: q/k rows interleaved per head are put
back in rotate-half order, Mamba's A (stored as -exp(A_log)) becomes A_log again, squeezed conv1d weights get their
middle axis back, the Mamba2 layout's A, D and grouped norm are flattened, stacked experts [E, N, K] are split per
expert (or kept whole where the model's checkpoint stacks them), gate and up halves are joined again. Float tensors
come out as float32 (the stored values exactly); a block-quantized 2-D weight comes out as a GGUFTensor, which a
linear layer keeps in its own format (quantization/formats.py) and any other parameter dequantizes; stacked experts
are dequantized.

Architectures: llama (with Llama 3.1 rope scaling), mamba, mamba2, jamba, falcon-h1, nemotron_h, nemotron_h_moe,
granitehybrid (Bamba or GraniteMoeHybrid). Tensor types: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K,
IQ4_NL, IQ4_XS (quantization/ggml_types.py); a file with any other type is refused, naming it."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch

from stateserve.quantization.formats import QuantizedWeight

from stateserve.models.gguf_archs import ARCHITECTURES

_FLOAT_TYPES = ("F32", "F16", "BF16")
_REWRITTEN = ("ssm_a", "ssm_d", "ssm_conv1d", "ssm_norm")  # undone on float values (_undo_conversion)


def is_gguf(path: str) -> bool:
    return path.endswith(".gguf") and os.path.isfile(path)


@dataclass(frozen=True)
class GGUFTensor:
    """A block-quantized 2-D weight of a GGUF file, converted when the loader knows where it goes: kept in its own
    format by a linear layer (to_quantized), or dequantized for any other parameter (to_float)."""
    name: str
    raw: np.ndarray  # uint8 [N, bytes per row]
    type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, int]  # [N, K]
    rows: Callable[[torch.Tensor], torch.Tensor]  # undoes the converter's reordering of rows

    def to_float(self) -> torch.Tensor:
        from stateserve.quantization import ggml_types

        return self.rows(ggml_types.dequantize(self.raw, self.type, self.shape))

    def to_quantized(self) -> QuantizedWeight:
        """The blocks in our formats: Q4_0, Q4_1, Q4_K, Q6_K as they are; Q8_0, Q5_0 and IQ4_NL exactly as int8 codes
        with a float16 scale per 32; Q5_K and IQ4_XS (whose scales d * (ls - 32) float16 does not hold) quantized
        again as Q8_0 from their values."""
        from stateserve.quantization import formats, ggml_types

        kind = self.type.name
        if kind in ("Q4_0", "Q4_1", "Q4_K", "Q6_K"):
            fields = getattr(ggml_types, f"{kind.lower()}_fields")(self.raw, self.shape)
            weight = QuantizedWeight(kind.lower(), dict(zip(formats.FIELDS[kind.lower()], fields)))
        elif kind in ("Q8_0", "Q5_0", "IQ4_NL"):  # float16 holds their scales exactly
            codes, scales = ggml_types.int8_fields(self.raw, self.type, self.shape)
            weight = QuantizedWeight("q8_0", {"codes": codes, "scales": scales.half()})
        else:
            return formats.quantize(self.to_float(), "q8_0")
        return weight.map_rows(self.rows)


@dataclass
class GGUFCheckpoint:
    path: str
    arch: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    _reader: Any = None
    _table: Any = None  # gguf_archs.Names of the file's architecture

    def __post_init__(self) -> None:
        from gguf import GGUFReader

        try:
            self._reader = GGUFReader(self.path, "r")
        except Exception as e:  # not a GGUF file, or a damaged one
            raise ValueError(f"{self.path} could not be read as a GGUF file: {e}") from e
        for name, f in self._reader.fields.items():
            if name.startswith("tokenizer.ggml.") and name not in ("tokenizer.ggml.bos_token_id",
                                                                   "tokenizer.ggml.eos_token_id"):
                continue  # the vocabulary: read by the tokenizer, not here
            try:
                self.meta[name] = f.contents()
            except Exception:
                continue
        self.arch = self.meta.get("general.architecture", "")
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"{self.path}: GGUF architecture {self.arch!r} is not supported here; supported: "
                             f"{', '.join(ARCHITECTURES)}")
        self.tensors = {t.name: t for t in self._reader.tensors}
        from stateserve.quantization import ggml_types

        for t in self._reader.tensors:
            ggml_types.check_type(t.tensor_type, f"{self.path}: tensor {t.name}")

    def _get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(f"{self.arch}.{key}", default)

    def _has(self, name: str) -> bool:
        return name in self.tensors

    # ---- config ------------------------------------------------------------------------------------
    def hf_config(self) -> Any:
        """The transformers config of the model in the file; its dtype (what dtype="auto" picks) is the linears'
        float type, or bfloat16 for a quantized file."""
        config = self._config()
        fmt = self.linear_format()
        config.dtype = {"F32": "float32", "F16": "float16"}.get(self._float_type(), "bfloat16") \
            if fmt == "float" else "bfloat16"
        return config

    def _float_type(self) -> str:
        return self.tensors["token_embd.weight"].tensor_type.name

    def _config(self) -> Any:
        from stateserve.models import gguf_configs

        return gguf_configs.config(self)

    def linear_format(self) -> str:
        """The type of the blocks' 2-D weights: "Q8_0", a float type, or the other type(s) found (comma-joined)."""
        kinds = {self.tensors[n].tensor_type.name for n in self.tensors
                 if n.startswith("blk.") and n.endswith(".weight") and len(self.tensors[n].shape) == 2
                 and "norm" not in n and "conv1d" not in n}
        if kinds <= set(_FLOAT_TYPES):
            return "float"
        return ",".join(sorted(kinds - set(_FLOAT_TYPES)))

    # ---- tensors -----------------------------------------------------------------------------------
    def _array(self, name: str) -> np.ndarray:
        from gguf.quants import dequantize

        t = self.tensors[name]
        values = dequantize(t.data, t.tensor_type)
        return np.asarray(values, dtype=np.float32).reshape([int(n) for n in reversed(t.shape)])

    def _float(self, name: str) -> torch.Tensor:
        """A tensor's values as float32, in numpy's (reversed ggml) shape."""
        t = self.tensors[name]
        if t.tensor_type.name in _FLOAT_TYPES:
            return torch.from_numpy(self._array(name).copy())
        from stateserve.quantization import ggml_types

        shape = [int(n) for n in reversed(t.shape)]
        return ggml_types.dequantize(t.data, t.tensor_type, [math.prod(shape[:-1]), shape[-1]]).reshape(shape)

    def _names(self) -> Any:
        from stateserve.models import gguf_archs

        if self._table is None:
            self._table = gguf_archs.names(self)
        return self._table

    def tensors_hf(self) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
        """(Hugging Face name, value) for every tensor of the file: a float32 tensor, or for a block-quantized 2-D
        weight a GGUFTensor (its blocks kept as they are where the layer takes them, else dequantized). Stacked
        experts [E, N, K] come out dequantized, per expert or whole as the model's checkpoint names them; tensors
        the converter split (gate and up) come out joined again."""
        from stateserve.models import gguf_archs

        config = self.hf_config()
        for name, t in self.tensors.items():
            target = gguf_archs.target(self._names(), name)
            if target is None:
                raise ValueError(f"{self.path}: unexpected tensor {name!r} for architecture {self.arch}")
            if not target.name:
                continue  # read with another tensor, or into the config
            parts = [name] + ([target.join] if target.join else [])
            if any(p not in self.tensors for p in parts):
                raise ValueError(f"{self.path}: tensor {name!r} without its other half {target.join!r}")
            rows = self._rotary_rows(name, config) if target.rotary else _same
            if len(t.shape) == 3:  # stacked experts
                value = torch.cat([self._float(p) for p in parts], dim=1)
                if "{e}" in target.name:
                    yield from ((target.name.format(e=e), value[e]) for e in range(value.shape[0]))
                else:
                    yield target.name, value
                continue
            kinds = {self.tensors[p].tensor_type for p in parts}
            if len(t.shape) == 2 and len(kinds) == 1 and t.tensor_type.name not in _FLOAT_TYPES and \
                    _kind(name) not in _REWRITTEN:
                raws = [np.asarray(self.tensors[p].data).reshape(int(self.tensors[p].shape[1]), -1) for p in parts]
                raw = np.concatenate(raws) if len(raws) > 1 else raws[0]  # one part: the file's memory, no copy
                yield target.name, GGUFTensor(name, raw, t.tensor_type, (raw.shape[0], int(t.shape[0])), rows)
                continue
            value = torch.cat([self._float(p) for p in parts]) if target.join else self._float(name)
            yield target.name, rows(value) if target.rotary else self._undo_conversion(name, value)

    def _rotary_rows(self, name: str, config: Any) -> Callable[[torch.Tensor], torch.Tensor]:
        """What undoes the converter's interleaving of q/k rows (each head's two rotary halves): rotate-half order."""
        heads = config.num_attention_heads if _kind(name) == "attn_q" else config.num_key_value_heads

        def rotate_half_order(value: torch.Tensor) -> torch.Tensor:
            rows = value.shape[0]
            return value.reshape(heads, rows // heads // 2, 2, *value.shape[1:]).transpose(1, 2).reshape(value.shape)
        return rotate_half_order

    def _undo_conversion(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """The converter's other changes undone: Mamba's A stored as -exp(A_log), squeezed conv1d weights, the
        Mamba2 layout's A and D as [heads, 1] and its grouped norm."""
        from stateserve.models.gguf_archs import MAMBA2_LAYOUT

        kind, mamba2 = _kind(name), self.arch in MAMBA2_LAYOUT
        if kind == "ssm_a":
            return torch.log(-value).reshape(-1) if mamba2 else torch.log(-value)
        if kind == "ssm_d" and mamba2:
            return value.reshape(-1)
        if kind == "ssm_conv1d" and name.endswith(".weight"):
            return value.unsqueeze(1)
        if kind == "ssm_norm":
            return value.reshape(-1)
        return value


def _same(value: torch.Tensor) -> torch.Tensor:
    return value


def _kind(name: str) -> str:
    """blk.N.KIND.suffix -> KIND ("" for the tensors outside the blocks)."""
    return name.split(".")[2] if name.startswith("blk.") else ""
