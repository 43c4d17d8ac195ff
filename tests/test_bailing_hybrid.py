"""Bailing Hybrid (Ling 3: Kimi Delta Attention with a bounded forget gate + MLA with rotary and a head gate + MoE):
greedy parity with transformers under batched chunked prefill, teacher-forced logits through the real caches,
prefix caching with mamba_cache_mode all / align, preemption by recompute, weight names, and bad configs' errors."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import BailingHybridConfig, BailingHybridForCausalLM

from utils import (assert_greedy_matches, build_hf_model, check_fused_experts_load, hf_greedy, hf_logits, save_model)
from state_checks import (check_bfloat16_logits, check_preemption_exact, check_prefix_cache_exact,
                          check_routing_decisive, check_teacher_forced_logits, greedy_params, make_routing_decisive,
                          small_llm)
BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=12, num_local_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
            # KDA heads' head_dim unlike qk_rope_head_dim: the config overwrites head_dim (kept as linear_head_dim)
            routed_scaling_factor=1.5, head_dim=16, short_conv_kernel_size=4, layer_group_size=2,
            first_k_dense_replace=1, rope_parameters={"rope_type": "default", "rope_theta": 100.0},
            pad_token_id=2, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, initializer_range=0.15)
CASES = {
    "base": {},  # the safe (bounded) gate, layers [KDA, MLA, KDA, MLA] from layer_group_size
    # Kimi's unbounded gate, the low-rank q path, attention bias, wider V, no top-k renormalisation, explicit types
    "variants": dict(kda_safe_gate=False, q_lora_rank=24, attention_bias=True, v_head_dim=20, norm_topk_prob=False,
                     n_group=1, mlp_layer_types=["dense", "sparse", "dense", "sparse"],
                     layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"]),
}
PROMPTS = [list(range(5, 5 + n)) for n in (1, 9, 17, 40)] + [[250, 7, 11]]


def _build(tmp_path, **extra):
    hf = build_hf_model(BailingHybridConfig, BailingHybridForCausalLM, **{**BASE, **extra})
    with torch.no_grad():  # slow decays so the recurrent state carries across many tokens
        for layer in hf.model.layers:
            if layer.block_type == "linear_attention":
                gate = layer.self_attn.forget_gate
                gate.A_log.copy_(torch.linspace(math.log(0.05), 0.0, gate.A_log.numel()))
                # safe gate: sigmoid(exp(A) * (f + dt)) small -> log decays of a few hundredths a token
                gate.dt_bias.copy_(torch.linspace(-5.0, -1.0, gate.dt_bias.numel()))
    return hf, save_model(hf, str(tmp_path / "bailing_hybrid"))


def _assert_logprobs_match(hf, prompts, outs, tol: float = 1e-3) -> None:
    """Each decoded token's logprob equals transformers' over the same tokens (teacher-forced): decisive tokens can
    survive a slightly wrong decode state, their logprobs cannot."""
    for p, o in zip(prompts, outs, strict=True):
        tokens = o.outputs[0].token_ids
        ref = torch.log_softmax(hf_logits(hf, p + tokens[:-1])[len(p) - 1:], dim=-1)  # [len(tokens), vocab]
        ours = [lp[t].logprob for t, lp in zip(tokens, o.outputs[0].logprobs)]
        diff = max(abs(a - float(ref[j, t])) for j, (a, t) in enumerate(zip(ours, tokens)))
        assert diff < tol, (p, tokens, diff)


def test_greedy_parity_chunked(tmp_path):
    # the base case only (the file's time budget): the variants' gates and MLA paths are shared by prefill and
    # decode, and test_teacher_forced_logits runs them through both
    hf, path = _build(tmp_path)
    ref = hf_greedy(hf, PROMPTS, 10)
    with small_llm(path, max_num_batched_tokens=16, enable_prefix_caching=False) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy_params(10, logprobs=0))
        assert_greedy_matches([o.outputs[0].token_ids for o in outs], ref, hf, PROMPTS, tol=1e-3)
        _assert_logprobs_match(hf, PROMPTS, outs)
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.cache.is_idle_and_full()


@pytest.mark.parametrize("case", list(CASES))
def test_teacher_forced_logits(case, tmp_path):
    hf, path = _build(tmp_path, **CASES[case])
    tokens = list(range(3, 80))  # 77 tokens: more than one 64-token KDA chunk
    ref = hf_logits(hf, tokens)
    check_teacher_forced_logits(path, ref, tokens, atol=5e-4)


def test_bfloat16_logits(tmp_path):
    """One whole-prompt step, resumed 7-token steps and token by token (the decode conv, KDA recurrence and MLA)
    beside transformers' bfloat16 (tolerance derived in check_bfloat16_logits), on the base model with its grouped
    sigmoid routing made decisive (as built, bfloat16 flips a token's expert group: transformers' own logits then
    off by up to 6.9)."""
    hf, _ = _build(tmp_path)
    make_routing_decisive(hf)
    tokens = list(range(3, 80))
    check_routing_decisive(hf, tokens)
    check_bfloat16_logits(hf, save_model(hf, str(tmp_path / "decisive")), tokens, (77, 7, 1))


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("bailing"))


@pytest.mark.parametrize("mode", ["all", "align"])
def test_prefix_cache_snapshots_exact(mode, base_model):
    check_prefix_cache_exact(base_model[1], mode)


def test_preemption_recompute_gives_same_tokens(base_model):
    check_preemption_exact(base_model[1], 16)


def test_weight_names_load_one_to_one(base_model):
    from stateserve.models.bailing_hybrid import BailingHybridForCausalLM as Ours
    from stateserve.models.loader import iterate_safetensors, load_weights

    hf, path = base_model
    ours = Ours(hf.config, torch.float32)
    names = [n for n, _ in iterate_safetensors(path, show_progress=False)]
    assert {ours.map_weight_name(n)[0] for n in names} == set(dict(ours.named_parameters()))
    load_weights(ours, iterate_safetensors(path, show_progress=False))  # strict: every tensor lands, none missing
    assert Ours.resolve_flags(hf.config) == (False, True)
    only_kda = BailingHybridConfig(**{**BASE, "layer_types": ["linear_attention"] * 4})
    assert Ours.resolve_flags(only_kda) == (True, False)


@pytest.mark.parametrize("change,message", [
    (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"]),
     "Bailing Hybrid: layer_types has unknown layer type(s) ['sliding_attention']"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 100.0, "factor": 4.0}),
     "rope_type 'longrope' is not supported"),
    (dict(kda_lower_bound=2.0), "kda_lower_bound=2.0 must be negative"),
])
def test_bad_config_is_refused(change, message):
    from stateserve.models.bailing_hybrid import BailingHybridForCausalLM as Ours

    cfg = BailingHybridConfig(**BASE)
    for key, value in change.items():
        object.__setattr__(cfg, key, value)  # past transformers' own checks: what a hand-written config.json holds
    with pytest.raises(ValueError) as err:
        Ours(cfg, torch.float32)
    assert message in str(err.value)


def test_fused_expert_tensors_load(tmp_path):
    """transformers' in-memory layout (save_pretrained(save_original_format=False), as some hub checkpoints store
    it: mlp.experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]; with its other in-memory names:
    embed_tokens, self_attn, the fused conv1d) loads, the experts split per expert: the same logits as the per-
    expert checkpoint, and as transformers."""
    hf, path = _build(tmp_path)
    check_fused_experts_load(hf, path, str(tmp_path / "fused"),
                             list(range(3, 80)))


def test_yarn_rope_logits(tmp_path):
    """YaRN rope (factor 4 over an original context of 16, the 77-token prompt well past it, so nearly every rotary
    dim is interpolated; attention_factor from mscale / mscale_all_dim on cos and sin, and mscale_all_dim's factor
    on the score scale): teacher-forced logits as transformers'."""
    hf, path = _build(tmp_path, rope_parameters={"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0,
                                 "original_max_position_embeddings": 16, "mscale": 2.0, "mscale_all_dim": 1.0})
    assert hf.config.rope_parameters["rope_type"] == "yarn"
    tokens = list(range(3, 80))
    ref = hf_logits(hf, tokens)
    check_teacher_forced_logits(path, ref, tokens, atol=5e-4)
