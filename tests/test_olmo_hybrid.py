"""OLMo Hybrid (OlmoHybridForCausalLM): greedy parity with transformers under batched chunked prefill,
teacher-forced logits through the real caches (RoPE and NoPE, beta in [0, 2] and [0, 1]), prefix caching
(mamba_cache_mode all / align, logprobs compared) and preemption by recompute, and bad configs refused with a clear error. The delta
rule itself is tested in tests/test_qwen3_next.py; this file tests what OLMo Hybrid changes: the six separate
delta-net projections, beta's scale, the 1e-5 gated norm, full-width q/k norms, the post-norm attention layers."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
from transformers import OlmoHybridConfig, OlmoHybridForCausalLM

from stateserve import LLM, SamplingParams
from stateserve.models.loader import iterate_safetensors, load_weights
from stateserve.models.olmo_hybrid import OlmoHybridForCausalLM as Ours
from utils import (assert_greedy_matches, build_hf_model, engine_teacher_forced_logits, hf_greedy, hf_logits,
                   save_model)

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=12,
            # value_dim == key_dim (24): transformers saves the fused conv as three equal parts (see olmo_hybrid.py)
            linear_value_head_dim=6, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            tie_word_embeddings=False, max_position_embeddings=256, pad_token_id=0, eos_token_id=1,
            # as in test_qwen3_5.py: larger weights make the gated norm of near-zero delta-net outputs amplify
            # float32 rounding in transformers' own result past round-off
            initializer_range=0.15)
PROMPTS = [list(range(5, 5 + n)) for n in (1, 3, 9, 16, 17, 40)] + [[250, 7, 11]]


def _build(tmp_path, name: str = "olmo_hybrid", **extra):
    hf = build_hf_model(OlmoHybridConfig, OlmoHybridForCausalLM, **{**BASE, **extra})
    with torch.no_grad():  # slow decay (A in [0.05, 1]) so the recurrent state carries across many tokens
        for i, t in enumerate(hf.config.layer_types):
            if t == "linear_attention":
                net = hf.model.layers[i].linear_attn
                net.A_log.copy_(torch.linspace(math.log(0.05), 0.0, net.A_log.numel()))
    return hf, save_model(hf, str(tmp_path / name))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = {}

    def get(name: str = "base", **extra):
        if name not in cache:
            cache[name] = _build(tmp_path_factory.mktemp(name), **extra)
        return cache[name]
    return get


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=0)


def _scored(llm: LLM, prompts, n: int = 8) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens with their logprobs: a slightly wrong state may leave decisive tokens alone, not logprobs."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(n), use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outs]


def _assert_same(ours, ref, tol: float = 1e-4) -> None:
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(ours, ref, strict=True):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < tol, (logprobs, ref_logprobs)


def test_weight_names_load_one_to_one(built):
    hf, path = built()
    ours = Ours(hf.config, torch.float32)
    names = [n for n, _ in iterate_safetensors(path, show_progress=False)]
    assert {ours.map_weight_name(n)[0] for n in names} == set(dict(ours.named_parameters()))
    load_weights(ours, iterate_safetensors(path, show_progress=False))  # strict: every tensor lands, none missing


def test_greedy_parity_chunked(built):
    """Seven prompts at once, 16-token steps: prompts split across steps and batched with others' decodes."""
    hf, path = built()
    ref = hf_greedy(hf, PROMPTS, 10)
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=16, enable_prefix_caching=False) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy(10), use_tqdm=False)
        assert_greedy_matches([o.outputs[0].token_ids for o in outs], ref, hf, PROMPTS, tol=1e-3)
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.cache.is_idle_and_full()


# name -> (config changes, the chunk sizes the 77 tokens are fed in: token by token runs the decode path)
TF_CASES = {
    "rope": ({}, (1, 7, 64)),
    # released checkpoints: no rotary at all; beta in [0, 1]; q/k/v/o biases; one value head per key head; tied
    "nope-variants": (dict(rope_parameters={"rope_type": "default", "rope_theta": None},
                           linear_allow_neg_eigval=False, attention_bias=True, linear_num_value_heads=2,
                           linear_value_head_dim=12, tie_word_embeddings=True,
                           layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"]),
                      (5, 64)),
}


@pytest.mark.parametrize("case", list(TF_CASES))
def test_teacher_forced_logits(case, built):
    extra, chunks = TF_CASES[case]
    hf, path = built(case, **extra)
    if case == "nope-variants":
        assert hf.model.rotary_emb is None  # what the case is for: transformers runs NoPE
    tokens = list(range(3, 80))  # 77 tokens: more than one 64-token delta-rule chunk
    ref = hf_logits(hf, tokens)
    with LLM(path, skip_tokenizer_init=True) as llm:
        for chunk in chunks:
            torch.testing.assert_close(engine_teacher_forced_logits(llm, tokens, chunk), ref, atol=5e-4, rtol=1e-4)


def test_prefix_cache_exact_with_hits(built):
    """Recurrent snapshots at 16-token block boundaries (every boundary with "all", chunk ends with "align") and
    the paged KV together: the second pass resumes from them and gives the cold tokens and logprobs."""
    _, path = built()
    shared = [(7 * j) % 290 + 3 for j in range(5 * 16 + 3)]
    prompts = [shared + [11, 12, 13], shared[:40] + [250, 3], shared + [9] * 20]
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=32, block_size=16,
             enable_prefix_caching=False) as cold:
        ref = _scored(cold, prompts)
    for mode in ("all", "align"):
        with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=32, block_size=16,
                 enable_prefix_caching=True, mamba_cache_mode=mode) as llm:
            first = [_scored(llm, [p])[0] for p in prompts]
            params = _greedy(8)
            again = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
            _assert_same(first, ref)
            _assert_same([(o.outputs[0].token_ids, [lp[t].logprob for t, lp in
                                                    zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
                          for o in again], ref)
            assert all(o.num_cached_tokens >= 32 for o in again), (mode, [o.num_cached_tokens for o in again])
            llm.llm_engine.check_integrity()
            assert llm.llm_engine.cache.is_idle_and_full()


# six prompts of 20-35 tokens, 20 new tokens each: every sequence needs three or four 16-token blocks
SIX_MIXED = [[(5 * i + 11 * j) % 290 + 3 for j in range(20 + 3 * i)] for i in range(6)]


def test_preemption_recompute_exact(built):
    """8 KV blocks for six sequences that need 3-4 each: some are preempted, their state slots freed and
    re-zeroed, and recomputed; they give the tokens and logprobs of an engine with room for all."""
    _, path = built()
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=64, enable_prefix_caching=False) as roomy:
        ref = _scored(roomy, SIX_MIXED, 20)
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=64, enable_prefix_caching=False,
             num_gpu_blocks_override=8, max_num_seqs=8) as tight:
        outs = _scored(tight, SIX_MIXED, 20)
        assert tight.llm_engine.stats["preemptions"] > 0
        _assert_same(outs, ref)
        tight.llm_engine.check_integrity()
        assert tight.llm_engine.cache.is_idle_and_full()


def _edit_config(path: str, **changes) -> None:
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(file, "w") as f:
        json.dump(cfg, f)


def test_unknown_layer_type_is_refused(tmp_path):
    _, path = _build(tmp_path, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    _edit_config(path, layer_types=["linear_attention", "sliding_attention"])
    with pytest.raises(ValueError, match=r"unknown layer type\(s\) \[.sliding_attention.\]"):
        LLM(path, skip_tokenizer_init=True)


def test_bad_head_layout_is_refused():
    cfg = OlmoHybridConfig(**{**BASE, "linear_num_value_heads": 3})
    with pytest.raises(ValueError, match=r"linear_num_value_heads=3 is not a multiple of linear_num_key_heads=2"):
        Ours(cfg, torch.float32)
