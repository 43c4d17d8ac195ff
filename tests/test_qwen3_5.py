"""Qwen3.5 text models (Qwen3_5ForCausalLM dense, Qwen3_5MoeForCausalLM): greedy parity with transformers under
batched chunked prefill, teacher-forced logits through the real caches, prefix caching (mamba_cache_mode all /
align) and preemption by recompute, and the configs refused with a clear error. The decoder and the delta rule
are Qwen3-Next's (tests/test_qwen3_next.py tests the rule itself); this file tests what Qwen3.5 changes: the flat
delta-net projections, the dense / always-MoE feed-forwards, the 0.25 partial rotary, the checkpoint names."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
from transformers import (Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig,
                          Qwen3_5TextConfig)

from stateserve import LLM, SamplingParams
from utils import (assert_greedy_matches, build_hf_model, engine_teacher_forced_logits, hf_greedy, hf_logits,
                   save_model)

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
GREEDY = dict(temperature=0, ignore_eos=True)


def _build(tmp_path, arch: str = "dense", **extra):
    config_cls, model_cls, arch_cfg = ARCHS[arch]
    hf = build_hf_model(config_cls, model_cls, **{**BASE, **arch_cfg, **extra})
    with torch.no_grad():  # slow decay (A in [0.05, 1]) so the recurrent state carries across many tokens
        for layer in hf.model.layers:
            if layer.block_type == "linear_attention":
                n = layer.linear_attn.A_log.numel()
                layer.linear_attn.A_log.copy_(torch.linspace(math.log(0.05), 0.0, n))
    return hf, save_model(hf, str(tmp_path / f"qwen3_5_{arch}"))


def _generate(llm, prompts, max_tokens: int):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=max_tokens, **GREEDY))
    return outs


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_parity_chunked(arch, tmp_path):
    """Seven prompts at once, 16-token steps: prompts split across steps and batched with others' decodes."""
    hf, path = _build(tmp_path, arch)
    max_new = 10
    ref = hf_greedy(hf, PROMPTS, max_new)
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=16, enable_prefix_caching=False) as llm:
        outs = _generate(llm, PROMPTS, max_new)
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
def test_teacher_forced_logits(case, tmp_path):
    arch, extra, chunks = TF_CASES[case]
    hf, path = _build(tmp_path, arch, **extra)
    tokens = list(range(3, 80))  # 77 tokens: more than one 64-token delta-rule chunk
    ref = hf_logits(hf, tokens)
    with LLM(path, skip_tokenizer_init=True) as llm:
        for chunk in chunks:
            ours = engine_teacher_forced_logits(llm, tokens, chunk)
            torch.testing.assert_close(ours, ref, atol=5e-4, rtol=1e-4)


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
    with LLM(path, skip_tokenizer_init=True) as llm:
        torch.testing.assert_close(engine_teacher_forced_logits(llm, tokens, 7), hf_logits(hf, tokens),
                                   atol=5e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_prefix_cache_exact_with_hits(arch, tmp_path):
    """Recurrent snapshots at 16-token block boundaries (every boundary with "all", chunk ends with "align") and
    the paged KV together: the second pass over the same prompts resumes from them and gives the cold tokens."""
    _, path = _build(tmp_path, arch)
    shared = [(7 * j) % 290 + 3 for j in range(5 * 16 + 3)]
    prompts = [shared + [11, 12, 13], shared[:40] + [250, 3], shared + [9] * 20]
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=32, block_size=16,
             enable_prefix_caching=False) as cold:
        ref = [o.outputs[0].token_ids for o in _generate(cold, prompts, 8)]
    for mode in ("all", "align"):
        with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=32, block_size=16,
                 enable_prefix_caching=True, mamba_cache_mode=mode) as llm:
            first = [_generate(llm, [p], 8)[0] for p in prompts]
            again = [_generate(llm, [p], 8)[0] for p in prompts]
            assert [o.outputs[0].token_ids for o in first] == ref, mode
            assert [o.outputs[0].token_ids for o in again] == ref, mode
            assert all(o.num_cached_tokens >= 32 for o in again), (mode, [o.num_cached_tokens for o in again])
            if mode == "all":  # the third prompt shares 5 full blocks with the first
                assert first[2].num_cached_tokens == 5 * 16
            llm.llm_engine.check_integrity()
            assert llm.llm_engine.cache.is_idle_and_full()


def test_fused_expert_tensors_are_refused_by_name(tmp_path):
    """3-D fused expert tensors (experts.gate_up_proj) are not loadable here: the error names the tensor and the
    per-expert names that are."""
    from safetensors.torch import load_file, save_file

    _, path = _build(tmp_path, "moe", num_hidden_layers=1, layer_types=["linear_attention"])
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    prefix = "model.layers.0.mlp.experts."
    gate_up = torch.stack([torch.cat([tensors.pop(f"{prefix}{e}.gate_proj.weight"),
                                      tensors.pop(f"{prefix}{e}.up_proj.weight")]) for e in range(4)])
    tensors[prefix + "gate_up_proj"] = gate_up  # [E, 2I, H]
    tensors[prefix + "down_proj"] = torch.stack([tensors.pop(f"{prefix}{e}.down_proj.weight") for e in range(4)])
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"experts\.(gate_up|down)_proj. holds all experts fused.*per-expert"):
        LLM(path, skip_tokenizer_init=True)


# six prompts of 20-35 tokens, 20 new tokens each: every sequence needs three or four 16-token blocks
SIX_MIXED = [[(5 * i + 11 * j) % 290 + 3 for j in range(20 + 3 * i)] for i in range(6)]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_preemption_recompute_exact(arch, tmp_path):
    """8 KV blocks for six sequences that need 3-4 each: some are preempted, their state slots freed and
    re-zeroed, and recomputed; they give the tokens of an engine with room for all (see test_hybrid_cache.py)."""
    _, path = _build(tmp_path, arch)
    prompts = SIX_MIXED
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=64, enable_prefix_caching=False) as roomy:
        ref = [o.outputs[0].token_ids for o in _generate(roomy, prompts, 20)]
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=64, enable_prefix_caching=False,
             num_gpu_blocks_override=8, max_num_seqs=8) as tight:
        outs = [o.outputs[0].token_ids for o in _generate(tight, prompts, 20)]
        assert tight.llm_engine.stats["preemptions"] > 0
        assert outs == ref
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
    _, path = _build(tmp_path, "dense", num_hidden_layers=2)
    _edit_config(path, layer_types=["linear_attention", "sliding_attention"])
    with pytest.raises(ValueError, match=r"unknown layer type\(s\) \[.sliding_attention.\]"):
        LLM(path, skip_tokenizer_init=True)


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
        LLM(str(tmp_path), skip_tokenizer_init=True, load_format="dummy")
    with pytest.raises(ValueError, match="vision tower"):
        Ours.resolve_flags(cfg)
