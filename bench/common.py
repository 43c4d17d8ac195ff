"""Shared helpers for benchmarks: realistic-shape random models written as Hugging Face folders."""
from __future__ import annotations

import json
import os
import platform
import time

import torch

MODEL_DIR = os.environ.get("STATESERVE_BENCH_MODELS", os.path.expanduser("~/.cache/stateserve/bench_models"))


def _configs(size: str) -> dict:
    from transformers import (BambaConfig, JambaConfig, LlamaConfig, Lfm2Config, Mamba2Config, MambaConfig,
                              OlmoHybridConfig, Qwen3_5TextConfig)
    from transformers import KimiLinearConfig
    from transformers import BailingHybridConfig
    from transformers import MiniMaxConfig
    from transformers import RecurrentGemmaConfig
    from transformers import xLSTMConfig
    from transformers import Lfm2MoeConfig, Lfm3Config, Qwen3_5MoeTextConfig

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
        # LFM2's pattern: every third layer attention (GQA, a quarter of the heads), the rest gated short convs; the
        # MLP width 2/3 of 4h rounded to 256 (its block_auto_adjust_ff_dim), so base is ~131M (llama's ~134M)
        "lfm2": (Lfm2Config, dict(vocab_size=vocab, hidden_size=h, intermediate_size=h * 4, num_hidden_layers=layers,
                                  num_attention_heads=h // 64, num_key_value_heads=max(1, h // 64 // 4),
                                  layer_types=["full_attention" if i % 3 == 2 else "conv" for i in range(layers)],
                                  conv_L_cache=3, tie_word_embeddings=False, max_position_embeddings=8192)),
        # Qwen3.5 (dense): three gated delta net layers per gated attention layer (its full_attention_interval 4),
        # GQA 4:1 and partial rotary as the released models; delta-net heads of 64 with twice the value heads of key
        # heads; llama's MLP width, so base is ~133M like llama's
        "qwen3_5": (Qwen3_5TextConfig, dict(vocab_size=vocab, hidden_size=h, intermediate_size=h * 8 // 3 // 64 * 64,
                                            num_hidden_layers=layers, num_attention_heads=h // 64,
                                            num_key_value_heads=max(1, h // 64 // 4), head_dim=64,
                                            linear_num_key_heads=h // 128, linear_num_value_heads=h // 64,
                                            linear_key_head_dim=64, linear_value_head_dim=64,
                                            full_attention_interval=4, tie_word_embeddings=False,
                                            max_position_embeddings=8192)),
        # Qwen3.5 MoE: qwen3_5's layers with MoE feed-forwards of 8 experts of 192 (top 2) plus a shared expert of
        # 192, about the dense MLP's parameters (base ~127M in all)
        "qwen3_5_moe": (Qwen3_5MoeTextConfig, dict(vocab_size=vocab, hidden_size=h, num_hidden_layers=layers,
                                                   num_attention_heads=h // 64,
                                                   num_key_value_heads=max(1, h // 64 // 4), head_dim=64,
                                                   linear_num_key_heads=h // 128, linear_num_value_heads=h // 64,
                                                   linear_key_head_dim=64, linear_value_head_dim=64,
                                                   moe_intermediate_size=192, shared_expert_intermediate_size=192,
                                                   num_experts=8, num_experts_per_tok=2,
                                                   layer_types=["full_attention" if i % 4 == 3 else "linear_attention"
                                                                for i in range(layers)],
                                                   tie_word_embeddings=False, max_position_embeddings=8192)),
        # LFM2-MoE: lfm2's layer pattern, the first two layers dense, then 8 experts of 256 (top 2)
        "lfm2_moe": (Lfm2MoeConfig, dict(vocab_size=vocab, hidden_size=h, intermediate_size=h * 8 // 3 // 64 * 64,
                                         moe_intermediate_size=256, num_hidden_layers=layers, num_dense_layers=2,
                                         num_experts=8, num_experts_per_tok=2, num_attention_heads=h // 64,
                                         num_key_value_heads=max(1, h // 64 // 4), conv_L_cache=3,
                                         layer_types=["full_attention" if i % 3 == 2 else "conv"
                                                      for i in range(layers)],
                                         tie_word_embeddings=False, max_position_embeddings=8192)),
        # LFM3: transformers' default pattern cut to `layers` (conv, conv, full, conv, sliding, ...), window 256,
        # llama's MLP width (LFM3 does not adjust it): base ~130M
        "lfm3": (Lfm3Config, dict(vocab_size=vocab, hidden_size=h, intermediate_size=h * 8 // 3 // 64 * 64,
                                  num_hidden_layers=layers, num_attention_heads=h // 64,
                                  num_key_value_heads=max(1, h // 64 // 4), head_dim=64, sliding_window=256,
                                  layer_types=["conv" if i < 2 or i % 2 else
                                               ("full_attention" if i % 4 == 2 else "sliding_attention")
                                               for i in range(layers)],
                                  tie_word_embeddings=False, max_position_embeddings=8192,
                                  # its defaults (124893..124900) lie outside this vocab
                                  pad_token_id=None, bos_token_id=1, eos_token_id=2)),
        # OLMo Hybrid: transformers' default pattern (every fourth layer full attention), MHA with full-width q/k
        # norms, as many delta-net key / value heads as attention heads, an MLP of 2h: base is ~125M. Key and value
        # heads of 64 (the released models' values are twice their keys): transformers 5.24 saves the fused conv
        # as three equal parts (q/k/v_conv1d), which are the real per-projection shards only when value_dim ==
        # key_dim, and stateserve loads those shards (models/olmo_hybrid.py)
        "olmo_hybrid": (OlmoHybridConfig, dict(vocab_size=vocab, hidden_size=h,
                                               intermediate_size=h * 2, num_hidden_layers=layers,
                                               num_attention_heads=h // 64, num_key_value_heads=h // 64,
                                               linear_num_key_heads=h // 64, linear_num_value_heads=h // 64,
                                               linear_key_head_dim=64, linear_value_head_dim=64,
                                               tie_word_embeddings=False, max_position_embeddings=8192,
                                               # its defaults (Dolma's 100277 / 100257) lie outside this vocab
                                               pad_token_id=None, eos_token_id=2)),
        # Kimi Linear: three KDA layers (heads of 64) per MLA layer (NoPE; latent 256 + a shared key part of 32,
        # heads of 64 + 32 / 64), the first layer a dense MLP, the rest MoE of 8 experts of 192 (top 2) + a shared
        # one: base is ~127M (llama's ~134M)
        "kimi_linear": (KimiLinearConfig, dict(vocab_size=vocab, hidden_size=h, intermediate_size=h * 8 // 3 // 64 * 64,
                                               num_hidden_layers=layers, num_attention_heads=h // 64,
                                               num_key_value_heads=h // 64, kv_lora_rank=256, q_lora_rank=None,
                                               qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                                               linear_num_heads=h // 64, linear_head_dim=64,
                                               layer_types=["full_attention" if i % 4 == 3 else "linear_attention"
                                                            for i in range(layers)],
                                               moe_intermediate_size=192, num_local_experts=8, num_experts_per_tok=2,
                                               n_group=1, topk_group=1, tie_word_embeddings=False,
                                               max_position_embeddings=8192,
                                               # its defaults (163584..163839) lie outside this vocab
                                               pad_token_id=None, bos_token_id=1, eos_token_id=2)),
        # Bailing Hybrid (Ling 3): Kimi Linear's base shapes with its own layers: three KDA layers (full-rank gates,
        # the bounded "safe" gate) per MLA layer (rotary part 32, a per-head output gate); first layer dense, then
        # MoE of 8 experts of 192 (top 2) + a shared one: base is ~136M (the full-rank gates add ~1M a KDA layer)
        "bailing_hybrid": (BailingHybridConfig, dict(vocab_size=vocab, hidden_size=h,
                                                     intermediate_size=h * 8 // 3 // 64 * 64, num_hidden_layers=layers,
                                                     num_attention_heads=h // 64, num_key_value_heads=h // 64,
                                                     head_dim=64, kv_lora_rank=256, q_lora_rank=None,
                                                     qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                                                     layer_group_size=4, first_k_dense_replace=1,
                                                     moe_intermediate_size=192, num_local_experts=8,
                                                     num_experts_per_tok=2, n_group=1, topk_group=1,
                                                     tie_word_embeddings=False, max_position_embeddings=8192,
                                                     # its defaults (156892..156895) lie outside this vocab
                                                     pad_token_id=None, bos_token_id=1, eos_token_id=2)),
        # MiniMax: three lightning-attention layers (heads of 64) per full-attention layer (GQA 3:1, rotary), every
        # layer a MoE of 8 experts of 192 (top 2), no dense MLP: base is ~123M
        "minimax": (MiniMaxConfig, dict(vocab_size=vocab, hidden_size=h, intermediate_size=192,
                                        num_hidden_layers=layers,
                                        num_attention_heads=h // 64, num_key_value_heads=max(1, h // 64 // 3),
                                        head_dim=64, num_local_experts=8, num_experts_per_tok=2,
                                        layer_types=["full_attention" if i % 4 == 3 else "linear_attention"
                                                     for i in range(layers)],
                                        tie_word_embeddings=False, max_position_embeddings=8192,
                                        pad_token_id=None, bos_token_id=1, eos_token_id=2)),
        # RecurrentGemma (Griffin): two RG-LRU recurrent blocks per local-attention block (its default pattern; MQA,
        # heads of 64, a 2048-token window), the LRU as wide as hidden, an MLP of ~11h/3 (intermediate_size is
        # twice the MLP width: transformers halves it), embeddings tied as released: base is ~122M
        "recurrent_gemma": (RecurrentGemmaConfig, dict(vocab_size=vocab, hidden_size=h, lru_width=h,
                                                       intermediate_size=2 * (h * 11 // 3 // 64 * 64),
                                                       num_hidden_layers=layers, num_attention_heads=h // 64,
                                                       num_key_value_heads=1, attention_window_size=2048,
                                                       conv1d_width=4, block_types=["recurrent", "recurrent",
                                                                                    "attention"],
                                                       pad_token_id=0, bos_token_id=1, eos_token_id=2)),
        # xLSTM (xLSTM Large's layout): mLSTM blocks only, 4 heads (q/k of 96, v of 192: transformers' qk and v
        # factors 0.5 and 1), its SwiGLU of 2.667h rounded to 64, an untied LM head: base is ~134M (llama's ~134M)
        "xlstm": (xLSTMConfig, dict(vocab_size=vocab, hidden_size=h, num_hidden_layers=layers, num_heads=4,
                                    tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    }


KINDS = ("llama", "mamba", "mamba2", "jamba", "bamba", "lfm2", "lfm2_moe", "lfm3", "qwen3_5", "qwen3_5_moe",
         "olmo_hybrid", "kimi_linear", "bailing_hybrid", "recurrent_gemma", "minimax", "xlstm")


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


def cpu_name() -> str:
    """The CPU's model name and the vector extensions that pick our kernels (a VM may hide some, e.g. AMX), so
    that every result names the machine it came from; the architecture alone where /proc/cpuinfo is absent."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return platform.processor() or platform.machine()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                 platform.machine())
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")
             if f in flags]
    return f"{model} ({' '.join(shown) or 'no AVX2'})"


def machine() -> dict:
    return {"cpu": cpu_name(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
