"""Shared helpers for benchmarks: realistic-shape random models written as Hugging Face folders."""
from __future__ import annotations

import json
import os
import platform
import time

import torch

MODEL_DIR = os.environ.get("STATESERVE_BENCH_MODELS", os.path.expanduser("~/.cache/stateserve/bench_models"))


def _configs(size: str) -> dict:
    from transformers import (BambaConfig, JambaConfig, LlamaConfig, Mamba2Config, MambaConfig)

    if size == "small":  # quick runs: a few seconds per measurement on 2 cores
        h, layers, vocab = 256, 4, 8192
    elif size == "30m":  # ~35M parameters: the serving benchmark's size (issue 7)
        h, layers, vocab = 384, 6, 32000
    elif size == "1b":  # ~0.95B parameters (Llama 16 layers of 2048, Mamba2 32): issue 36's ~1B configs
        h, layers, vocab = 2048, 16, 32000
    else:  # ~125M parameters, the shapes of issue 8
        h, layers, vocab = 768, 12, 32000
    return {
        "llama": (LlamaConfig, dict(vocab_size=vocab, hidden_size=h, intermediate_size=h * 8 // 3 // 64 * 64,
                                    num_hidden_layers=layers, num_attention_heads=h // 64, num_key_value_heads=h // 64,
                                    max_position_embeddings=8192, tie_word_embeddings=False)),
        "mamba": (MambaConfig, dict(vocab_size=vocab, hidden_size=h, state_size=16, num_hidden_layers=layers * 2,
                                    tie_word_embeddings=False)),
        "mamba2": (Mamba2Config, dict(vocab_size=vocab, hidden_size=h, num_heads=h * 2 // 64, head_dim=64,
                                      state_size=64, n_groups=1, num_hidden_layers=layers * 2, chunk_size=64,
                                      tie_word_embeddings=False)),
        "jamba": (JambaConfig, dict(vocab_size=vocab, hidden_size=h, intermediate_size=h * 2, num_hidden_layers=layers,
                                    num_attention_heads=h // 64, num_key_value_heads=h // 64, attn_layer_period=4,
                                    attn_layer_offset=2, expert_layer_period=2, expert_layer_offset=1, num_experts=4,
                                    num_experts_per_tok=2, mamba_d_state=16, use_mamba_kernels=False,
                                    tie_word_embeddings=False, max_position_embeddings=8192)),
        "bamba": (BambaConfig, dict(vocab_size=vocab, hidden_size=h, intermediate_size=h * 2, num_hidden_layers=layers,
                                    num_attention_heads=h // 64, num_key_value_heads=h // 64,
                                    attn_layer_indices=list(range(layers // 4, layers, layers // 2)),
                                    mamba_n_heads=h * 2 // 64, mamba_d_head=64, mamba_d_state=64, mamba_n_groups=1,
                                    mamba_chunk_size=64, tie_word_embeddings=False, max_position_embeddings=8192)),
    }


KINDS = ("llama", "mamba", "mamba2", "jamba", "bamba")


def model_folder(kind: str, size: str = "base", dtype: torch.dtype = torch.float32) -> str:
    """Build (once) a random-weight model of the given kind and size; returns its folder. Weights are drawn in
    float32 and stored in `dtype`, so every dtype of one kind and size holds the same (rounded) values."""
    suffix = "" if dtype == torch.float32 else "-" + str(dtype).removeprefix("torch.")
    path = os.path.join(MODEL_DIR, f"{kind}-{size}{suffix}")
    if os.path.isfile(os.path.join(path, "model.safetensors")) or \
            os.path.isfile(os.path.join(path, "model.safetensors.index.json")):
        return path
    from transformers import AutoModelForCausalLM

    cfg_cls, kw = _configs(size)[kind]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg_cls(**kw)).to(dtype)
    model.save_pretrained(path, safe_serialization=True)
    return path


def machine() -> dict:
    return {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
