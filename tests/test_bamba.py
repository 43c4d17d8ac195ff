"""Bamba (Mamba2 + attention hybrid): greedy parity with transformers under chunked prefill, teacher-forced logits
through the real KV and state caches, state checkpoints through the whole model, config edges (attention at
layer 0, partial rotary, biases, all-Mamba) and weight names that load 1:1. Preemption: test_hybrid_cache.py."""
from __future__ import annotations

import pytest
import torch
from transformers import BambaConfig, BambaForCausalLM

from stateserve import LLM, SamplingParams
from stateserve.layers.mamba2_mixer import Mamba2Mixer
from stateserve.layers.metadata import AttnMetadata, ForwardMeta, StateMetadata
from stateserve.models.bamba import BambaForCausalLM as OurBamba
from stateserve.models.loader import iterate_safetensors, load_weights
from state_checks import check_teacher_forced_logits
from utils import (assert_greedy_matches, build_hf_model, engine_teacher_forced_logits, hf_greedy, hf_logits,
                   save_model)

BASE = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, attn_layer_indices=[2], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
            mamba_n_groups=2, mamba_chunk_size=8, tie_word_embeddings=False, max_position_embeddings=512)
CASES = {
    # mamba, mamba, attention (half rotary: BambaConfig's default factor), mamba
    "default": {},
    # attention first and last, a quarter of a 16-wide head rotated, every bias on, conv without bias, K=3
    "edge": dict(attn_layer_indices=[0, 3], head_dim=16, attention_bias=True, mlp_bias=True, mamba_proj_bias=True,
                 mamba_conv_bias=False, mamba_d_conv=3, rms_norm_eps=1e-3,
                 rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25}),
}
PROMPTS = [[250], [7, 3, 2], list(range(20, 29)), list(range(100, 116)), list(range(40, 57)),
           [(17 * i) % 290 + 3 for i in range(40)]]


def _build(tmp_path, **extra):
    hf = build_hf_model(BambaConfig, BambaForCausalLM, **{**BASE, **extra})
    # transformers initialises D, dt_bias, A_log and the norms to constants; perturb every 1-D parameter so a
    # mis-wired one (say, the two layer norms swapped) changes the output
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return hf, save_model(hf, str(tmp_path / "bamba"))


def test_layers_and_rotary_follow_config():
    for name, extra in CASES.items():
        cfg = BambaConfig(**{**BASE, **extra})
        ours = OurBamba(cfg, torch.float32)
        assert [layer.layer_type for layer in ours.model.layers] == cfg.layers_block_type
        attn = [layer.self_attn for layer in ours.model.layers if layer.layer_type == "full_attention"]
        # 0.25 of a 16-wide head, and BambaConfig's default 0.5 of 32 / 4 = 8: four rotated channels either way
        assert attn and all(a.rotary.dim == 4 and a.rotary.base == (500.0 if name == "edge" else 10000.0)
                            for a in attn)
        assert OurBamba.resolve_flags(cfg) == (False, True)
    assert ours.model.layers[0].layer_type == "full_attention"
    bad = BambaConfig(**BASE)
    bad.rope_parameters = {**bad.rope_parameters, "partial_rotary_factor": 0.375}  # 3 channels: not whole pairs
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        OurBamba(bad, torch.float32)


def test_weight_names_match_transformers(tmp_path):
    hf, path = _build(tmp_path, **CASES["edge"])
    ours = OurBamba(hf.config, torch.float32)
    mapped = {ours.map_weight_name(n)[0] for n in hf.state_dict()}
    assert mapped == set(dict(ours.named_parameters()))
    load_weights(ours, iterate_safetensors(path, show_progress=False))  # strict: every tensor lands somewhere
    torch.testing.assert_close(ours.model.layers[1].mamba.dt_bias, hf.model.layers[1].mamba.dt_bias)


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
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.cache.is_idle_and_full()


@pytest.mark.parametrize("case", ["default", "edge_dt_limit"])
def test_teacher_forced_logits(case, tmp_path):
    # the second case adds a binding time_step_limit: the clamp then acts on the prefill and decode paths
    extra = CASES["edge"] | {"time_step_limit": (0.05, 0.5)} if case == "edge_dt_limit" else {}
    hf, path = _build(tmp_path, **extra)
    tokens = [(7 * i) % 290 + 3 for i in range(70)]  # 70 tokens: five KV blocks, nine scan chunks
    ref = hf_logits(hf, tokens)
    # float32 throughout: only the scan's chunking (association order) differs from transformers;
    # observed max error ~3e-4 at chunk 1 (decode recurrence) and <1e-4 otherwise, logits up to ~16
    check_teacher_forced_logits(path, ref, tokens, atol=5e-4, rtol=1e-4)


def _prefill_meta(n: int, slot: int, checkpoints=()) -> ForwardMeta:
    """One fresh sequence of n tokens; attention runs without a KV cache (none is bound)."""
    attn = AttnMetadata(query_start_loc=[0, n], query_lens=[n], context_lens=[0], seq_lens=[n],
                        is_decode_only=False)
    state = StateMetadata(query_start_loc=[0, n], query_lens=[n], slots=torch.tensor([slot]),
                          has_initial_state=[False], is_decode_only=False, checkpoints=list(checkpoints))
    return ForwardMeta(n, attn=attn, state=state)


@torch.no_grad()
def test_checkpoints_through_the_model(tmp_path):
    """Snapshots requested in a prefill land, in every Mamba layer, as the state after that many tokens."""
    hf, path = _build(tmp_path)
    model = OurBamba(hf.config, torch.float32).eval()
    load_weights(model, iterate_safetensors(path, show_progress=False))
    mixers = [m for m in model.modules() if isinstance(m, Mamba2Mixer)]
    for m in mixers:
        m.bind_cache({k: torch.full((8, *shape), 5.0) for k, shape in m.cache_spec().shapes})
    tokens = torch.tensor([(7 * i) % 290 + 3 for i in range(21)])
    model(tokens, torch.arange(21), _prefill_meta(21, 0, [(0, 5, 1), (0, 16, 2), (0, 21, 3)]))
    for off, dst in ((5, 1), (16, 2), (21, 3)):
        model(tokens[:off], torch.arange(off), _prefill_meta(off, 7))
        for m in mixers:
            for key in ("conv", "ssm"):
                # not bit-exact: where oneDNN computes the linears (CPUs without AVX-512) a row's rounding
                # depends on the row count, and three layers carry it on (~1.5e-5 seen on states of ~20); a
                # snapshot from the wrong token is off by O(1)
                torch.testing.assert_close(m.states[key][dst], m.states[key][7], atol=1e-4, rtol=1e-4)


def test_without_attention_layers_is_attention_free(tmp_path):
    hf, path = _build(tmp_path, num_hidden_layers=2, attn_layer_indices=None)
    assert OurBamba.resolve_flags(hf.config) == (True, False)
    tokens = list(range(3, 40))
    with LLM(path, skip_tokenizer_init=True) as llm:
        assert llm.llm_engine.model_config.is_attention_free
        with torch.no_grad():  # transformers' cache cannot count tokens without an attention layer
            ref = hf(torch.tensor([tokens]), use_cache=False).logits[0]
        torch.testing.assert_close(engine_teacher_forced_logits(llm, tokens, 9), ref, atol=5e-4, rtol=1e-4)
