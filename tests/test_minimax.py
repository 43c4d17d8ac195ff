"""MiniMax (lightning attention + full attention, MoE everywhere): the chunked lightning rule against the token
recurrence (and its snapshots), greedy parity with transformers under batched chunked prefill, teacher-forced logits
through the real caches, prefix caching with mamba_cache_mode all / align, preemption by recompute, weight names, and
bad configs' errors."""
from __future__ import annotations

import pytest
import torch
from transformers import MiniMaxConfig, MiniMaxForCausalLM

from stateserve.layers.lightning import chunk_lightning, lightning_slopes
from utils import (assert_greedy_matches, build_hf_model, check_fused_experts_load, hf_greedy, hf_logits, save_model)
from state_checks import (check_bfloat16_logits, check_preemption_exact, check_prefix_cache_exact,
                          check_routing_decisive, check_teacher_forced_logits, greedy_params, make_routing_decisive,
                          small_llm)
# transformers' lightning block_size 16: its prefill crosses blocks (ours uses chunks of 64)
BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, block_size=16,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 100.0},
            pad_token_id=2, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, initializer_range=0.15)
CASES = {
    "base": {},
    # weighted residuals (MiniMax-Text-01 sets alpha to about 3.6 for 80 layers), transformers' default pattern
    "variants": dict(linear_attn_alpha_factor=1.5, linear_attn_beta_factor=0.5, full_attn_alpha_factor=0.8,
                     full_attn_beta_factor=1.2, mlp_alpha_factor=1.3, mlp_beta_factor=0.7, num_key_value_heads=4,
                     layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"]),
}
PROMPTS = [list(range(5, 5 + n)) for n in (1, 9, 17, 40)] + [[250, 7, 11]]


def _build(tmp_path, **extra):
    hf = build_hf_model(MiniMaxConfig, MiniMaxForCausalLM, **{**BASE, **extra})
    return hf, save_model(hf, str(tmp_path / "minimax"))


def _recurrence(q, k, v, slopes, s0):
    """The definition, token by token: S_t = exp(-slope) S_{t-1} + k_t^T v_t, o_t = q_t S_t. [H, L, D] inputs."""
    state, outs, states = s0, [], []
    decay = torch.exp(-slopes).view(-1, 1, 1)
    for t in range(q.shape[1]):
        state = decay * state + k[:, t, :, None] * v[:, t, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[:, t], state))
        states.append(state)
    return torch.stack(outs, 1), states


@pytest.mark.parametrize("L,chunk", [(1, 64), (37, 8), (130, 64)])
def test_chunked_lightning_matches_token_recurrence(L, chunk):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, L, 8, generator=gen) * 0.5 for _ in range(3))
    s0 = torch.randn(4, 8, 8, generator=gen)
    slopes = lightning_slopes(4, 0, 4)  # the fastest decays of a model: exp(-0.25 * 64) stays finite
    offsets = tuple(sorted({1, L // 2 or 1, chunk - 1, chunk, L} & set(range(1, L + 1))))
    out, state, snaps = chunk_lightning(q, k, v, slopes, s0, chunk, offsets)
    ref_out, ref_states = _recurrence(q, k, v, slopes, s0)
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, ref_states[-1], atol=1e-4, rtol=1e-4)
    for off in offsets:
        torch.testing.assert_close(snaps[off], ref_states[off - 1], atol=1e-4, rtol=1e-4, msg=lambda m: f"@{off}: {m}")


def _assert_logprobs_match(hf, prompts, outs, tol: float = 1e-3) -> None:
    """Each decoded token's logprob equals transformers' over the same tokens (teacher-forced): decisive tokens can
    survive a slightly wrong decode state, their logprobs cannot."""
    for p, o in zip(prompts, outs, strict=True):
        tokens = o.outputs[0].token_ids
        ref = torch.log_softmax(hf_logits(hf, p + tokens[:-1])[len(p) - 1:], dim=-1)  # [len(tokens), vocab]
        ours = [lp[t].logprob for t, lp in zip(tokens, o.outputs[0].logprobs)]
        diff = max(abs(a - float(ref[j, t])) for j, (a, t) in enumerate(zip(ours, tokens)))
        assert diff < tol, (p, tokens, diff)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_parity_chunked(case, tmp_path):
    hf, path = _build(tmp_path, **CASES[case])
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
    tokens = list(range(3, 80))  # 77 tokens: more than one 64-token chunk, several of transformers' 16-token blocks
    ref = hf_logits(hf, tokens)
    check_teacher_forced_logits(path, ref, tokens, atol=5e-4)


def test_bfloat16_logits(tmp_path):
    """One whole-prompt step, resumed 7-token steps and token by token (the decode recurrence) beside transformers'
    bfloat16 (tolerance derived in check_bfloat16_logits), on the base model with its routing made decisive (random
    routers: bfloat16 flipped 2-4 of 77 tokens' experts per layer, transformers' own logits then off by up to 9) and
    initializer_range 0.1 (at 0.15 both bfloat16 results are ~0.06 mean from float32 math, the mean bound's edge;
    transformers keeps the lightning state in bfloat16, we in float32)."""
    hf, _ = _build(tmp_path, initializer_range=0.1)
    make_routing_decisive(hf)
    tokens = list(range(3, 80))
    check_routing_decisive(hf, tokens)
    check_bfloat16_logits(hf, save_model(hf, str(tmp_path / "decisive")), tokens, (77, 7, 1))


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("minimax"))


@pytest.mark.parametrize("mode", ["all", "align"])
def test_prefix_cache_snapshots_exact(mode, base_model):
    check_prefix_cache_exact(base_model[1], mode)


def test_preemption_recompute_gives_same_tokens(base_model):
    check_preemption_exact(base_model[1], 30)


def test_weight_names_load_one_to_one(base_model):
    from stateserve.models.loader import iterate_safetensors, load_weights
    from stateserve.models.minimax import MiniMaxForCausalLM as Ours

    hf, path = base_model
    ours = Ours(hf.config, torch.float32)
    names = [n for n, _ in iterate_safetensors(path, show_progress=False)]
    mapped = {t[0] for n in names if (t := ours.map_weight_name(n)) is not None}
    assert mapped == set(dict(ours.named_parameters()))
    load_weights(ours, iterate_safetensors(path, show_progress=False))  # strict: every tensor lands, none missing
    for layer, hf_layer in zip(ours.model.layers, hf.model.layers):  # the recomputed decay rates are transformers'
        if layer.layer_type == "linear_attention":
            torch.testing.assert_close(layer.self_attn.slopes, hf_layer.self_attn.slope_rate.flatten())
    assert Ours.resolve_flags(hf.config) == (False, True)
    only_linear = MiniMaxConfig(**{**BASE, "layer_types": ["linear_attention"] * 4})
    assert Ours.resolve_flags(only_linear) == (True, False)


@pytest.mark.parametrize("change,message", [
    (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"]),
     "MiniMax: layer_types has unknown layer type(s) ['sliding_attention']"),
    (dict(sliding_window=32), "MiniMax: sliding_window=32 is not supported"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 100.0, "factor": 4.0}),
     "rope_type 'longrope' is not supported"),
])
def test_bad_config_is_refused(change, message):
    from stateserve.models.minimax import MiniMaxForCausalLM as Ours

    cfg = MiniMaxConfig(**BASE)
    for key, value in change.items():
        object.__setattr__(cfg, key, value)  # past transformers' own checks: what a hand-written config.json holds
    with pytest.raises(ValueError) as err:
        Ours(cfg, torch.float32)
    assert message in str(err.value)


def test_fused_expert_tensors_load(tmp_path):
    """transformers' in-memory layout (save_pretrained(save_original_format=False), as some hub checkpoints store
    it: mlp.experts.gate_up_proj [E, 2I, H] from w1 / w3, experts.down_proj [E, H, I]) loads, the experts split per
    expert: the same logits as the per-expert checkpoint, and as transformers."""
    hf, path = _build(tmp_path)
    check_fused_experts_load(hf, path, str(tmp_path / "fused"),
                             list(range(3, 80)))


def test_yarn_rope_logits(tmp_path):
    """YaRN rope (factor 4 over an original context of 16, the 77-token prompt well past it, so nearly every rotary
    dim is interpolated; transformers' default attention_factor (from factor) on cos and sin, an untruncated ramp
    with beta_fast 8): teacher-forced logits as transformers'."""
    hf, path = _build(tmp_path, rope_parameters={"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0,
                                 "original_max_position_embeddings": 16, "beta_fast": 8.0, "truncate": False})
    assert hf.config.rope_parameters["rope_type"] == "yarn"
    tokens = list(range(3, 80))
    ref = hf_logits(hf, tokens)
    check_teacher_forced_logits(path, ref, tokens, atol=5e-4)


@pytest.mark.parametrize("params", [
    {"factor": 4.0, "original_max_position_embeddings": 16},
    {"factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
    {"factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.707, "mscale_all_dim": 1.0},
    {"factor": 2.0, "original_max_position_embeddings": 16, "attention_factor": 0.9},
    {"factor": None, "original_max_position_embeddings": 64},  # DeepSeek-V3 style: max_position_embeddings / 64
])
def test_yarn_frequencies_match_transformers(params):
    """rotary.yarn_inv_freq against transformers 5.24's _compute_yarn_parameters itself: the frequencies and the
    attention factor, over its options (beta_fast / beta_slow, truncate, mscale, an explicit attention_factor, a
    factor derived from the context lengths)."""
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    from stateserve.layers.rotary import rope_parameters, yarn_inv_freq

    cfg = MiniMaxConfig(**{**BASE, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1000.0, **params}})
    ref_inv, ref_factor = _compute_yarn_parameters(cfg)
    ours = rope_parameters(cfg)
    inv, factor = yarn_inv_freq(cfg.head_dim, float(ours["rope_theta"]), ours, cfg.max_position_embeddings)
    torch.testing.assert_close(inv, ref_inv, atol=0, rtol=1e-6)
    assert factor == pytest.approx(ref_factor, rel=1e-12)
