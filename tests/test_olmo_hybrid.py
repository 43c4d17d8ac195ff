"""OLMo Hybrid (OlmoHybridForCausalLM): greedy parity with transformers under batched chunked prefill,
teacher-forced logits through the real caches (RoPE and NoPE, beta in [0, 2] and [0, 1]; bfloat16), prefix caching
(mamba_cache_mode all / align, logprobs compared) and preemption by recompute, and bad configs refused with a clear
error. The delta rule itself is tested in tests/test_qwen3_next.py; this file tests what OLMo Hybrid changes: the six
separate delta-net projections, beta's scale, the 1e-5 gated norm, full-width q/k norms, the post-norm attention
layers."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
from transformers import OlmoHybridConfig, OlmoHybridForCausalLM

from stateserve.models.loader import iterate_safetensors, load_weights
from stateserve.models.olmo_hybrid import OlmoHybridForCausalLM as Ours
from state_checks import (check_bfloat16_logits, check_preemption_exact, check_prefix_cache_one_by_one,
                          check_teacher_forced_logits, greedy_params, small_llm)
from utils import (assert_greedy_matches, build_hf_model, engine_teacher_forced_logits, hf_greedy, hf_logits,
                   save_model)

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=12,
            # value_dim == key_dim (24): transformers' three equal conv parts are the real shards (see olmo_hybrid.py)
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
    with small_llm(path, max_num_batched_tokens=16, enable_prefix_caching=False) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy_params(10), use_tqdm=False)
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
    with small_llm(path) as llm:
        for chunk in chunks:
            torch.testing.assert_close(engine_teacher_forced_logits(llm, tokens, chunk), ref, atol=5e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", ["transformers", "real-shards"])
def test_unequal_conv_parts_load(layout, built, tmp_path):
    """value_dim (4 heads x 10) != key_dim (2 x 12): transformers saves the fused 88-channel conv as equal-ish thirds
    (torch.chunk: 30, 30, 28), not the [24, 24, 40] q/k/v shards; OLMo-core's files hold the real shards. Both load
    (the parts re-cut on load): greedy tokens and teacher-forced logits as transformers."""
    from safetensors.torch import load_file, save_file

    hf, path = built("unequal", linear_value_head_dim=10)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    names = [f"model.layers.0.linear_attn.{p}_conv1d.weight" for p in "qkv"]
    assert [tensors[n].shape[0] for n in names] == [30, 30, 28]  # what the case is for: parts that are not shards
    if layout == "real-shards":
        for i in (0, 2):
            prefix = f"model.layers.{i}.linear_attn."
            fused = torch.cat([tensors[f"{prefix}{p}_conv1d.weight"] for p in "qkv"])
            for p, part in zip("qkv", fused.split([24, 24, 40])):
                tensors[f"{prefix}{p}_conv1d.weight"] = part.clone()
        path = str(tmp_path / "real")
        os.makedirs(path)
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        hf.config.save_pretrained(path)
    tokens = list(range(3, 80))
    ref = hf_logits(hf, tokens)
    with small_llm(path, max_num_batched_tokens=16, enable_prefix_caching=False) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy_params(10), use_tqdm=False)
        assert_greedy_matches([o.outputs[0].token_ids for o in outs], hf_greedy(hf, PROMPTS, 10), hf, PROMPTS,
                              tol=1e-3)
    check_teacher_forced_logits(path, ref, tokens, atol=5e-4)


def test_bfloat16_logits(built):
    """One whole-prompt step, resumed 7-token steps and token by token (the decode conv and recurrence) beside
    transformers' bfloat16 (tolerance derived in check_bfloat16_logits)."""
    hf, path = built()
    check_bfloat16_logits(hf, path, list(range(3, 80)), (77, 7, 1))


@pytest.mark.parametrize("mode", ["all", "align"])
def test_prefix_cache_exact_with_hits(mode, built):
    """Recurrent snapshots at 16-token block boundaries (every boundary with "all", chunk ends with "align") and
    the paged KV together, prompts past one 64-token delta-rule chunk: the second pass resumes from them and gives
    the cold tokens and logprobs."""
    shared = [(7 * j) % 290 + 3 for j in range(5 * 16 + 3)]
    prompts = [shared + [11, 12, 13], shared[:40] + [250, 3], shared + [9] * 20]
    _, again = check_prefix_cache_one_by_one(built()[1], mode, prompts, rounds=2, n=8, block_size=16,
                                             max_num_batched_tokens=32)
    assert min(again) >= 32, again


def test_preemption_recompute_exact(built):
    check_preemption_exact(built()[1], 20)


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
        small_llm(path)


def test_bad_head_layout_is_refused():
    cfg = OlmoHybridConfig(**{**BASE, "linear_num_value_heads": 3})
    with pytest.raises(ValueError, match=r"linear_num_value_heads=3 is not a multiple of linear_num_key_heads=2"):
        Ours(cfg, torch.float32)
