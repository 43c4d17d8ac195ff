"""MoE experts under load-time quantization (issue 36): each expert's matrices become their own QuantLinear (the
stacked float matrices are freed), for the three expert layouts (Jamba's per-expert checkpoint, GraniteMoeHybrid's
fused one, NemotronH's non-gated experts); the weight-only logits equal transformers' model holding the same
dequantized weights, and the int8 mode runs the quantized products with int8 activations."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import (GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, JambaConfig, JambaForCausalLM,
                          NemotronHConfig, NemotronHForCausalLM)

from stateserve import LLM
from stateserve.layers.moe import ExpertMatrices
from stateserve.quantization import formats, q8_0
from stateserve.quantization.linear import QuantLinear
from utils import build_hf_model, engine_teacher_forced_logits, hf_logits, save_model

MODELS = {
    "jamba": (JambaConfig, JambaForCausalLM, dict(
        vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1,
        expert_layer_offset=0, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, use_mamba_kernels=False,
        tie_word_embeddings=False, max_position_embeddings=256)),
    "granitemoehybrid": (GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, dict(
        vocab_size=300, hidden_size=64, intermediate_size=64, shared_intermediate_size=64, num_hidden_layers=2,
        layer_types=["mamba", "attention"], num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8, mamba_n_groups=1,
        mamba_chunk_size=8, tie_word_embeddings=False, max_position_embeddings=256)),
    "nemotron_h": (NemotronHConfig, NemotronHForCausalLM, dict(
        vocab_size=300, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        hybrid_override_pattern="M*E", n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        moe_shared_expert_intermediate_size=64, n_group=1, topk_group=1, mamba_num_heads=4, mamba_head_dim=32,
        ssm_state_size=8, n_groups=1, chunk_size=8, intermediate_size=64, tie_word_embeddings=False,
        max_position_embeddings=256)),
}
TOKENS = [(37 * i + 11) % 290 + 3 for i in range(24)]
METHOD = "q4_0"  # every K here is 64: Q4_K's 256 would not fit


def _dequantized_reference(hf: nn.Module) -> nn.Module:
    """transformers' model holding what the engine holds: each linear (not the routers) and each expert's matrix
    as its Q4_0 values, the head as its Q8_0 values."""
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, nn.Linear) and "router" not in name and module.in_features % 32 == 0:
                fmt = "q8_0" if name == "lm_head" else METHOD
                module.weight.copy_(formats.quantize(module.weight, fmt).dequantize())
        for name, p in hf.named_parameters():
            if ".experts." in name and p.dim() == 3 and p.shape[-1] % 32 == 0:  # [E, N, K]
                p.copy_(torch.stack([formats.quantize(w, METHOD).dequantize() for w in p]))
    return hf


@pytest.mark.parametrize("arch", list(MODELS))
def test_experts_are_quantized_per_expert(arch, tmp_path):
    config_cls, model_cls, cfg = MODELS[arch]
    hf = build_hf_model(config_cls, model_cls, **cfg)
    path = save_model(hf, str(tmp_path / arch))
    exact = hf_logits(hf, TOKENS)
    ref = hf_logits(_dequantized_reference(build_hf_model(config_cls, model_cls, **cfg)), TOKENS)
    scale = exact.abs().max()
    assert (ref - exact).abs().max() > 1e-2 * scale  # 4 bits move the logits: the bound below would notice
    with LLM(path, dtype="float32", quantization=f"{METHOD}_weight_only", enable_prefix_caching=False,
             skip_tokenizer_init=True) as llm:
        model = llm.llm_engine.runner.model
        moes = [m for m in model.modules() if isinstance(m, ExpertMatrices)]
        assert moes and all(m.expert_products is not None for m in moes)
        assert not [n for n, _ in model.named_parameters() if n.endswith(("experts_gate_up", "experts_up",
                                                                          "experts_down"))]  # freed
        for moe in moes:
            for products in moe.expert_products.values():
                assert len(products) == moe.num_experts
                assert all(isinstance(p, QuantLinear) and p.fmt == METHOD and p.kernel is not None for p in products)
        for chunk in (len(TOKENS), 1):
            ours = engine_teacher_forced_logits(llm, TOKENS, chunk)
            assert (ours - ref).abs().max() <= 2e-4 * scale, (arch, chunk)


def test_int8_activations_reach_the_experts(tmp_path):
    """The int8 mode: every expert product that runs quantizes its input (counted through the kernel), and the
    logits are those of the weight-only model whose products see their inputs rounded as the int8 mode rounds them
    (each QuantLinear's input fake-quantized per block of 32)."""
    config_cls, model_cls, cfg = MODELS["jamba"]
    path = save_model(build_hf_model(config_cls, model_cls, **cfg), str(tmp_path / "jamba"))
    runs = {}
    for mode, rounded in ((f"{METHOD}_weight_only", False), (f"{METHOD}_weight_only", True), (METHOD, False)):
        with LLM(path, dtype="float32", quantization=mode, enable_prefix_caching=False,
                 skip_tokenizer_init=True) as llm:
            model = llm.llm_engine.runner.model
            expert_layers = {id(p) for m in model.modules() if isinstance(m, ExpertMatrices)
                             for products in m.expert_products.values() for p in products}
            calls = []
            for layer in (m for m in model.modules() if isinstance(m, QuantLinear)):
                def wrapped(x, *args, _kernel=layer.kernel, _expert=id(layer) in expert_layers):
                    if _expert:
                        calls.append(args[-1])  # the quantize_activations flag
                    return _kernel(q8_0.fake_quantize(x).to(x.dtype) if rounded else x, *args)
                layer.kernel = wrapped
            runs[(mode, rounded)] = engine_teacher_forced_logits(llm, TOKENS, len(TOKENS))
            assert calls and set(calls) == {mode == METHOD}
    ours, ref = runs[(METHOD, False)], runs[(f"{METHOD}_weight_only", True)]
    weight_only = runs[(f"{METHOD}_weight_only", False)]
    # as in test_quantization.py: a code flipped by round-off carries on through the layers, so no tight bound
    # holds; the int8 run must sit far closer to its reference than to the weight-only run
    assert (ours - ref).abs().mean() <= 0.25 * (ours - weight_only).abs().mean()
    assert (ours - ref).abs().max() <= (ref - weight_only).abs().max()


def test_experts_whose_k_fits_no_block_stay_float(tmp_path):
    """Experts of intermediate size 48: gate/up (K = hidden = 64) become products, down (K = 48, no whole block)
    stays a float matrix beside them, and the forward mixes the two."""
    config_cls, model_cls, cfg = MODELS["jamba"]
    cfg = {**cfg, "intermediate_size": 48}
    hf = build_hf_model(config_cls, model_cls, **cfg)
    path = save_model(hf, str(tmp_path / "jamba48"))
    exact = hf_logits(hf, TOKENS)
    ref = hf_logits(_dequantized_reference(build_hf_model(config_cls, model_cls, **cfg)), TOKENS)
    scale = exact.abs().max()
    with LLM(path, dtype="float32", quantization=f"{METHOD}_weight_only", enable_prefix_caching=False,
             skip_tokenizer_init=True) as llm:
        moes = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, ExpertMatrices)]
        assert moes and all(set(m.expert_products) == {"experts_gate_up"} for m in moes)
        assert all(set(m.expert_matrices()) == {"experts_down"} for m in moes)
        ours = engine_teacher_forced_logits(llm, TOKENS, len(TOKENS))
        assert (ours - ref).abs().max() <= 2e-4 * scale
