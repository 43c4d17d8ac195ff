"""Jamba (Mamba1 + attention hybrid with MoE): greedy parity with transformers under chunked prefill, teacher-forced
logits through the real KV and state caches, layer-pattern config edges, and a checkpoint that loads name for
name. Preemption: test_hybrid_cache.py."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import JambaConfig, JambaForCausalLM

from stateserve import LLM, SamplingParams
from stateserve.models.jamba import JambaForCausalLM as OurJamba
from stateserve.models.loader import iterate_safetensors, load_weights
from state_checks import check_teacher_forced_logits
from utils import (assert_greedy_matches, build_hf_model, check_fused_experts_load, engine_teacher_forced_logits,
                   hf_greedy, hf_logits, save_model)

BASE = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
            expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4,
            mamba_expand=2, use_mamba_kernels=False, tie_word_embeddings=False, max_position_embeddings=512)
CASES = {
    # layers: mamba+MLP, attention+MoE, mamba+MLP, attention+MoE
    "default": {},
    # attention first (offset 0 of period 2), MoE on every layer, and the other mixer options
    "edge": dict(attn_layer_offset=0, expert_layer_period=1, expert_layer_offset=0, mamba_proj_bias=True,
                 mamba_conv_bias=False, mamba_dt_rank=5, mamba_d_conv=3, rms_norm_eps=1e-3),
}
PROMPTS = [[250], [7, 3, 2], list(range(20, 29)), list(range(100, 116)), list(range(40, 57)),
           [(17 * i) % 290 + 3 for i in range(40)]]


def _build(tmp_path, **extra):
    hf = build_hf_model(JambaConfig, JambaForCausalLM, **{**BASE, **extra})
    # transformers initialises D, the norms and the dt bias to constants; perturb them so that a mis-wired 1-D
    # parameter (say, b_layernorm and c_layernorm swapped) changes the output
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return hf, save_model(hf, str(tmp_path / "jamba"))


def test_layer_pattern_follows_config():
    """Our layer kinds are transformers' layers_block_type / layers_num_experts, for both cases."""
    for extra in CASES.values():
        cfg = JambaConfig(**{**BASE, **extra})
        ours = OurJamba(cfg, torch.float32)
        kinds = [layer.block_type for layer in ours.model.layers]
        assert kinds == cfg.layers_block_type
        moe = [type(layer.feed_forward).__name__ == "SparseMoE" for layer in ours.model.layers]
        assert moe == [n > 1 for n in cfg.layers_num_experts]
        assert OurJamba.resolve_flags(cfg) == (False, True)
    assert CASES["edge"]["attn_layer_offset"] == 0 and kinds == ["attention", "mamba", "attention", "mamba"]
    assert all(moe)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_parity_chunked(case, tmp_path):
    hf, path = _build(tmp_path, **CASES[case])
    max_new = 10
    ref = hf_greedy(hf, PROMPTS, max_new)
    # 16-token steps: the 40-token prompt takes three chunks, and prefill chunks share steps with decodes
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=16, enable_prefix_caching=False) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True))
        assert_greedy_matches([o.outputs[0].token_ids for o in outs], ref, hf, PROMPTS)
        # the runner planned paged KV for exactly the attention layers and state slots for the Mamba layers
        storage, kinds = llm.llm_engine.runner.caches.storage, hf.config.layers_block_type
        attn_layers = [i for i, t in enumerate(kinds) if t == "attention"]
        assert sorted(storage.kv) == [f"model.layers.{i}.self_attn.attn" for i in attn_layers]
        assert sorted(storage.states) == [f"model.layers.{i}.mamba" for i in range(len(kinds)) if i not in attn_layers]
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.cache.is_idle_and_full()


@pytest.mark.parametrize("case", list(CASES))
def test_teacher_forced_logits(case, tmp_path):
    hf, path = _build(tmp_path, **CASES[case])
    tokens = [(7 * i) % 290 + 3 for i in range(70)]  # 70 tokens: five KV blocks, chunks cross block edges
    ref = hf_logits(hf, tokens)
    # float32 throughout: only the scan's association order and the MoE sum order differ from
    # transformers (observed max error ~1e-4 on logits of magnitude ~15)
    check_teacher_forced_logits(path, ref, tokens, atol=5e-4, rtol=1e-4)


def test_no_attention_layer_is_attention_free(tmp_path):
    """A period longer than the stack leaves only Mamba layers: no KV cache is planned and it still matches."""
    hf, path = _build(tmp_path, num_hidden_layers=2, attn_layer_period=4, attn_layer_offset=3)
    assert OurJamba.resolve_flags(hf.config) == (True, False)
    tokens = list(range(3, 40))
    with LLM(path, skip_tokenizer_init=True) as llm:
        assert llm.llm_engine.model_config.is_attention_free
        with torch.no_grad():  # transformers' cache cannot count tokens without an attention layer
            ref = hf(torch.tensor([tokens]), use_cache=False).logits[0]
        torch.testing.assert_close(engine_teacher_forced_logits(llm, tokens, 9), ref, atol=5e-4, rtol=1e-4)


def test_checkpoint_names_load_one_to_one(tmp_path):
    """Every saved tensor maps onto a parameter (the strict loader checks coverage); expert matrices land in
    the rows of their expert, gate before up."""
    hf, path = _build(tmp_path)
    ours = OurJamba(hf.config, torch.float32)
    load_weights(ours, iterate_safetensors(path, show_progress=False))
    saved = load_file(f"{path}/model.safetensors")
    moe = ours.model.layers[1].feed_forward
    gate_up = moe.experts_gate_up.view(4, 2, 64, 32)
    for e in range(4):
        torch.testing.assert_close(gate_up[e, 0], saved[f"model.layers.1.feed_forward.experts.{e}.gate_proj.weight"])
        torch.testing.assert_close(gate_up[e, 1], saved[f"model.layers.1.feed_forward.experts.{e}.up_proj.weight"])
    torch.testing.assert_close(ours.model.layers[0].mamba.b_layernorm.weight,
                               saved["model.layers.0.mamba.b_layernorm.weight"])


def test_unsupported_mamba_activation_is_rejected():
    with pytest.raises(ValueError, match="hidden_act"):
        OurJamba(JambaConfig(**{**BASE, "hidden_act": "gelu"}), torch.float32)


def test_fused_expert_tensors_load(tmp_path):
    """transformers' in-memory layout (save_pretrained(save_original_format=False), as some hub checkpoints store
    it: feed_forward.experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) loads, the experts split per
    expert: the same logits as the per-expert checkpoint, and as transformers."""
    hf, path = _build(tmp_path)
    check_fused_experts_load(hf, path, str(tmp_path / "fused"),
                             list(range(3, 80)))
