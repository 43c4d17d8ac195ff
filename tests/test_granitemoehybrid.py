"""GraniteMoeHybrid (Mamba2 + attention layers, top-k MoE with a shared expert, granite multipliers): greedy parity
with transformers under chunked prefill, teacher-forced logits through the real caches, preemption by recompute,
prefix-cache snapshots of the Mamba states, and an all-attention config that routes to the plain decoder state."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

from stateserve import LLM, SamplingParams
from stateserve.layers.attention import Attention
from stateserve.layers.recurrent import StatefulLayer
from stateserve.model_states.default import DefaultModelState
from stateserve.model_states.mamba_hybrid import MambaHybridModelState
from stateserve.models.granitemoehybrid import GraniteMoeHybridForCausalLM as Ours
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
    ref = hf_logits(hf, tokens)
    with LLM(path, skip_tokenizer_init=True) as llm:
        for chunk in (1, 7, 64):
            # float32 throughout: only summation order differs (scan chunking, SDPA vs eager attention)
            torch.testing.assert_close(engine_teacher_forced_logits(llm, tokens, chunk), ref, atol=2e-4, rtol=1e-4)


def cache_bytes(model) -> tuple[int, int]:
    """(bytes of one recurrent-state slot, bytes of one 16-token KV block) over all layers of our model."""
    slot = sum(m.cache_spec().bytes_per_slot() for m in model.modules() if isinstance(m, StatefulLayer))
    block = sum(m.cache_spec().bytes_per_block(16) for m in model.modules() if isinstance(m, Attention))
    return slot, block


def test_preemption_recompute_gives_same_tokens(tmp_path):
    # two attention layers: KV blocks weigh more against the Mamba state, so a small budget is KV-bound
    hf, path = _build(tmp_path, layer_types=["mamba", "attention", "attention"])
    prompts = [list(range(10 + 7 * i, 40 + 7 * i)) for i in range(6)]  # 30 tokens each
    slot, block = cache_bytes(Ours(hf.config, torch.float32))
    # 4 state slots and 10 KV blocks: four running 54-token sequences need 16 blocks, so some get preempted
    num_blocks = max(10, math.ceil(4 * slot / block))  # hybrids leave at least half of the budget to KV
    assert num_blocks < 16
    # reference: the same engine with room for every sequence (parity with transformers is tested above)
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=32, enable_prefix_caching=False) as roomy:
        ref = [o.outputs[0].token_ids for o in roomy.generate([{"prompt_token_ids": p} for p in prompts],
                                                              _params(24))]
    with LLM(path, skip_tokenizer_init=True, max_num_seqs=4, max_num_batched_tokens=32,
             kv_cache_memory_bytes=4 * slot + num_blocks * block, enable_prefix_caching=False) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(24))
        assert llm.llm_engine.stats["preemptions"] > 0
        assert_greedy_matches([o.outputs[0].token_ids for o in outs], ref, hf, prompts)
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.cache.is_idle_and_full()


def test_prefix_cache_snapshots(tmp_path):
    """Mamba snapshots taken mid-chunk (block size 4) and resumed from must not change greedy output."""
    hf, path = _build(tmp_path)
    shared = list(range(30, 60))
    first = [shared + [7, 8], shared[:13] + [9]]
    second = [shared + [7, 8, 11], shared[:13] + [250, 3]]
    ref = hf_greedy(hf, first + second, 6)
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=16, block_size=4, enable_prefix_caching=True,
             mamba_cache_mode="all") as llm:
        outs = [o for rnd in (first, second) for o in llm.generate([{"prompt_token_ids": p} for p in rnd],
                                                                  _params(6))]
        assert_greedy_matches([o.outputs[0].token_ids for o in outs], ref, hf, first + second)
        assert min(o.num_cached_tokens for o in outs[len(first):]) >= 12  # really resumed from snapshots
        llm.llm_engine.check_integrity()


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
