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
# the accepted values, shared by the checks in __post_init__ and the CLI's choices
_LOAD_FORMATS = ("auto", "safetensors", "dummy")
_MAMBA_CACHE_MODES = ("none", "all", "align")
_SSM_CACHE_DTYPES = ("auto", "float32", "bfloat16")
_RUNNERS = ("auto", "generate", "pooling")
QUANTIZATION_METHODS = ("int8", "int8_weight_only", "q4_0", "q4_0_weight_only", "q4_k", "q4_k_weight_only")


def _option(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A field's default with the help text (and choices) that `stateserve generate/serve` show for its flag: the
    CLI is generated from these fields (entrypoints/cli.py), so its defaults cannot drift from the API's."""
    return field(default=default, metadata={"help": help, "choices": choices})


# ---- speculative decoding (docs/speculative_decoding.md) ----
_SPEC_METHODS = ("ngram", "draft_model")
_SPEC_KEYS = {
    "ngram": ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"),
    "draft_model": ("method", "num_speculative_tokens", "model"),
}
MAX_SPECULATIVE_TOKENS = 32  # verified rows grow with k; past this a step costs more than drafts can save


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """`LLM(speculative_config={...})` / `--speculative-config '<json>'`, with vLLM's key names, validated once:
    unknown methods or keys, k outside [1, 32] and bad lookup windows raise here, when the LLM is built."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1  # ngram: shortest suffix matched against the request's earlier tokens
    prompt_lookup_max: int = 4  # ngram: longest suffix tried first
    model: str | None = None  # draft_model: a Hugging Face folder with the target's vocabulary

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict[str, Any] | None") -> "SpeculativeConfig | None":
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (JSON object), got {type(value).__name__}")
        cfg = dict(value)
        method = cfg.get("method")
        if method is None and cfg.get("model") is not None:
            method = cfg["method"] = "draft_model"  # vLLM infers a draft model from `model`
        if method not in _SPEC_METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(_SPEC_METHODS)}, got {method!r}")
        unknown = sorted(set(cfg) - set(_SPEC_KEYS[method]))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) for method {method!r}: {', '.join(unknown)} "
                             f"(accepted: {', '.join(_SPEC_KEYS[method])})")
        if "num_speculative_tokens" not in cfg:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        if method == "ngram":  # vLLM's rule: one bound given sets the other to it
            lo, hi = cfg.get("prompt_lookup_min"), cfg.get("prompt_lookup_max")
            if lo is None and hi is None:
                lo, hi = 1, 4
            cfg["prompt_lookup_min"] = lo if lo is not None else hi
            cfg["prompt_lookup_max"] = hi if hi is not None else lo
        return cls(**cfg)

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"speculative_config: {msg}")

        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            bad(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    bad(f"{name} must be an integer >= 1, got {v!r}")
            if lo > hi:
                bad(f"prompt_lookup_min={lo} is more than prompt_lookup_max={hi}")
        elif self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                bad("method draft_model needs `model`: the path of a Hugging Face folder")
        else:
            bad(f"method must be one of {', '.join(_SPEC_METHODS)}, got {self.method!r}")

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k in _SPEC_KEYS[self.method]}


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    model: str
    tokenizer: str | None = _option(None, "tokenizer folder (default: the model folder)")
    # a torch.dtype is taken as its name, as vLLM does
    dtype: str | torch.dtype = _option("auto", "weights and activations; auto = the checkpoint's (float16 runs as "
                                               "float32 on CPU)", ("auto", *_DTYPES))
    quantization: str | None = _option(None, "quantize the dense projections while loading (CPU), as llama.cpp's "
                                             "Q8_0 (int8), Q4_0 or Q4_K (head at Q8_0) weights with int8 "
                                             "activations; ..._weight_only: float activations (exact). A GGUF "
                                             "file's quantized tensors keep their format", QUANTIZATION_METHODS)
    load_format: str = _option("auto", "auto and safetensors read the folder's weights; dummy draws random ones "
                                       "(benchmarks)", _LOAD_FORMATS)
    seed: int = _option(0, "seed of sampling without a per-request seed, and of dummy weights")
    max_model_len: int | None = _option(None, "most tokens (prompt + output) per sequence (default: the model's "
                                              "max_position_embeddings)")
    max_num_seqs: int = _option(64, "most sequences running at once")
    max_num_batched_tokens: int = _option(2048, "most tokens one engine step computes (prefill chunks + decodes)")
    block_size: int = _option(16, "tokens per KV-cache block")
    enable_prefix_caching: bool | None = _option(None, "reuse the KV blocks and state snapshots of shared prompt "
                                                       "prefixes (default: the model kind's default)")
    mamba_cache_mode: str | None = _option(None, "recurrent-state snapshots for prefix caching: all = at every "
                                                 "block boundary, align = at chunk ends, none (default: the model "
                                                 "kind's default)", _MAMBA_CACHE_MODES)
    # auto keeps states in the model dtype where the layer kind can, as vLLM and transformers do; Mamba1 and
    # gated-delta-net states stay float32
    mamba_ssm_cache_dtype: str = _option("auto", "dtype of Mamba2-style SSM states (auto: the model's); bfloat16 "
                                                 "halves their memory traffic", _SSM_CACHE_DTYPES)
    hf_overrides: dict[str, Any] | None = _option(None, "values set on the model's config after config.json is read "
                                                        "(CLI: a JSON object)")
    skip_tokenizer_init: bool = _option(False, "no tokenizer: prompts must be token ids and outputs carry no text "
                                               "(benchmarks)")
    device: str = _option("auto", "auto (cuda when available), cpu, cuda or cuda:N")
    enforce_eager: bool = _option(False, "no CUDA graphs: every decode step runs eagerly")
    kv_cache_memory_bytes: int | None = _option(None, "bytes for KV blocks and state slots (default: what is left on "
                                                      "CUDA, STATESERVE_CPU_KV_CACHE_SPACE on CPU)")
    num_gpu_blocks_override: int | None = _option(None, "exactly this many KV blocks, whatever the memory budget "
                                                        "(tests of preemption; vLLM's name, on CPU too)")
    gpu_memory_utilization: float = _option(0.9, "share of the GPU's memory the engine may use, caches included")
    speculative_config: dict[str, Any] | SpeculativeConfig | None = _option(
        None, 'speculative decoding with vLLM\'s keys (CLI: a JSON object): {"method": "ngram", '
              '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4} or {"method": '
              '"draft_model", "model": DIR, "num_speculative_tokens": 4}')
    batch_invariant: bool | None = _option(None, "every float linear (CPU) sums its outputs in one order at any "
                                                 "batch size, so a request's tokens and logprobs do not depend on "
                                                 "what it is batched with (batched and prefill products a little "
                                                 "slower); default: on with speculative decoding, whose verify steps "
                                                 "must match plain decoding")
    tensor_parallel_size: int = _option(1, "ranks the model is split across (CPU, gloo; each a process with its "
                                           "share of the heads, channels and experts, of the cores and of the "
                                           "cache)")
    pipeline_parallel_size: int = _option(1, "ranks the model's layers are cut across in consecutive stages (CPU, "
                                             "gloo; each a process with its stage's weights and caches)")
    distributed_init_method: str | None = _option(None, "tcp://HOST:PORT where the ranks of several hosts meet "
                                                        "(node 0 listens; default: a free loopback port)")
    nnodes: int = _option(1, "hosts the tensor-parallel ranks run on (each runs tensor_parallel_size / nnodes)")
    node_rank: int = _option(0, "this host's place among nnodes: 0 runs the engine, the others only workers")
    runner: str = _option("auto", "auto picks by the architecture: generate for language models, pooling for "
                                  "embedding models", _RUNNERS)
    trust_remote_code: bool = _option(False, "accepted as vLLM does; stateserve never runs code from the model "
                                             "folder")

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
        if self.quantization not in (None, *QUANTIZATION_METHODS):
            bad(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {self.quantization!r}")
        if self.load_format not in _LOAD_FORMATS:
            bad(f"load_format must be auto, safetensors or dummy, got {self.load_format!r}")
        if self.max_num_seqs < 1:
            bad(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            bad(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.block_size < 1:
            bad(f"block_size must be >= 1, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 1:
            bad(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.mamba_cache_mode not in (None, *_MAMBA_CACHE_MODES):
            bad(f"mamba_cache_mode must be none, all or align, got {self.mamba_cache_mode!r}")
        if self.mamba_ssm_cache_dtype not in _SSM_CACHE_DTYPES:
            bad(f"mamba_ssm_cache_dtype must be float32, bfloat16 or auto, got {self.mamba_ssm_cache_dtype!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            bad(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            bad(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")
        if not 0 < self.gpu_memory_utilization <= 1:
            bad(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.batch_invariant is not None and not isinstance(self.batch_invariant, bool):
            bad(f"batch_invariant must be True, False or None, got {self.batch_invariant!r}")
        # normalised once (frozen): a dict becomes a validated SpeculativeConfig or raises naming the problem
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.runner not in _RUNNERS:
            bad(f"runner must be auto, generate or pooling, got {self.runner!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            bad(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        self._check_parallel(bad)

    def _check_parallel(self, bad: Any) -> None:
        tp, nodes = self.world_size, self.nnodes
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                bad(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < nodes:
            bad(f"node_rank must be in [0, nnodes={nodes}), got {self.node_rank!r}")
        if tp % nodes:
            bad(f"the {tp} ranks (tensor_parallel_size x pipeline_parallel_size) must be a multiple of nnodes={nodes} "
                "(each host runs as many ranks)")
        if nodes > 1 and self.distributed_init_method is None:
            bad("nnodes > 1 needs distributed_init_method (tcp://HOST:PORT of node 0, where the ranks meet)")
        if tp == 1:
            return
        if self.device.startswith("cuda"):
            bad("tensor_parallel_size and pipeline_parallel_size > 1 run on CPU (gloo) only so far; use "
                "device='cpu'")

    @property
    def batch_invariant_linears(self) -> bool:
        """batch_invariant as it applies: unset, on exactly when speculating (verify rows must sum as one row)."""
        return self.batch_invariant if self.batch_invariant is not None else self.speculative_config is not None

    @property
    def world_size(self) -> int:
        """Processes one engine runs on: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

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


def load_hf_config(path: Any, hf_overrides: dict[str, Any] | None) -> Any:
    """config.json of a folder, or `path` as it is when it is already a config (a GGUF file's, models/folder.py),
    with the overrides set on it."""
    from transformers import AutoConfig

    if not isinstance(path, str):
        cfg = path
    elif not os.path.isdir(path):
        raise ValueError(f"model {path!r} is neither a folder nor a .gguf file; stateserve loads Hugging Face model "
                         "folders and GGUF files from disk")
    elif not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model folder {path!r} has no config.json")
    else:
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
