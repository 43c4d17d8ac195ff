"""Zamba2 (Mamba2 layers + shared transformer blocks reused at several depths, per-depth LoRA adapters): greedy
parity with transformers under chunked prefill, teacher-forced logits through the real caches, one KV cache per
use-depth of a shared block, and weight-name mapping. Preemption and prefix-cache snapshots:
test_hybrid_cache.py."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import Zamba2Config, Zamba2ForCausalLM

from stateserve import LLM, SamplingParams
from stateserve.model_states.mamba_hybrid import MambaHybridModelState
from stateserve.models.zamba2 import Zamba2ForCausalLM as Ours
from state_checks import check_teacher_forced_logits
from utils import (assert_greedy_matches, build_hf_model, engine_teacher_forced_logits, hf_greedy, hf_logits,
                   save_model)

# Four layers, hybrid at 1, 2, 3; two shared blocks: block 0 at depths 0 and 2 (layers 1 and 3), block 1 at
# depth 1 (layer 2). Adapters on q/k/v and gate_up make the two uses of block 0 differ. transformers shares a
# block's weights across its depths only with tie_word_embeddings (its weight tying is gated on that flag), so
# the shared cases tie the embeddings; the untied case checks that every depth then has its own copy.
BASE = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            layers_block_type=["mamba", "hybrid", "hybrid", "hybrid"], num_attention_heads=4,
            num_key_value_heads=4, n_mamba_heads=4, mamba_d_state=16, mamba_ngroups=2, chunk_size=8,
            num_mem_blocks=2, use_shared_attention_adapter=True, adapter_rank=4, use_mem_rope=True,
            max_position_embeddings=256, tie_word_embeddings=True,
            # 0.15 rather than 0.3: at 0.3 transformers' own float32 logits are 2e-3 away from float64 on this tiny
            # model (the gated norms of the small Mamba outputs amplify rounding); at 0.15 they are 3e-5 away
            initializer_range=0.15)
CASES = {
    "two_blocks_adapters_rope": {},
    # one block at every depth, grouped kv heads, no rotary or q/k/v adapters, biases, a hybrid layer first
    "one_block_gqa_bias": dict(num_mem_blocks=1, num_key_value_heads=2, use_shared_attention_adapter=False,
                               use_mem_rope=False, add_bias_linear=True, mamba_ngroups=1, hidden_act="silu",
                               layers_block_type=["hybrid", "mamba", "hybrid", "hybrid"]),
    # untied: layers 1 and 3 use block 0's adapter slots but have their own weights
    "untied_per_depth_weights": dict(tie_word_embeddings=False),
}
PROMPTS = [[1, 5, 9], list(range(7, 26)), list(range(100, 140)), [250], list(range(40, 52))]


def _build(tmp_path, name: str = "zamba2", **extra):
    hf = build_hf_model(Zamba2Config, Zamba2ForCausalLM, **{**BASE, **extra})
    with torch.no_grad():  # decays spread over [0.05, 1] so the Mamba state carries across many tokens
        for mixer in (m for m in hf.modules() if type(m).__name__ == "Zamba2MambaMixer"):
            mixer.A_log.copy_(torch.linspace(math.log(0.05), 0.0, mixer.num_heads))
    return hf, save_model(hf, str(tmp_path / name))


def _params(max_new: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("case", ["two_blocks_adapters_rope", "one_block_gqa_bias"])
def test_greedy_parity_chunked(case, tmp_path):
    hf, path = _build(tmp_path, **CASES[case])
    ref = hf_greedy(hf, PROMPTS, 10)
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=16, enable_prefix_caching=False) as llm:
        assert isinstance(llm.llm_engine.runner.model_state, MambaHybridModelState)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(10))
        assert_greedy_matches([o.outputs[0].token_ids for o in outs], ref, hf, PROMPTS)
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.cache.is_idle_and_full()


@pytest.mark.parametrize("case", ["two_blocks_adapters_rope", "untied_per_depth_weights"])
def test_teacher_forced_logits(case, tmp_path):
    hf, path = _build(tmp_path, **CASES[case])
    tokens = list(range(3, 70))  # 67 tokens: many 8-token scan chunks, several KV blocks
    # float32 throughout: only summation order differs (scan chunking, SDPA vs eager attention)
    check_teacher_forced_logits(path, hf_logits(hf, tokens), tokens, atol=2e-4)


def test_decode_clamps_dt_like_prefill(tmp_path):
    """Zamba2's time_step_limit is (time_step_min, inf) and it binds in this model. transformers clamps dt in its
    chunked (prefill) path but not in its single-token path, so its own incremental logits differ from its full
    forward. We clamp on every path (clamp_dt_on_decode=True): decode steps then equal transformers' forward,
    whatever way the steps were batched; clamp_dt_on_decode=False would reproduce its single-token arithmetic
    instead, but only in decode-only steps (a decode batched with prefill chunks takes the clamped path)."""
    from transformers import DynamicCache

    from stateserve.layers.mamba2_mixer import Mamba2Mixer
    hf, path = _build(tmp_path)
    tokens = list(range(3, 33))
    full = hf_logits(hf, tokens)
    incremental, cache = [], DynamicCache(config=hf.config)
    with torch.no_grad():
        for tok in tokens:
            out = hf(torch.tensor([[tok]]), cache=cache, use_cache=True)
            incremental.append(out.logits[0, -1].float())
    incremental = torch.stack(incremental)
    assert (incremental - full).abs().max() > 1e-3  # the clamp binds: the two transformers paths disagree
    with LLM(path, skip_tokenizer_init=True) as llm:
        mixers = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, Mamba2Mixer)]
        assert all(m.clamp_dt_on_decode and m.time_step_limit == (1e-3, math.inf) for m in mixers)
        torch.testing.assert_close(engine_teacher_forced_logits(llm, tokens, 1), full, atol=2e-4, rtol=1e-4)
        for m in mixers:
            m.clamp_dt_on_decode = False
        torch.testing.assert_close(engine_teacher_forced_logits(llm, tokens, 1), incremental, atol=2e-4, rtol=1e-4)


def test_each_depth_has_its_own_kv_cache(tmp_path):
    hf, path = _build(tmp_path)
    with LLM(path, skip_tokenizer_init=True) as llm:
        runner = llm.llm_engine.runner
        assert sorted(runner.caches.storage.kv) == ["model.layers.1.attn", "model.layers.2.attn", "model.layers.3.attn"]
        layers = runner.model.model.layers
        assert layers[1].shared_transformer is layers[3].shared_transformer  # block 0's weights, used twice
        assert layers[2].shared_transformer is not layers[1].shared_transformer
        assert layers[1].attn is not layers[3].attn
        engine_teacher_forced_logits(llm, list(range(3, 40)), 64)
        k1, k3 = runner.caches.storage.kv["model.layers.1.attn"][0], runner.caches.storage.kv["model.layers.3.attn"][0]
        assert k1.abs().sum() > 0 and k3.abs().sum() > 0 and not torch.allclose(k1, k3)
        # no weight stored twice: parameters are those of 2 blocks, not 3 uses
        shared = {n for n, _ in runner.model.named_parameters() if ".shared_transformer." in n}
        assert {n.split(".")[2] for n in shared} == {"1", "2"}


def test_weight_names_flags_and_config_checks():
    cfg = Zamba2Config(**BASE)
    ours = Ours(cfg, torch.float32)
    params = set(dict(ours.named_parameters()))
    hf_names = list(Zamba2ForCausalLM(cfg).state_dict())
    mapped = [ours.map_weight_name(n) for n in hf_names]
    assert {target[0] for target in mapped if target is not None} - set(ours.tied_params) == params
    # layer 3 re-uses block 0, stored under layer 1: its copies are skipped, layer 2's (block 1) are not
    assert ours.map_weight_name("model.layers.3.shared_transformer.self_attn.o_proj.weight") is None
    assert ours.map_weight_name("model.layers.2.shared_transformer.self_attn.q_proj.weight") == \
        ("model.layers.2.shared_transformer.self_attn.qkv_proj.weight", 0)
    assert "model.layers.1.shared_transformer.self_attn.linear_q_adapter_list.2.1.weight" in params
    assert Ours.resolve_flags(cfg) == (False, True)
    assert Ours.resolve_flags(Zamba2Config(**{**BASE, "layers_block_type": ["mamba"] * 4})) == (True, False)
    # untied: every depth has and loads its own block, nothing is skipped
    untied = Ours(Zamba2Config(**{**BASE, "tie_word_embeddings": False}), torch.float32)
    assert untied.map_weight_name("model.layers.3.shared_transformer.self_attn.o_proj.weight") == \
        ("model.layers.3.shared_transformer.self_attn.o_proj.weight", None)
    for field, value, message in [("layers_block_type", ["mamba", "hybrid", "moe", "mamba"], "layers"),
                                  ("num_key_value_heads", 2, "grouped kv heads"),
                                  ("use_shared_mlp_adapter", False, "use_shared_mlp_adapter")]:
        bad = Zamba2Config(**BASE)
        setattr(bad, field, value)
        with pytest.raises(ValueError, match=message):
            Ours(bad, torch.float32)
