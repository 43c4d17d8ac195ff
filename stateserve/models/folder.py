"""What is read from a model folder before anything is built: the model config (with the class's own limits and
flags), the tokenizer, and whether the architecture generates or pools (the engine's and a draft model's)."""
from __future__ import annotations

import os
from typing import Any

import torch

from stateserve.config import EngineConfig, ModelConfig, load_hf_config, read_eos_ids, resolve_dtype
from stateserve.models.registry import ModelRegistry

_DEFAULT_RECURRENT_MAX_LEN = 1 << 16


def build_model_config(cfg: EngineConfig, device: torch.device) -> ModelConfig:
    from stateserve.models.gguf_file import GGUFCheckpoint, is_gguf

    hf = load_hf_config(GGUFCheckpoint(cfg.model).hf_config() if is_gguf(cfg.model) else cfg.model, cfg.hf_overrides)
    arch = ModelRegistry.architecture_of(hf)
    cls = ModelRegistry.resolve(arch)
    is_af, is_hybrid = cls.resolve_flags(hf)  # e.g. a hybrid family whose config may turn out all-attention
    limit = cls.max_positions(hf)  # e.g. Whisper's decoder: max_target_positions
    bounded = limit is not None  # None: the model positions any length (a recurrence, RecurrentGemma's rope)
    if limit is None:
        limit = _DEFAULT_RECURRENT_MAX_LEN if is_af or is_hybrid else 2048
    elif not is_af:
        from stateserve.layers.rotary import rope_parameters

        rope = rope_parameters(hf)
        if rope["rope_type"] in ("linear", "dynamic"):  # these stretch the usable context by `factor`
            limit = int(limit * rope.get("factor", 1.0))
    if cfg.max_model_len is not None:
        if cfg.max_model_len > limit and bounded and not is_af:
            raise ValueError(f"max_model_len={cfg.max_model_len} exceeds the model's max_position_embeddings={limit}")
        limit = cfg.max_model_len
    return ModelConfig(path=cfg.model, hf_config=hf, architecture=arch, dtype=resolve_dtype(cfg.dtype, hf, device),
                       max_model_len=int(limit), vocab_size=int(hf.vocab_size), is_attention_free=is_af,
                       is_hybrid=is_hybrid, eos_token_ids=read_eos_ids(cfg.model, hf))


def load_tokenizer(cfg: EngineConfig) -> Any | None:
    if cfg.skip_tokenizer_init:
        return None
    from transformers import AutoTokenizer

    from stateserve.models.gguf_file import is_gguf

    path = cfg.tokenizer or cfg.model
    if is_gguf(path):  # the file's own vocabulary, converted by transformers
        try:
            return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                 gguf_file=os.path.basename(path), local_files_only=True)
        except Exception as e:
            raise ValueError(f"the vocabulary of {path} could not be read as a tokenizer ({e}); pass tokenizer= a "
                             "Hugging Face folder with the model's tokenizer") from e
    if not os.path.isdir(path):
        raise ValueError(f"tokenizer {path!r} is not a folder")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def check_runner(config: EngineConfig, model_config: ModelConfig) -> None:
    """runner='generate' or 'pooling' must match what the architecture's class is; 'auto' takes what it is."""
    pooling = ModelRegistry.resolve(model_config.architecture).is_pooling_model
    arch = model_config.architecture
    if config.runner == "pooling" and not pooling:
        raise ValueError(f"{arch} has no pooling head: runner='pooling' needs an embedding model "
                         "(BertModel, RobertaModel, XLMRobertaModel)")
    if config.runner == "generate" and pooling:
        raise ValueError(f"{arch} is an embedding model with no LM head: it cannot run with runner='generate'; "
                         "use runner='pooling' (the default for it) and LLM.embed")
