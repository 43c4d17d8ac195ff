"""FalconH1 (parallel attention + Mamba2 in every layer, muP multipliers): greedy parity with transformers under
chunked prefill, teacher-forced logits through the real caches, preemption by recompute, prefix-cache snapshots,
and configs with every multiplier away from 1 and the optional gated norm on."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import FalconH1Config, FalconH1ForCausalLM

from stateserve import LLM, SamplingParams
from stateserve.layers.attention import Attention
from stateserve.layers.recurrent import StatefulLayer
from stateserve.model_states.mamba_hybrid import MambaHybridModelState
from stateserve.models.falcon_h1 import FalconH1ForCausalLM as Ours
from utils import (assert_greedy_matches, build_hf_model, engine_teacher_forced_logits, hf_greedy, hf_logits,
                   save_model)

# mamba_d_ssm 96 differs from mamba_expand * hidden_size (128): the mixer width must come from d_ssm
BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, mamba_d_ssm=96, mamba_n_heads=8, mamba_d_head=12, mamba_d_state=16,
            mamba_n_groups=2, mamba_chunk_size=8, max_position_embeddings=256, tie_word_embeddings=False)
MULTIPLIERS = dict(embedding_multiplier=2.0, lm_head_multiplier=0.7, attention_in_multiplier=0.8,
                   attention_out_multiplier=1.3, key_multiplier=0.5, ssm_in_multiplier=1.2, ssm_out_multiplier=0.9,
                   mlp_multipliers=[1.5, 0.6], ssm_multipliers=[0.8, 1.2, 0.5, 1.5, 0.7])
CASES = {
    "default": {},
    # every multiplier away from 1, the gated RMSNorm on (normalise, then gate), biases everywhere
    "multipliers_norm_bias": dict(MULTIPLIERS, mamba_rms_norm=True, projectors_bias=True, mamba_proj_bias=True,
                                  attention_bias=True, mlp_bias=True),
    # gate, then normalise (per group); one group; gelu
    "norm_after_gate": dict(MULTIPLIERS, mamba_rms_norm=True, mamba_norm_before_gate=False, mamba_n_groups=1,
                            hidden_act="gelu"),
}
PROMPTS = [[1, 5, 9], list(range(7, 26)), list(range(100, 140)), [250], list(range(40, 52))]


def _build(tmp_path, name: str = "falcon_h1", **extra):
    hf = build_hf_model(FalconH1Config, FalconH1ForCausalLM, **{**BASE, **extra})
    with torch.no_grad():  # decays spread over [0.05, 1] so the Mamba state carries across many tokens
        for layer in hf.model.layers:
            layer.mamba.A_log.copy_(torch.linspace(math.log(0.05), 0.0, layer.mamba.num_heads))
    return hf, save_model(hf, str(tmp_path / name))


def _params(max_new: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("case", ["default", "multipliers_norm_bias"])
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


def test_every_multiplier_matters(tmp_path):
    """Resetting any one multiplier of ours to 1 moves the logits: none of them is silently ignored."""
    hf, path = _build(tmp_path, **CASES["multipliers_norm_bias"])
    tokens = list(range(3, 30))
    ref = hf_logits(hf, tokens)
    with LLM(path, skip_tokenizer_init=True) as llm:
        model = llm.llm_engine.runner.model
        torch.testing.assert_close(engine_teacher_forced_logits(llm, tokens, 64), ref, atol=2e-4, rtol=1e-4)
        layer = model.model.layers[0]
        targets = [(model, "embedding_multiplier"), (model, "lm_head_multiplier"), (layer, "ssm_in"),
                   (layer, "ssm_out"), (layer, "attn_in"), (layer, "attn_out"), (layer.self_attn, "key_multiplier"),
                   (layer.feed_forward, "gate_multiplier"), (layer.feed_forward, "down_multiplier")]
        for obj, attr in targets:
            saved = getattr(obj, attr)
            setattr(obj, attr, 1.0)
            moved = (engine_teacher_forced_logits(llm, tokens, 64) - ref).abs().max()
            setattr(obj, attr, saved)
            assert moved > 1e-2, attr
        scale = layer.mamba.in_proj_scale.clone()
        layer.mamba.in_proj_scale.fill_(1.0)
        assert (engine_teacher_forced_logits(llm, tokens, 64) - ref).abs().max() > 1e-2  # ssm_multipliers
        layer.mamba.in_proj_scale.copy_(scale)


def cache_bytes(model) -> tuple[int, int]:
    """(bytes of one recurrent-state slot, bytes of one 16-token KV block) over all layers of our model."""
    slot = sum(m.cache_spec().bytes_per_slot() for m in model.modules() if isinstance(m, StatefulLayer))
    block = sum(m.cache_spec().bytes_per_block(16) for m in model.modules() if isinstance(m, Attention))
    return slot, block


def test_preemption_recompute_gives_same_tokens(tmp_path):
    hf, path = _build(tmp_path)
    prompts = [list(range(10 + 7 * i, 40 + 7 * i)) for i in range(5)]  # 30 tokens each
    slot, block = cache_bytes(Ours(hf.config, torch.float32))
    # 4 state slots and 10 KV blocks: four running 50-token sequences need 16 blocks, so some get preempted
    num_blocks = max(10, math.ceil(4 * slot / block))  # hybrids leave at least half of the budget to KV
    assert num_blocks < 16
    # reference: the same engine with room for every sequence (parity with transformers is tested above)
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=32, enable_prefix_caching=False) as roomy:
        ref = [o.outputs[0].token_ids for o in roomy.generate([{"prompt_token_ids": p} for p in prompts],
                                                              _params(20))]
    with LLM(path, skip_tokenizer_init=True, max_num_seqs=4, max_num_batched_tokens=32,
             kv_cache_memory_bytes=4 * slot + num_blocks * block, enable_prefix_caching=False) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(20))
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
             mamba_cache_mode="align") as llm:
        outs = [o for rnd in (first, second) for o in llm.generate([{"prompt_token_ids": p} for p in rnd],
                                                                  _params(6))]
        assert_greedy_matches([o.outputs[0].token_ids for o in outs], ref, hf, first + second)
        assert min(o.num_cached_tokens for o in outs[len(first):]) >= 12  # really resumed from snapshots
        llm.llm_engine.check_integrity()


def test_weight_names_and_config_checks():
    cfg = FalconH1Config(**{**BASE, **CASES["multipliers_norm_bias"]})
    ours = Ours(cfg, torch.float32)
    assert Ours.is_hybrid and not Ours.is_attention_free
    mapped = [ours.map_weight_name(n) for n in FalconH1ForCausalLM(cfg).state_dict()]
    assert {target[0] for target in mapped if target is not None} == set(dict(ours.named_parameters()))
    assert ours.model.layers[0].mamba.intermediate_size == 96
    for field, value, message in [("mamba_d_head", 16, "mamba_d_head"), ("ssm_multipliers", [1.0, 2.0], "5"),
                                  ("mlp_multipliers", [1.0], "mlp_multipliers")]:
        bad = FalconH1Config(**BASE)
        setattr(bad, field, value)
        with pytest.raises(ValueError, match=message):
            Ours(bad, torch.float32)
