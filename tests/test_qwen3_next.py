"""Qwen3-Next (Gated DeltaNet + gated attention + MoE): greedy parity with transformers under chunked prefill,
teacher-forced logits through the real caches, the chunked delta rule against the token recurrence, and
prefix-cache checkpoints of the delta-net state. Preemption: test_hybrid_cache.py."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

from stateserve import LLM, SamplingParams
from stateserve.layers.delta_rule import GatedDeltaNet, chunk_gated_delta_rule, l2norm
from stateserve.layers.metadata import StateMetadata
from state_checks import check_teacher_forced_logits
from utils import (assert_greedy_matches, build_hf_model, check_fused_experts_load, engine_teacher_forced_logits,
                   hf_greedy, hf_logits, save_model)

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            full_attention_interval=2, tie_word_embeddings=False, max_position_embeddings=256,
            # 0.15 rather than 0.3: at 0.3 this tiny model has positions where transformers' own float32
            # result is 1e-2 away from float64 (the gated norm of near-zero delta-net outputs amplifies
            # rounding), which would force a loose tolerance
            initializer_range=0.15)
CASES = {
    "interval": {},
    # explicit layer_types, dense MLP on some layers, no top-k renormalisation, half rotary, MHA linear heads
    "variants": dict(layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
                     decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                     linear_num_value_heads=2, attention_bias=True),
}
PROMPTS = [list(range(5, 5 + n)) for n in (1, 3, 9, 16, 17, 40)] + [[250, 7, 11]]


def _build(tmp_path, **extra):
    hf = build_hf_model(Qwen3NextConfig, Qwen3NextForCausalLM, **{**BASE, **extra})
    with torch.no_grad():  # slow decay (A in [0.05, 1]) so the recurrent state carries across many tokens
        for layer in hf.model.layers:
            if layer.block_type == "linear_attention":
                n = layer.linear_attn.A_log.numel()
                layer.linear_attn.A_log.copy_(torch.linspace(math.log(0.05), 0.0, n))
    return hf, save_model(hf, str(tmp_path / "qwen3_next"))


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_parity_chunked(case, tmp_path):
    hf, path = _build(tmp_path, **CASES[case])
    max_new = 10
    ref = hf_greedy(hf, PROMPTS, max_new)
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=16, enable_prefix_caching=False) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True))
        assert_greedy_matches([o.outputs[0].token_ids for o in outs], ref, hf, PROMPTS, tol=1e-3)
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.cache.is_idle_and_full()


@pytest.mark.parametrize("case", list(CASES))
def test_teacher_forced_logits(case, tmp_path):
    hf, path = _build(tmp_path, **CASES[case])
    tokens = list(range(3, 80))  # 77 tokens: more than one 64-token delta-rule chunk
    ref = hf_logits(hf, tokens)
    check_teacher_forced_logits(path, ref, tokens, atol=5e-4, rtol=1e-4)


def test_all_linear_layers_is_attention_free(tmp_path):
    hf, path = _build(tmp_path, num_hidden_layers=2, layer_types=["linear_attention"] * 2)
    from stateserve.models.qwen3_next import Qwen3NextForCausalLM as Ours
    assert Ours.resolve_flags(hf.config) == (True, False)
    tokens = list(range(3, 40))
    with LLM(path, skip_tokenizer_init=True) as llm:
        assert llm.llm_engine.model_config.is_attention_free
        with torch.no_grad():  # transformers' cache cannot count tokens without an attention layer
            ref = hf(torch.tensor([tokens]), use_cache=False).logits[0]
        torch.testing.assert_close(engine_teacher_forced_logits(llm, tokens, 9), ref, atol=5e-4, rtol=1e-4)


def _random_inputs(L: int, H: int = 3, Dk: int = 8, Dv: int = 5, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(L, H, Dk, generator=gen)) * Dk ** -0.5
    k = l2norm(torch.randn(L, H, Dk, generator=gen))
    v = torch.randn(L, H, Dv, generator=gen)
    g = -torch.rand(L, H, generator=gen) * 0.3
    beta = torch.rand(L, H, generator=gen)
    s0 = torch.randn(H, Dk, Dv, generator=gen)
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("L,chunk", [(1, 64), (37, 8), (130, 64)])
def test_chunked_rule_matches_token_recurrence(L, chunk):
    q, k, v, g, beta, s0 = _random_inputs(L)
    # transformers' reference recurrence takes [B, L, H, D]; it scales q itself, so undo ours
    ref_out, ref_state = torch_recurrent_gated_delta_rule(
        (q * 8 ** 0.5)[None], k[None], v[None], g[None], beta[None], initial_state=s0[None],
        output_final_state=True)
    offsets = tuple(sorted({1, L // 2 or 1, chunk, L} & set(range(1, L + 1))))
    out, state, snaps = chunk_gated_delta_rule(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), g.t(),
                                               beta.t(), s0, chunk, offsets)
    torch.testing.assert_close(out.transpose(0, 1), ref_out[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, ref_state[0], atol=1e-5, rtol=1e-5)
    for off in offsets:
        _, prefix_state = torch_recurrent_gated_delta_rule(
            (q[:off] * 8 ** 0.5)[None], k[:off][None], v[:off][None], g[:off][None], beta[:off][None],
            initial_state=s0[None], output_final_state=True)
        torch.testing.assert_close(snaps[off], prefix_state[0], atol=1e-5, rtol=1e-5)


def _layer(num_slots: int = 8) -> GatedDeltaNet:
    torch.manual_seed(0)
    layer = GatedDeltaNet(32, 2, 4, 8, 6, 4, 1e-6, "silu", torch.float32, chunk_size=16)
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
        layer.A_log.copy_(torch.linspace(math.log(0.05), 0.0, 4))
    spec = dict(layer.cache_spec().shapes)
    layer.bind_cache({name: torch.zeros(num_slots, *shape) for name, shape in spec.items()})
    return layer


def _meta(lens: list[int], slots: list[int], has_init: list[bool], checkpoints=()) -> StateMetadata:
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    return StateMetadata(query_start_loc=starts, query_lens=lens, slots=torch.tensor(slots), has_initial_state=has_init,
                         is_decode_only=all(n == 1 for n in lens), checkpoints=list(checkpoints))


def _states(layer: GatedDeltaNet, slot: int) -> dict[str, torch.Tensor]:
    return {name: t[slot].clone() for name, t in layer.states.items()}


def test_checkpoints_equal_prefix_states():
    """A snapshot after `offset` tokens equals the state of running just those tokens (prefill and decode)."""
    layer = _layer()
    x = torch.randn(60, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # sequence 0: 10 tokens fresh (slot 0); sequence 1 resumes in slot 1 after a 5-token first chunk
        layer(x[40:45], _meta([5], [1], [False]))
        snaps = [(0, 3, 4), (1, 1, 5), (1, 16, 6), (1, 23, 7)]  # mid-chunk, first token, chunk end, last
        layer(torch.cat([x[:10], x[15:38]]), _meta([10, 23], [0, 1], [False, True], snaps))
        got = {dst: _states(layer, dst) for _, _, dst in snaps}
        # references: run the prefixes on their own in fresh slots
        expect = {}
        for seq, off, dst in snaps:
            layer.states["conv"][2].zero_(), layer.states["ssm"][2].zero_()
            if seq == 0:
                layer(x[:off], _meta([off], [2], [False]))
            else:
                layer(x[40:45], _meta([5], [2], [False]))
                layer(x[15:15 + off], _meta([off], [2], [True]))
            expect[dst] = _states(layer, 2)
        for dst in got:
            for name in got[dst]:
                torch.testing.assert_close(got[dst][name], expect[dst][name], atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"slot {dst} {name}: {m}")
        # decode: one token each for slots 0 and 1, snapshot of sequence 1 into slot 3
        before = _states(layer, 1)
        layer(x[50:52], _meta([1, 1], [0, 1], [True, True], [(1, 1, 3)]))
        after = _states(layer, 1)
        for name in after:
            torch.testing.assert_close(layer.states[name][3], after[name])
            assert not torch.equal(after[name], before[name])


def test_decode_matches_prefill_and_fresh_slots_start_from_zero():
    layer = _layer()
    x = torch.randn(12, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = layer(x[:9], _meta([9], [0], [False]))
        stepped = [layer(x[:6], _meta([6], [1], [False]))]
        for t in range(6, 9):  # batched decode; slot 2 holds garbage and is a sequence's first token
            layer.states["ssm"][2].fill_(3.0)
            layer.states["conv"][2].fill_(3.0)
            out = layer(torch.stack([x[t], x[0]]), _meta([1, 1], [1, 2], [True, False]))
            stepped.append(out[:1])
            # chunked prefill vs recurrent steps: float32 sums in other orders (~1e-5 on AVX-512 machines)
            torch.testing.assert_close(out[1], full[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(torch.cat(stepped), full, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(layer.states["ssm"][1], layer.states["ssm"][0], atol=1e-5, rtol=1e-5)


def test_fused_expert_tensors_load(tmp_path):
    """transformers' in-memory layout (save_pretrained(save_original_format=False), as some hub checkpoints store
    it: experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) loads, the experts split per expert: the same
    logits as the per-expert checkpoint, and as transformers."""
    hf, path = _build(tmp_path)
    check_fused_experts_load(hf, path, str(tmp_path / "fused"),
                             list(range(3, 80)))
