"""GGUF files (llama.cpp's format) as checkpoints: the file's metadata becomes a transformers config of the same
model, its tensors the checkpoint's tensors under Hugging Face names, so every model loads a GGUF file through the
same `map_weight_name` as a folder.

What the converter (llama.cpp's convert_hf_to_gguf.py) changed is undone here: Llama's q/k rows are permuted back
to rotate-half order, Mamba's A (stored as -exp(A_log)) becomes A_log again, squeezed conv1d weights get their
middle axis back, Mamba2's grouped norm is flattened. Float tensors come out as float32 (the stored values
exactly); a block-quantized 2-D weight comes out as a GGUFTensor, which a linear layer keeps in its own format
(quantization/formats.py) and any other parameter dequantizes.

Architectures: llama, mamba, mamba2. Tensor types: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K,
IQ4_NL, IQ4_XS (quantization/ggml_types.py); a file with any other type is refused, naming it."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch

from stateserve.quantization.formats import QuantizedWeight

ARCHITECTURES = ("llama", "mamba", "mamba2")
_FLOAT_TYPES = ("F32", "F16", "BF16")


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
        """The blocks in our formats: Q4_0, Q4_1, Q4_K as they are; Q8_0, Q5_0 and IQ4_NL exactly as int8 codes with
        a float16 scale per 32; Q5_K, Q6_K and IQ4_XS (whose scales d * (ls - 32) float16 does not hold) quantized
        again as Q8_0 from their values."""
        from stateserve.quantization import formats, ggml_types

        kind = self.type.name
        if kind in ("Q4_0", "Q4_1", "Q4_K"):
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
        vocab = int(self.tensors["token_embd.weight"].shape[-1])
        tied = not self._has("output.weight")
        common = dict(vocab_size=vocab, hidden_size=int(self._get("embedding_length")),
                      num_hidden_layers=int(self._get("block_count")), tie_word_embeddings=tied,
                      bos_token_id=self.meta.get("tokenizer.ggml.bos_token_id"),
                      eos_token_id=self.meta.get("tokenizer.ggml.eos_token_id"))
        eps = float(self._get("attention.layer_norm_rms_epsilon", 1e-5))
        if self.arch == "llama":
            from transformers import LlamaConfig

            if self._has("rope_freqs.weight"):
                raise ValueError(f"{self.path}: Llama 3.1-style rope scaling (rope_freqs) from GGUF is not "
                                 "supported yet; load the Hugging Face folder")
            heads = int(self._get("attention.head_count"))
            hidden = common["hidden_size"]
            rope = {"rope_type": "default", "rope_theta": float(self._get("rope.freq_base", 10000.0))}
            if self._get("rope.scaling.type") == "linear":
                rope = {**rope, "rope_type": "linear", "factor": float(self._get("rope.scaling.factor"))}
            return LlamaConfig(**common, architectures=["LlamaForCausalLM"], intermediate_size=int(self._get("feed_forward_length")),
                               num_attention_heads=heads,
                               num_key_value_heads=int(self._get("attention.head_count_kv", heads)),
                               head_dim=int(self._get("attention.key_length", hidden // heads)),
                               max_position_embeddings=int(self._get("context_length", 4096)), rms_norm_eps=eps,
                               rope_parameters=rope)
        inner = int(self._get("ssm.inner_size"))
        ssm = dict(state_size=int(self._get("ssm.state_size")), conv_kernel=int(self._get("ssm.conv_kernel")),
                   layer_norm_epsilon=eps, use_bias=self._has("blk.0.ssm_in.bias"),
                   use_conv_bias=self._has("blk.0.ssm_conv1d.bias"))
        if self.arch == "mamba":
            from transformers import FalconMambaConfig, MambaConfig

            falcon = bool(self._get("ssm.dt_b_c_rms", False))
            cls = FalconMambaConfig if falcon else MambaConfig
            return cls(**common, **ssm, architectures=["FalconMambaForCausalLM" if falcon else "MambaForCausalLM"], intermediate_size=inner, expand=inner // common["hidden_size"],
                       time_step_rank=int(self._get("ssm.time_step_rank")))
        from transformers import Mamba2Config

        heads = int(self._get("ssm.time_step_rank"))
        return Mamba2Config(**common, **ssm, architectures=["Mamba2ForCausalLM"], expand=inner // common["hidden_size"], num_heads=heads,
                            head_dim=inner // heads, n_groups=int(self._get("ssm.group_count", 1)))

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

    def tensors_hf(self) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
        """(Hugging Face name, value) for every tensor of the file: a float32 tensor, or for a block-quantized 2-D
        weight a GGUFTensor (its blocks kept as they are where the layer takes them, else dequantized)."""
        config = self.hf_config()
        for name, t in self.tensors.items():
            hf = self._hf_name(name)
            if hf is None:
                raise ValueError(f"{self.path}: unexpected tensor {name!r} for architecture {self.arch}")
            rows = self._row_order(name, config)
            if t.tensor_type.name not in _FLOAT_TYPES and len(t.shape) == 2 and rows is not None:
                shape = (int(t.shape[1]), int(t.shape[0]))
                yield hf, GGUFTensor(name, np.asarray(t.data).reshape(shape[0], -1), t.tensor_type, shape, rows)
                continue
            value = torch.from_numpy(self._array(name).copy())
            yield hf, rows(value) if rows is not None else self._undo_conversion(name, value)

    def _hf_name(self, name: str) -> str | None:
        top = {"llama": {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"},
               "mamba": {"token_embd": "backbone.embeddings", "output_norm": "backbone.norm_f",
                         "output": "lm_head"}}[("llama" if self.arch == "llama" else "mamba")]
        parts = name.split(".")
        if parts[0] != "blk":
            stem, suffix = parts[0], ".".join(parts[1:])
            return f"{top[stem]}.{suffix}" if stem in top else None
        layer, kind, suffix = parts[1], parts[2], ".".join(parts[3:])
        if self.arch == "llama":
            local = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                     "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                     "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                     "ffn_down": "mlp.down_proj"}.get(kind)
            return None if local is None else f"model.layers.{layer}.{local}.{suffix}"
        mixer = f"backbone.layers.{layer}.mixer"
        if kind == "attn_norm":
            return f"backbone.layers.{layer}.norm.{suffix}"
        if kind == "ssm_a":
            return f"{mixer}.A_log"
        if kind == "ssm_d":
            return f"{mixer}.D"
        if kind == "ssm_dt" and suffix == "bias" and self.arch == "mamba2":
            return f"{mixer}.dt_bias"
        local = {"ssm_in": "in_proj", "ssm_conv1d": "conv1d", "ssm_x": "x_proj", "ssm_dt": "dt_proj",
                 "ssm_out": "out_proj", "ssm_norm": "norm"}.get(kind)
        return None if local is None else f"{mixer}.{local}.{suffix}"

    def _row_order(self, name: str, config: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """What undoes the converter's change to a tensor when it only reorders rows (identity for most); None when
        the tensor changes otherwise (_undo_conversion)."""
        kind = name.split(".")[2] if name.startswith("blk.") else ""
        if kind in ("attn_q", "attn_k") and name.endswith(".weight"):
            heads = config.num_attention_heads if kind == "attn_q" else config.num_key_value_heads

            def rotate_half_order(value: torch.Tensor) -> torch.Tensor:
                # the converter interleaved each head's two rotary halves: put them back in rotate-half order
                rows = value.shape[0]
                return value.reshape(heads, rows // heads // 2, 2, *value.shape[1:]).transpose(1, 2) \
                    .reshape(value.shape)
            return rotate_half_order
        if kind in ("ssm_a", "ssm_d", "ssm_conv1d", "ssm_norm"):
            return None
        return lambda value: value

    def _undo_conversion(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """The converter's other changes undone: Mamba's A stored as -exp(A_log), squeezed conv1d weights,
        Mamba2's D and grouped norm reshaped."""
        kind = name.split(".")[2]
        if kind == "ssm_a":
            return torch.log(-value).reshape(-1) if self.arch == "mamba2" else torch.log(-value)
        if kind == "ssm_d" and self.arch == "mamba2":
            return value.reshape(-1)
        if kind == "ssm_conv1d" and name.endswith(".weight"):
            return value.unsqueeze(1)
        if kind == "ssm_norm":
            return value.reshape(-1)
        return value
