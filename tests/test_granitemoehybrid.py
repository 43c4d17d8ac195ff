"""GraniteMoeHybrid (Mamba2 + attention layers, top-k MoE with a shared expert, granite multipliers): greedy parity
with transformers under chunked prefill, teacher-forced logits through the real caches, and an all-attention
config that routes to the plain decoder state. Preemption and prefix-cache snapshots: test_hybrid_cache.py."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

from stateserve import LLM, SamplingParams
from stateserve.model_states.default import DefaultModelState
from stateserve.model_states.mamba_hybrid import MambaHybridModelState
from stateserve.models.granitemoehybrid import GraniteMoeHybridForCausalLM as Ours
from state_checks import check_teacher_forced_logits
from utils import (assert_greedy_matches, build_hf_model, engine_teacher_forced_logits, hf_greedy, hf_logits,
                   save_model)

# Multipliers far from 1 so a missing one changes every logit; attention_multiplier 0.1 is not head_dim ** -0.5.
BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=32, shared_intermediate_size=48, num_hidden_layers=3,
            layer_types=["mamba", "attention", "mamba"], num_attention_heads=4, num_key_value_heads=2,
            num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
            mamba_n_groups=2, mamba_chunk_size=8, position_embedding_type="rope", embedding_multiplier=3.0,
            attention_multiplier=0.1, residual_multiplier=0.6, logits_scaling=2.5, max_position_embeddings=256,
            tie_word_embeddings=False)
CASES = {
    "rope_moe": {},
    # no rotary, dense (shared MLP only), biases on every projection, one group, gelu, attention first
    "nope_dense_bias": dict(position_embedding_type=None, num_local_experts=0, mamba_proj_bias=True,
                            attention_bias=True, mamba_n_groups=1, hidden_act="gelu",
                            layer_types=["attention", "mamba", "mamba"]),
}
PROMPTS = [[1, 5, 9], list(range(7, 26)), list(range(100, 140)), [250], list(range(40, 52))]


def _build(tmp_path, name: str = "granite", **extra):
    hf = build_hf_model(GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, **{**BASE, **extra})
    with torch.no_grad():  # decays spread over [0.05, 1] so the Mamba state carries across many tokens
        for layer in hf.model.layers:
            if layer.mamba is not None:
                layer.mamba.A_log.copy_(torch.linspace(math.log(0.05), 0.0, layer.mamba.num_heads))
    return hf, save_model(hf, str(tmp_path / name))


def _params(max_new: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_parity_chunked(case, tmp_path):
    hf, path = _build(tmp_path, **CASES[case])
    ref = hf_greedy(hf, PROMPTS, 10)
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=16, enable_prefix_caching=False) as llm:
        assert isinstance(llm.llm_engine.runner.model_state, MambaHybridModelState)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(10))
        assert_greedy_matches([o.outputs[0].token_ids for o in outs], ref, hf, PROMPTS)
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.cache.is_idle_and_full()


@pytest.mark.parametrize("case", list(CASES))
def test_teacher_forced_logits(case, tmp_path):
    hf, path = _build(tmp_path, **CASES[case])
    tokens = list(range(3, 80))  # 77 tokens: many 8-token scan chunks, several KV blocks
    # float32 throughout: only summation order differs (scan chunking, SDPA vs eager attention)
    check_teacher_forced_logits(path, hf_logits(hf, tokens), tokens, atol=2e-4)


def test_all_attention_config_is_a_plain_decoder(tmp_path):
    hf, path = _build(tmp_path, "granite_attn", num_hidden_layers=2, layer_types=["attention"] * 2)
    assert Ours.resolve_flags(hf.config) == (False, False)
    prompts = PROMPTS[:4]
    ref = hf_greedy(hf, prompts, 10)
    tokens = list(range(3, 50))
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=16) as llm:
        state = llm.llm_engine.runner.model_state
        assert type(state) is DefaultModelState and not state.uses_state_cache
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(10))
        assert_greedy_matches([o.outputs[0].token_ids for o in outs], ref, hf, prompts)
        torch.testing.assert_close(engine_teacher_forced_logits(llm, tokens, 7), hf_logits(hf, tokens),
                                   atol=2e-4, rtol=1e-4)


def test_flags_and_config_checks():
    mixed = GraniteMoeHybridConfig(**BASE)
    assert Ours.is_hybrid and Ours.resolve_flags(mixed) == (False, True)
    assert Ours.resolve_flags(GraniteMoeHybridConfig(**{**BASE, "layer_types": ["mamba"] * 3})) == (True, False)
    # checkpoint names: every transformers tensor lands on one of ours (mapped), and nothing of ours is left out
    ours = Ours(mixed, torch.float32)
    params = dict(ours.named_parameters())
    mapped = [ours.map_weight_name(n) for n in GraniteMoeHybridForCausalLM(mixed).state_dict()]
    assert {target[0] for target in mapped if target is not None} == set(params)
    for field, value, message in [("position_embedding_type", "alibi", "position_embedding_type"),
                                  ("layer_types", ["mamba", "moe", "mamba"], "layer_types"),
                                  ("mamba_d_head", 8, "mamba_d_head")]:
        bad = GraniteMoeHybridConfig(**BASE)
        setattr(bad, field, value)
        with pytest.raises(ValueError, match=message):
            Ours(bad, torch.float32)
