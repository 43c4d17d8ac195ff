"""Bailing Hybrid (Ling 3: Kimi Delta Attention with a bounded forget gate + MLA with rotary and a head gate + MoE):
greedy parity with transformers under batched chunked prefill, teacher-forced logits through the real caches,
prefix caching with mamba_cache_mode all / align, preemption by recompute, weight names, and bad configs' errors."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import BailingHybridConfig, BailingHybridForCausalLM

from stateserve import LLM, SamplingParams
from utils import (assert_cache_sized, assert_greedy_matches, build_hf_model, engine_teacher_forced_logits,
                   hf_greedy, hf_logits, save_model)

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


def _llm(path: str, **kw) -> LLM:
    kw.setdefault("kv_cache_memory_bytes", 32 << 20)  # a small cache: zeroing GiBs dominated each engine start
    return LLM(path, skip_tokenizer_init=True, **kw)


def _params(max_new: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True, **kw)


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
    with _llm(path, max_num_batched_tokens=16, enable_prefix_caching=False) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(10, logprobs=0))
        assert_greedy_matches([o.outputs[0].token_ids for o in outs], ref, hf, PROMPTS, tol=1e-3)
        _assert_logprobs_match(hf, PROMPTS, outs)
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.cache.is_idle_and_full()


@pytest.mark.parametrize("case", list(CASES))
def test_teacher_forced_logits(case, tmp_path):
    hf, path = _build(tmp_path, **CASES[case])
    tokens = list(range(3, 80))  # 77 tokens: more than one 64-token KDA chunk
    ref = hf_logits(hf, tokens)
    with _llm(path) as llm:
        for chunk in (1, 7, 64):
            torch.testing.assert_close(engine_teacher_forced_logits(llm, tokens, chunk), ref, atol=5e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("bailing"))


def _scored(llm: LLM, prompts, n: int = 6) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens with their logprobs: a wrong state may leave decisive tokens alone, not their logprobs."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(n, logprobs=0), use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outs]


def _assert_same(ours, ref, tol: float = 1e-4) -> None:
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(ours, ref, strict=True):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < tol, (logprobs, ref_logprobs)


@pytest.mark.parametrize("mode", ["all", "align"])
def test_prefix_cache_snapshots_exact(mode, base_model):
    """KDA snapshots and MLA latent blocks (block size 4) resumed from on a second pass: the cold run's tokens and
    logprobs, with hits."""
    _, path = base_model
    shared = [(3 * j) % 290 + 5 for j in range(30)]
    prompts = [shared + [7, 8], shared[:13] + [9], shared + [7, 8, 11], shared[:22] + [250, 3]]
    with _llm(path, enable_prefix_caching=False, max_num_batched_tokens=16) as cold:
        ref = _scored(cold, prompts)
    with _llm(path, max_num_batched_tokens=16, block_size=4, enable_prefix_caching=True,
              mamba_cache_mode=mode) as llm:
        first = _scored(llm, prompts[:2])
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[2:]], _params(6, logprobs=0), use_tqdm=False)
        _assert_same(first, ref[:2])
        _assert_same([(o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                                                o.outputs[0].logprobs)])
                      for o in outs], ref[2:])
        assert min(o.num_cached_tokens for o in outs) >= 12  # really resumed from snapshots
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.cache.is_idle_and_full()


def test_preemption_recompute_gives_same_tokens(base_model):
    """Fewer KV blocks than the running sequences need: some are preempted and recomputed (state slots freed and
    re-zeroed), giving the tokens and logprobs of an engine with room for all."""
    _, path = base_model
    prompts = [[(5 * i + 11 * j) % 290 + 3 for j in range(20 + 3 * i)] for i in range(6)]
    kw = dict(max_num_batched_tokens=64, enable_prefix_caching=False)
    with _llm(path, **kw) as roomy:
        ref = _scored(roomy, prompts, 16)
    with _llm(path, num_gpu_blocks_override=8, max_num_seqs=6, **kw) as tight:
        assert_cache_sized(tight, 8, 6)
        _assert_same(_scored(tight, prompts, 16), ref)
        assert tight.llm_engine.stats["preemptions"] > 0
        tight.llm_engine.check_integrity()
        assert tight.llm_engine.cache.is_idle_and_full()


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
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0}),
     "rope_type 'yarn' is not supported"),
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
