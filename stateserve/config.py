"""Frozen, validated configuration: what the user asked for (EngineConfig) and what the model is (ModelConfig)."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    model: str
    tokenizer: str | None = None
    dtype: str | torch.dtype = "auto"  # a torch.dtype is taken as its name, as vLLM does
    load_format: str = "auto"  # auto | safetensors | dummy
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool | None = None  # None = the default for the model kind
    mamba_cache_mode: str | None = None  # none | all | align; None = the default
    # dtype of SSM states: float32 | bfloat16 | auto (the model dtype where the layer kind can keep it, as vLLM
    # and transformers do; Mamba1 and gated-delta-net states stay float32)
    mamba_ssm_cache_dtype: str = "auto"
    hf_overrides: dict[str, Any] | None = None
    skip_tokenizer_init: bool = False
    device: str = "auto"
    enforce_eager: bool = False
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    runner: str = "auto"  # auto | generate | pooling
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"LLM: {msg}")

        if not isinstance(self.model, str) or not self.model:
            bad("model must be a path to a Hugging Face model folder")
        if isinstance(self.dtype, torch.dtype):
            name = next((n for n, d in _DTYPES.items() if d == self.dtype), None)
            if name is None:
                bad(f"dtype must be float32, bfloat16 or float16, got {self.dtype}")
            object.__setattr__(self, "dtype", name)  # frozen: normalised once, here
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            bad(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            bad(f"load_format must be auto, safetensors or dummy, got {self.load_format!r}")
        if self.max_num_seqs < 1:
            bad(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            bad(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.block_size < 1:
            bad(f"block_size must be >= 1, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 1:
            bad(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.mamba_cache_mode not in (None, "none", "all", "align"):
            bad(f"mamba_cache_mode must be none, all or align, got {self.mamba_cache_mode!r}")
        if self.mamba_ssm_cache_dtype not in ("float32", "bfloat16", "auto"):
            bad(f"mamba_ssm_cache_dtype must be float32, bfloat16 or auto, got {self.mamba_ssm_cache_dtype!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            bad(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if not 0 < self.gpu_memory_utilization <= 1:
            bad(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.runner not in ("auto", "generate", "pooling"):
            bad(f"runner must be auto, generate or pooling, got {self.runner!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            bad(f"device must be auto, cpu or cuda[:N], got {self.device!r}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"LLM got unexpected keyword argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about the model, derived once from config.json."""

    path: str
    hf_config: Any = field(repr=False)
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    vocab_size: int
    is_attention_free: bool
    is_hybrid: bool
    eos_token_ids: frozenset[int]

    @property
    def is_recurrent(self) -> bool:
        return self.is_attention_free or self.is_hybrid


def load_hf_config(path: str, hf_overrides: dict[str, Any] | None) -> Any:
    from transformers import AutoConfig

    if not os.path.isdir(path):
        raise ValueError(f"model {path!r} is not a folder; stateserve loads Hugging Face model folders from disk")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model folder {path!r} has no config.json")
    cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    for key, value in (hf_overrides or {}).items():
        if not isinstance(key, str):
            raise ValueError(f"hf_overrides keys must be strings, got {key!r}")
        setattr(cfg, key, value)
    return cfg


def resolve_dtype(requested: str, hf_config: Any, device: torch.device) -> torch.dtype:
    if requested != "auto":
        return _DTYPES[requested]
    cfg_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(cfg_dtype, str):
        cfg_dtype = _DTYPES.get(cfg_dtype, torch.float32)
    if cfg_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        cfg_dtype = torch.float32
    if device.type == "cpu" and cfg_dtype == torch.float16:
        return torch.float32  # fp16 matmuls on CPU are slow and lossy; bf16 and fp32 are fine
    return cfg_dtype


def read_eos_ids(path: str, hf_config: Any) -> frozenset[int]:
    ids: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    add(getattr(hf_config, "eos_token_id", None))
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            add(json.load(f).get("eos_token_id"))
    return frozenset(ids)
