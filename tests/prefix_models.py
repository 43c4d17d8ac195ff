"""Tiny models for prefix-cache tests, one per model kind (built lazily; kinds whose stateserve model does not
exist yet are skipped)."""
from __future__ import annotations

import pytest

from stateserve import ModelRegistry
from utils import build_hf_model, save_model

VOCAB = 300


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return build_hf_model(LlamaConfig, LlamaForCausalLM, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=512)


def _mamba():
    from transformers import MambaConfig, MambaForCausalLM
    return build_hf_model(MambaConfig, MambaForCausalLM, vocab_size=VOCAB, hidden_size=32, state_size=8,
                          num_hidden_layers=2, tie_word_embeddings=False)


def _mamba2():
    from transformers import Mamba2Config, Mamba2ForCausalLM
    return build_hf_model(Mamba2Config, Mamba2ForCausalLM, vocab_size=VOCAB, hidden_size=32, num_heads=4,
                          head_dim=16, state_size=8, n_groups=1, num_hidden_layers=2, chunk_size=8,
                          tie_word_embeddings=False)


def _jamba():
    from transformers import JambaConfig, JambaForCausalLM
    return build_hf_model(JambaConfig, JambaForCausalLM, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2,
                          attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=4,
                          num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                          use_mamba_kernels=False, tie_word_embeddings=False, max_position_embeddings=512)


def _bamba():
    from transformers import BambaConfig, BambaForCausalLM
    return build_hf_model(BambaConfig, BambaForCausalLM, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                          attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
                          mamba_n_groups=1, mamba_chunk_size=8, tie_word_embeddings=False,
                          max_position_embeddings=512)


BUILDERS = {"llama": ("LlamaForCausalLM", _llama), "mamba": ("MambaForCausalLM", _mamba),
            "mamba2": ("Mamba2ForCausalLM", _mamba2), "jamba": ("JambaForCausalLM", _jamba),
            "bamba": ("BambaForCausalLM", _bamba)}
RECURRENT = ["mamba", "mamba2", "jamba", "bamba"]


def model_path(kind: str, tmp_path_factory) -> str:
    arch, build = BUILDERS[kind]
    if not ModelRegistry.is_registered(arch):
        pytest.skip(f"{arch} is not implemented in stateserve yet")
    return save_model(build(), str(tmp_path_factory.mktemp(kind)))
