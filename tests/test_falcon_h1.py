"""FalconH1 (parallel attention + Mamba2 in every layer, muP multipliers): greedy parity with transformers under
chunked prefill, teacher-forced logits through the real caches, and configs with every multiplier away from 1
and the optional gated norm on. Preemption and prefix-cache snapshots: test_hybrid_cache.py."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import FalconH1Config, FalconH1ForCausalLM

from stateserve import LLM, SamplingParams
from stateserve.model_states.mamba_hybrid import MambaHybridModelState
from stateserve.models.falcon_h1 import FalconH1ForCausalLM as Ours
from state_checks import check_teacher_forced_logits
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
    # float32 throughout: only summation order differs (scan chunking, SDPA vs eager attention)
    check_teacher_forced_logits(path, hf_logits(hf, tokens), tokens, atol=2e-4)


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
