"""Kimi Linear (Kimi Delta Attention + MLA + MoE): greedy parity with transformers under batched chunked prefill,
teacher-forced logits through the real caches (float32 and bfloat16), the chunked KDA rule against the token
recurrence (and its snapshots), prefix caching with mamba_cache_mode all / align, preemption by recompute, and bad
configs' errors."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import KimiLinearConfig, KimiLinearForCausalLM
from transformers.models.kimi_linear.modeling_kimi_linear import recurrent_kimi_delta_attention

from stateserve.layers.delta_rule import l2norm
from stateserve.layers.kda import chunk_kda_rule
from utils import (assert_greedy_matches, build_hf_model, check_fused_experts_load, hf_greedy, hf_logits, save_model)
from state_checks import (check_bfloat16_logits, check_preemption_exact, check_prefix_cache_exact,
                          check_routing_decisive, check_speculative_rollback_exact, check_teacher_forced_logits,
                          greedy_params, make_routing_decisive, small_llm)
BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=12, num_local_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
            routed_scaling_factor=1.5, linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            pad_token_id=2, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, initializer_range=0.15)
CASES = {
    "base": {},
    # the low-rank q path, attention bias, V wider than q.k heads, no top-k renormalisation, two dense layers
    "variants": dict(q_lora_rank=24, attention_bias=True, v_head_dim=20, norm_topk_prob=False, n_group=1,
                     mlp_layer_types=["dense", "sparse", "dense", "sparse"],
                     layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"]),
}
PROMPTS = [list(range(5, 5 + n)) for n in (1, 9, 17, 40)] + [[250, 7, 11]]


def _build(tmp_path, **extra):
    hf = build_hf_model(KimiLinearConfig, KimiLinearForCausalLM, **{**BASE, **extra})
    with torch.no_grad():  # slow decay (A in [0.05, 1]) so the recurrent state carries across many tokens
        for layer in hf.model.layers:
            if layer.block_type == "linear_attention":
                gate = layer.self_attn.forget_gate
                gate.A_log.copy_(torch.linspace(math.log(0.05), 0.0, gate.A_log.numel()).view_as(gate.A_log))
    return hf, save_model(hf, str(tmp_path / "kimi_linear"))


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_parity_chunked(case, tmp_path):
    hf, path = _build(tmp_path, **CASES[case])
    ref = hf_greedy(hf, PROMPTS, 10)
    with small_llm(path, max_num_batched_tokens=16, enable_prefix_caching=False) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy_params(10))
        assert_greedy_matches([o.outputs[0].token_ids for o in outs], ref, hf, PROMPTS, tol=1e-3)
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.cache.is_idle_and_full()


@pytest.mark.parametrize("case", list(CASES))
def test_teacher_forced_logits(case, tmp_path):
    hf, path = _build(tmp_path, **CASES[case])
    tokens = list(range(3, 80))  # 77 tokens: more than one 64-token KDA chunk
    ref = hf_logits(hf, tokens)
    check_teacher_forced_logits(path, ref, tokens, atol=5e-4)


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("kimi"))


def test_bfloat16_logits(tmp_path):
    """One whole-prompt step, resumed 7-token steps and token by token (the decode conv and KDA recurrence) beside
    transformers' bfloat16 (tolerance derived in check_bfloat16_logits), on the base model with its grouped routing
    made decisive (as built, no token's choice flipped here, but by luck: choices move under 2% noise)."""
    hf, _ = _build(tmp_path)
    make_routing_decisive(hf)
    tokens = list(range(3, 80))
    check_routing_decisive(hf, tokens)
    check_bfloat16_logits(hf, save_model(hf, str(tmp_path / "decisive")), tokens, (77, 7, 1))


def _random_inputs(L: int, H: int = 3, Dk: int = 8, Dv: int = 5, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(L, H, Dk, generator=gen)) * Dk ** -0.5
    k = l2norm(torch.randn(L, H, Dk, generator=gen))
    v = torch.randn(L, H, Dv, generator=gen)
    # per-channel log decays: most slow, some channels fast (-4 a token: exp(-cum) of a 64-token chunk would
    # overflow float32, so the chunked form must not factor the decay that way)
    g = -torch.rand(L, H, Dk, generator=gen) * 0.3
    g[..., 0] = -4.0
    beta = torch.rand(L, H, generator=gen)
    s0 = torch.randn(H, Dk, Dv, generator=gen)
    return q, k, v, g, beta, s0


def _recurrence(q, k, v, g, beta, s0):
    # transformers' token-by-token reference takes [B, L, H, D] and scales q itself: undo our scaling
    out, state = recurrent_kimi_delta_attention(
        (q * q.shape[-1] ** 0.5)[None], k[None], v[None], g[None], beta[None], initial_state=s0[None],
        output_final_state=True)
    return out[0], state[0]


@pytest.mark.parametrize("L,chunk", [(1, 64), (37, 8), (130, 64)])
def test_chunked_kda_rule_matches_token_recurrence(L, chunk):
    q, k, v, g, beta, s0 = _random_inputs(L)
    ref_out, ref_state = _recurrence(q, k, v, g, beta, s0)
    offsets = tuple(sorted({1, L // 2 or 1, chunk - 1, chunk, L} & set(range(1, L + 1))))
    t = lambda x: x.transpose(0, 1)  # noqa: E731  [L, H, ...] -> [H, L, ...]
    out, state, snaps = chunk_kda_rule(t(q), t(k), t(v), t(g), beta.t(), s0, chunk, offsets)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(t(out), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, ref_state, atol=1e-5, rtol=1e-5)
    for off in offsets:
        _, prefix_state = _recurrence(q[:off], k[:off], v[:off], g[:off], beta[:off], s0)
        torch.testing.assert_close(snaps[off], prefix_state, atol=1e-5, rtol=1e-5, msg=lambda m: f"@{off}: {m}")


@pytest.mark.parametrize("mode", ["all", "align"])
def test_prefix_cache_snapshots_exact(mode, base_model):
    check_prefix_cache_exact(base_model[1], mode)


def test_preemption_recompute_gives_same_tokens(base_model):
    check_preemption_exact(base_model[1], 30)


def test_speculative_decoding_rolls_back_kda_state(base_model, monkeypatch):
    check_speculative_rollback_exact(base_model[1], monkeypatch)


def test_weight_names_load_one_to_one(base_model):
    from stateserve.models.kimi_linear import KimiLinearForCausalLM as Ours
    from stateserve.models.loader import iterate_safetensors, load_weights

    hf, path = base_model
    ours = Ours(hf.config, torch.float32)
    names = [n for n, _ in iterate_safetensors(path, show_progress=False)]
    assert {ours.map_weight_name(n)[0] for n in names} == set(dict(ours.named_parameters()))
    load_weights(ours, iterate_safetensors(path, show_progress=False))  # strict: every tensor lands, none missing
    assert Ours.resolve_flags(hf.config) == (False, True)
    only_kda = KimiLinearConfig(**{**BASE, "layer_types": ["linear_attention"] * 4})
    only_mla = KimiLinearConfig(**{**BASE, "layer_types": ["full_attention"] * 4})
    assert Ours.resolve_flags(only_kda) == (True, False) and Ours.resolve_flags(only_mla) == (False, False)


@pytest.mark.parametrize("change,message", [
    (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"]),
     "unknown layer type(s) ['sliding_attention']"),
    (dict(mlp_layer_types=["dense", "moe", "sparse", "sparse"]), "mlp_layer_types must name 4 layers"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2 must equal num_attention_heads=4"),
])
def test_bad_config_is_refused(change, message):
    from stateserve.models.kimi_linear import KimiLinearForCausalLM as Ours

    cfg = KimiLinearConfig(**BASE)
    for key, value in change.items():
        object.__setattr__(cfg, key, value)  # past transformers' own checks: what a hand-written config.json holds
    with pytest.raises(ValueError) as err:
        Ours(cfg, torch.float32)
    assert message in str(err.value)


def test_mla_caches_the_compressed_latent(base_model):
    """MLA layers keep one paged row per token of kv_lora_rank + qk_rope_head_dim values (their own spec and
    layout), not per-head K and V; the decoded tokens are the ones the other tests compare with transformers."""
    from stateserve.cache.spec import LatentKVCacheSpec

    hf, path = base_model
    cfg = hf.config
    with small_llm(path, block_size=16) as llm:
        runner = llm.llm_engine.runner
        kv_specs, _ = runner.cache_specs()
        assert set(kv_specs) == {"model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"}
        assert all(s == LatentKVCacheSpec(cfg.kv_lora_rank + cfg.qk_rope_head_dim, torch.float32)
                   for s in kv_specs.values())
        for rows, v in runner.caches.storage.kv.values():
            assert rows.shape == (runner.caches.plan.num_blocks, 16, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
            assert v is None


def test_fused_expert_tensors_load(tmp_path):
    """transformers' in-memory layout (save_pretrained(save_original_format=False), as some hub checkpoints store
    it: mlp.experts.gate_up_proj [E, 2I, H] from w1 / w3, experts.down_proj [E, H, I]; with its other in-memory
    names: mlp for block_sparse_moe, the fused self_attn.conv1d) loads, the experts split per expert: the same
    logits as the per-expert checkpoint, and as transformers."""
    hf, path = _build(tmp_path)
    check_fused_experts_load(hf, path, str(tmp_path / "fused"),
                             list(range(3, 80)))
