"""Qwen3.5 text models (Qwen3_5ForCausalLM dense, Qwen3_5MoeForCausalLM): greedy parity with transformers under batched
chunked prefill, teacher-forced logits through the real caches (float32 and bfloat16), prefix caching
(mamba_cache_mode all / align) and preemption by recompute, and the configs refused with a clear error. The decoder
and the delta rule are Qwen3-Next's (tests/test_qwen3_next.py tests the rule itself); this file tests what Qwen3.5
changes: the flat delta-net projections, the dense / always-MoE feed-forwards, the 0.25 partial rotary, the
checkpoint names."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
from transformers import (Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig,
                          Qwen3_5TextConfig)

from state_checks import (check_bfloat16_logits, check_preemption_exact, check_prefix_cache_one_by_one,
                          check_routing_decisive, greedy_params, make_routing_decisive, small_llm)
from utils import (assert_greedy_matches, build_hf_model, check_fused_experts_load, engine_teacher_forced_logits,
                   hf_greedy, hf_logits, save_model)

BASE = dict(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=12, linear_conv_kernel_dim=4, full_attention_interval=2,
            tie_word_embeddings=False, max_position_embeddings=256,
            # as in test_qwen3_next.py: at 0.3 the gated norm of near-zero delta-net outputs amplifies float32
            # rounding in transformers' own result past float32 round-off
            initializer_range=0.15)
ARCHS = {
    "dense": (Qwen3_5TextConfig, Qwen3_5ForCausalLM, dict(intermediate_size=96)),
    "moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM,
            dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)),
}
PROMPTS = [list(range(5, 5 + n)) for n in (1, 3, 9, 16, 17, 40)] + [[250, 7, 11]]


def _build(tmp_path, arch: str = "dense", **extra):
    config_cls, model_cls, arch_cfg = ARCHS[arch]
    hf = build_hf_model(config_cls, model_cls, **{**BASE, **arch_cfg, **extra})
    with torch.no_grad():  # slow decay (A in [0.05, 1]) so the recurrent state carries across many tokens
        for layer in hf.model.layers:
            if layer.block_type == "linear_attention":
                n = layer.linear_attn.A_log.numel()
                layer.linear_attn.A_log.copy_(torch.linspace(math.log(0.05), 0.0, n))
    return hf, save_model(hf, str(tmp_path / f"qwen3_5_{arch}"))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = {}

    def get(name: str = "dense", arch: str = "dense", **extra):
        if name not in cache:
            cache[name] = _build(tmp_path_factory.mktemp(name), arch, **extra)
        return cache[name]
    return get


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_parity_chunked(arch, built):
    """Seven prompts at once, 16-token steps: prompts split across steps and batched with others' decodes."""
    hf, path = built(arch, arch)
    max_new = 10
    ref = hf_greedy(hf, PROMPTS, max_new)
    with small_llm(path, max_num_batched_tokens=16, enable_prefix_caching=False) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy_params(max_new), use_tqdm=False)
        assert_greedy_matches([o.outputs[0].token_ids for o in outs], ref, hf, PROMPTS, tol=1e-3)
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.cache.is_idle_and_full()


# (arch, config, the chunk sizes the 77 tokens are fed in: token by token runs the decode path)
TF_CASES = {
    "dense": ("dense", {}, (1, 7, 64)),
    "moe": ("moe", {}, (1, 13, 64)),
    # explicit layer_types, half rotary, q/k/v/o biases, one value head per key head, tied embeddings
    "dense-variants": ("dense", dict(layer_types=["full_attention", "linear_attention", "linear_attention",
                                                  "full_attention"],
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                      "partial_rotary_factor": 0.5},
                                     linear_num_value_heads=2, attention_bias=True, tie_word_embeddings=True),
                       (5, 64)),
}


@pytest.mark.parametrize("case", list(TF_CASES))
def test_teacher_forced_logits(case, built):
    arch, extra, chunks = TF_CASES[case]
    hf, path = built(case, arch, **extra)
    tokens = list(range(3, 80))  # 77 tokens: more than one 64-token delta-rule chunk
    ref = hf_logits(hf, tokens)
    with small_llm(path) as llm:
        for chunk in chunks:
            ours = engine_teacher_forced_logits(llm, tokens, chunk)
            torch.testing.assert_close(ours, ref, atol=5e-4, rtol=1e-4)


def test_bfloat16_logits(built):
    """Dense only (MoE: bfloat16 flips near-tied expert choices, transformers' own by up to 5.5 on a logit against
    float32 math on the same weights). One whole-prompt step, resumed 7-token steps and token by token (the decode
    conv and recurrence) beside transformers' bfloat16 (tolerance derived in check_bfloat16_logits)."""
    hf, path = built("dense")
    check_bfloat16_logits(hf, path, list(range(3, 80)), (77, 7, 1))


def test_bfloat16_logits_moe(tmp_path):
    """Qwen3_5MoeForCausalLM as test_bfloat16_logits, its routing made decisive first (make_routing_decisive,
    margin checked) and initializer_range 0.1 (at 0.15 the largest error reaches the 0.5 bound on both sides)."""
    hf, _ = _build(tmp_path, "moe", initializer_range=0.1)
    make_routing_decisive(hf)
    tokens = list(range(3, 80))
    check_routing_decisive(hf, tokens)
    check_bfloat16_logits(hf, save_model(hf, str(tmp_path / "decisive")), tokens, (77, 7, 1))


def test_language_model_prefix_is_accepted(tmp_path):
    """Vision-language checkpoints keep the text model under model.language_model. (plus model.visual.* and
    mtp.* tensors, which are skipped): the same weights under those names give the same logits."""
    from safetensors.torch import load_file, save_file

    hf, path = _build(tmp_path, "moe", num_hidden_layers=2)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    renamed = {(k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
               for k, v in tensors.items()}
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    renamed["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(renamed, file, metadata={"format": "pt"})
    tokens = list(range(3, 30))
    with small_llm(path) as llm:
        torch.testing.assert_close(engine_teacher_forced_logits(llm, tokens, 7), hf_logits(hf, tokens),
                                   atol=5e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["all", "align"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_prefix_cache_exact_with_hits(arch, mode, built):
    """Recurrent snapshots at 16-token block boundaries (every boundary with "all", chunk ends with "align") and
    the paged KV together, prompts past one 64-token delta-rule chunk: the second pass over the same prompts
    resumes from them and gives the cold tokens and logprobs."""
    shared = [(7 * j) % 290 + 3 for j in range(5 * 16 + 3)]
    prompts = [shared + [11, 12, 13], shared[:40] + [250, 3], shared + [9] * 20]
    first, again = check_prefix_cache_one_by_one(built(arch, arch)[1], mode, prompts, rounds=2, n=8, block_size=16,
                                                 max_num_batched_tokens=32)
    assert min(again) >= 32, again
    if mode == "all":  # the third prompt shares 5 full blocks with the first
        assert first[2] == 5 * 16


def test_fused_expert_tensors_load(tmp_path):
    """transformers' in-memory expert layout (3-D experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I],
    as save_pretrained(save_original_format=False) and some hub checkpoints write it) loads, split per expert:
    the same logits as the per-expert checkpoint, and as transformers."""
    hf, path = _build(tmp_path, "moe")
    check_fused_experts_load(hf, path, str(tmp_path / "fused"), list(range(3, 80)))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_preemption_recompute_exact(arch, built):
    check_preemption_exact(built(arch, arch)[1], 20)


def _edit_config(path: str, **changes) -> None:
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(file, "w") as f:
        json.dump(cfg, f)


def test_unknown_layer_type_is_refused(tmp_path):
    _, path = _build(tmp_path, "dense", num_hidden_layers=2)
    _edit_config(path, layer_types=["linear_attention", "sliding_attention"])
    with pytest.raises(ValueError, match=r"unknown layer type\(s\) \[.sliding_attention.\]"):
        small_llm(path)


@pytest.mark.parametrize("arch", ["Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"])
def test_vision_language_config_is_refused(arch, tmp_path):
    """The composite config (text_config + vision_config) is refused naming the vision tower, whether it says
    it is the vision-language architecture or (hand-edited) the causal LM."""
    from stateserve.models.qwen3_5 import Qwen3_5ForCausalLM as Ours

    text = {**BASE, **ARCHS["dense"][2], "initializer_range": 0.02}
    cfg = Qwen3_5Config(text_config=text, vision_config=dict(depth=1, hidden_size=16, num_heads=2,
                                                             intermediate_size=32, out_hidden_size=64))
    cfg.architectures = [arch]
    cfg.save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="vision_config"):
        small_llm(str(tmp_path), load_format="dummy")
    with pytest.raises(ValueError, match="vision tower"):
        Ours.resolve_flags(cfg)
