"""NemotronH (Mamba2 / attention / MLP / MoE blocks from a layer pattern): greedy parity with transformers under
chunked prefill, teacher-forced logits through the real caches (with the dt clamp binding), state checkpoints
through the whole model, pattern edges (attention first, all-Mamba), MoE options, and weight names that load
1:1. Preemption: test_hybrid_cache.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import NemotronHConfig, NemotronHForCausalLM

from stateserve import LLM, SamplingParams
from stateserve.layers.mamba2_mixer import Mamba2Mixer
from stateserve.layers.metadata import AttnMetadata, ForwardMeta, StateMetadata
from stateserve.models.loader import iterate_safetensors, load_weights
from stateserve.models.nemotron_h import NemotronHForCausalLM as OurNemotronH
from stateserve.models.nemotron_h import block_types, parse_pattern
from state_checks import check_teacher_forced_logits
from utils import (assert_greedy_matches, build_hf_model, check_fused_experts_load, engine_teacher_forced_logits,
                   hf_greedy, hf_logits, save_model)

BASE = dict(vocab_size=300, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            intermediate_size=64, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=2, chunk_size=8,
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=24, n_group=1, topk_group=1, tie_word_embeddings=False,
            max_position_embeddings=512)
CASES = {
    "mixed": dict(hybrid_override_pattern="M*-ME"),
    # attention first; head_dim apart from hidden / heads, every bias, conv without bias, K=3, odd scan chunks
    "attn_first": dict(hybrid_override_pattern="*M-M", head_dim=12, use_bias=True, mlp_bias=True,
                       use_conv_bias=False, conv_kernel=3, chunk_size=5, layer_norm_epsilon=1e-3),
    # MoE options: latent experts, group-limited routing, no renormalisation, scaling, an explicit layer list
    "moe_options": dict(layers_block_type=["mamba", "moe", "attention", "moe"], n_routed_experts=8, n_group=2,
                        topk_group=1, moe_latent_size=16, norm_topk_prob=False, routed_scaling_factor=2.5,
                        num_experts_per_tok=3),
}
PROMPTS = [[250], [7, 3, 2], list(range(20, 29)), list(range(100, 116)), list(range(40, 57)),
           [(17 * i) % 290 + 3 for i in range(40)]]


def _build(tmp_path, **extra):
    hf = build_hf_model(NemotronHConfig, NemotronHForCausalLM, **{**BASE, **extra})
    # transformers initialises D, A_log and the norms to constants and the router bias to zero: perturb every
    # 1-D parameter and buffer so a mis-wired one changes the output
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in list(hf.named_parameters()) + list(hf.named_buffers()):
            if p.dim() == 1 and not name.endswith("dt_bias"):  # dt_bias: keep the log-uniform step sizes
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return hf, save_model(hf, str(tmp_path / "nemotron_h"))


def test_layer_patterns_and_config_checks():
    assert parse_pattern("*M-EM") == ["full_attention", "linear_attention", "mlp", "moe", "linear_attention"]
    for pattern in ("M*X", ""):
        with pytest.raises(ValueError, match="hybrid_override_pattern"):
            parse_pattern(pattern)
    for extra in CASES.values():
        cfg = NemotronHConfig(**{**BASE, **extra})
        ours = OurNemotronH(cfg, torch.float32)
        assert [b.block_type for b in ours.backbone.layers] == cfg.layers_block_type
        assert OurNemotronH.resolve_flags(cfg) == (False, True)
    assert block_types(NemotronHConfig(**{**BASE, **CASES["attn_first"]}))[0] == "full_attention"
    assert OurNemotronH.resolve_flags(NemotronHConfig(**{**BASE, "hybrid_override_pattern": "*-E"})) == (False, False)
    bad = NemotronHConfig(**BASE)
    bad.layers_block_type = ["linear_attention", "cross_attention"]
    with pytest.raises(ValueError, match="cross_attention"):
        OurNemotronH(bad, torch.float32)
    bad = NemotronHConfig(**{**BASE, "hybrid_override_pattern": "ME"})
    bad.mlp_hidden_act = "swiglu"
    with pytest.raises(ValueError, match="swiglu"):
        OurNemotronH(bad, torch.float32)
    bad.mlp_hidden_act, bad.n_group = "relu2", 3  # 4 experts do not split into 3 groups
    with pytest.raises(ValueError, match="n_group"):
        OurNemotronH(bad, torch.float32)


def test_weight_names_match_transformers(tmp_path):
    hf, path = _build(tmp_path, **CASES["moe_options"])
    ours = OurNemotronH(hf.config, torch.float32)
    # transformers' in-memory names (model.*, fused 3-D experts) differ from the checkpoint's; read the file
    names = [n for n, _ in iterate_safetensors(path, show_progress=False)]
    assert all(n.startswith(("backbone.", "lm_head.")) for n in names)
    assert {ours.map_weight_name(n)[0] for n in names} == set(dict(ours.named_parameters()))
    load_weights(ours, iterate_safetensors(path, show_progress=False))  # strict: every tensor lands somewhere
    torch.testing.assert_close(ours.backbone.layers[1].mixer.gate.e_score_correction_bias,
                               hf.model.layers[1].mixer.gate.e_score_correction_bias)
    assert ours.map_weight_name("model.layers.0.mixer.A_log") == ("backbone.layers.0.mixer.A_log", None)
    assert ours.map_weight_name("mtp.layers.0.mixer.q_proj.weight") is None
    # the router stays float32 when the model is cast down, as transformers keeps it
    gate = ours.to(torch.bfloat16).backbone.layers[1].mixer.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert ours.backbone.layers[1].mixer.experts_up.dtype == torch.bfloat16


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


def _clamped_fraction(hf, tokens: list[int]) -> float:
    """Share of (token, head) step sizes of the first Mamba layer that the time_step_min clamp raises."""
    mixer = next(b.mixer for b in hf.model.layers if b.block_type == "linear_attention")
    seen = []
    hook = mixer.in_proj.register_forward_hook(lambda m, i, o: seen.append(o[..., -mixer.num_heads:]))
    with torch.no_grad():
        hf(torch.tensor([tokens]))
    hook.remove()
    return float((F.softplus(seen[0] + mixer.dt_bias) < mixer.time_step_limit[0]).float().mean())


@pytest.mark.parametrize("case", ["mixed", "attn_first"])
def test_teacher_forced_logits(case, tmp_path):
    hf, path = _build(tmp_path, **CASES[case])
    tokens = [(7 * i) % 290 + 3 for i in range(70)]  # 70 tokens: five KV blocks, several scan chunks
    # the (time_step_min, inf) limit binds often in this model, so chunk 1 (the decode path) checks that the
    # clamp is applied there too, exactly like transformers' forward
    assert _clamped_fraction(hf, tokens) > 0.05
    ref = hf_logits(hf, tokens)
    # float32 throughout: only the scan's chunking and the MoE sum order differ from transformers
    # (observed max error ~2e-5 on logits up to ~17; transformers' own generate path, which skips
    # the clamp, is ~8e-3 away from its forward on this model)
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
    hf, path = _build(tmp_path, **CASES["attn_first"])
    model = OurNemotronH(hf.config, torch.float32).eval()
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
                torch.testing.assert_close(m.states[key][dst], m.states[key][7], atol=1e-5, rtol=1e-5)


def _greedy_without_cache(hf, prompt: list[int], max_new: int) -> list[int]:
    """transformers' generate needs an attention layer to count tokens: recompute the whole sequence instead."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            ids.append(int(hf(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_all_mamba_pattern_is_attention_free(tmp_path):
    hf, path = _build(tmp_path, hybrid_override_pattern="MM-M")
    assert OurNemotronH.resolve_flags(hf.config) == (True, False)
    prompts = PROMPTS[:5]
    ref = [_greedy_without_cache(hf, p, 6) for p in prompts]
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=16, enable_prefix_caching=False) as llm:
        assert llm.llm_engine.model_config.is_attention_free
        assert not llm.llm_engine.runner.caches.storage.kv  # no KV cache planned at all
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        assert_greedy_matches([o.outputs[0].token_ids for o in outs], ref, hf, prompts)
        tokens = list(range(3, 40))
        with torch.no_grad():
            logits = hf(torch.tensor([tokens]), use_cache=False).logits[0]
        torch.testing.assert_close(engine_teacher_forced_logits(llm, tokens, 9), logits, atol=5e-4, rtol=1e-4)
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.cache.is_idle_and_full()


def test_fused_expert_tensors_load(tmp_path):
    """transformers' in-memory layout (save_pretrained(save_original_format=False), as some hub checkpoints store
    it: non-gated mixer.experts.up_proj [E, I, H], experts.down_proj [E, H, I]; model. for backbone.) loads, the
    experts split per expert: the same logits as the per-expert checkpoint, and as transformers."""
    hf, path = _build(tmp_path)
    check_fused_experts_load(hf, path, str(tmp_path / "fused"),
                             list(range(3, 80)), fused_name="experts.up_proj")
