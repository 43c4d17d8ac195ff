"""GGUF files of the hybrid architectures (issue 36) written by llama.cpp's own converter (the session fixture of
test_gguf.py) from tiny random Hugging Face models: Jamba with MoE layers, Falcon-H1 (muP multipliers folded into
the weights), NemotronH with MoE (latent experts, shared expert, grouped routing) and a dense MLP (nemotron_h_moe)
and without MoE (nemotron_h), Bamba and GraniteMoeHybrid with MoE (both granitehybrid), and Llama with Llama 3.1
rope scaling (rope_freqs). A float32 file gives back the
checkpoint's tensors and config and transformers' logits and greedy tokens; a Q8_0 file gives the logits of
transformers' model (built from the config read from the file) holding the file's dequantized values."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (AutoModelForCausalLM, BambaConfig, BambaForCausalLM, FalconH1Config, FalconH1ForCausalLM,
                          GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, JambaConfig, JambaForCausalLM,
                          LlamaConfig, LlamaForCausalLM, NemotronHConfig, NemotronHForCausalLM)

from stateserve import LLM, SamplingParams
from stateserve.models import gguf_configs
from stateserve.models.gguf_file import GGUFCheckpoint
from stateserve.quantization.linear import QuantLinear
import test_gguf
from utils import build_hf_model, engine_teacher_forced_logits, hf_greedy, hf_logits, save_model

converter = test_gguf.converter  # the session fixture: llama.cpp's convert_hf_to_gguf.py, fetched once

# The converter, with every architecture's vocabulary replaced by a bare list of the model's size (the engine gets
# tokenizer= the Hugging Face folder, and reading llama.cpp's shipped lists costs seconds per file): one process
# converts every (folder, file, type) job.
CONVERT = r"""
import os, runpy, sys
script, jobs = sys.argv[1], sys.argv[2:]
root = os.path.dirname(os.path.abspath(script))
sys.path[0:0] = [root, os.path.join(root, "gguf-py")]
import gguf
from conversion import base, falcon_h1, granite, jamba, llama, nemotron

def bare_vocab(self):
    n, w = self.hparams["vocab_size"], self.gguf_writer
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("default"); w.add_token_merges([])
    w.add_token_list([f"<{i}>" for i in range(n)]); w.add_token_types([gguf.TokenType.NORMAL] * n)

class NoAutoConfig:  # as with a transformers that does not know the model: the converter reads config.json as is
    @staticmethod
    def from_pretrained(*args, **kwargs):
        raise ValueError("unknown model type")

for cls in (llama.LlamaModel, jamba.JambaModel, falcon_h1.FalconH1Model, nemotron.NemotronHModel,
            granite.GraniteHybridModel):
    cls.set_vocab = bare_vocab
auto_config, raw = base.AutoConfig, os.environ.get("RAW_CONFIG", "").split(os.pathsep)
for i in range(0, len(jobs), 3):
    base.AutoConfig = NoAutoConfig if jobs[i] in raw else auto_config
    sys.argv = [script, jobs[i], "--outfile", jobs[i + 1], "--outtype", jobs[i + 2]]
    runpy.run_path(script, run_name="__main__")
"""

V = 320  # a multiple of 16: no converter pads the vocabulary
MODELS = {
    # layers: mamba + MLP, attention + MoE, mamba + MLP, attention + MoE
    "jamba": (JambaConfig, JambaForCausalLM, dict(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
        num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
        max_position_embeddings=512)),
    # every multiplier away from 1; the gated norm on, after the gate (how llama.cpp runs a file's ssm_norm)
    "falcon_h1": (FalconH1Config, FalconH1ForCausalLM, dict(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, mamba_d_ssm=96, mamba_n_heads=8, mamba_d_head=12, mamba_d_state=16,
        mamba_n_groups=2, mamba_chunk_size=8, mamba_rms_norm=True, mamba_norm_before_gate=False,
        max_position_embeddings=256, embedding_multiplier=2.0, lm_head_multiplier=0.7, attention_in_multiplier=0.8,
        attention_out_multiplier=1.3, key_multiplier=0.5, ssm_in_multiplier=1.2, ssm_out_multiplier=0.9,
        mlp_multipliers=[1.5, 0.6], ssm_multipliers=[0.8, 1.2, 0.5, 1.5, 0.7])),
    # Mamba2, MoE (latent experts, two groups, no renormalisation, scaled), attention, dense relu2 MLP
    "nemotron_h": (NemotronHConfig, NemotronHForCausalLM, dict(
        vocab_size=V, hidden_size=64, layers_block_type=["mamba", "moe", "attention", "mlp"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=64, mamba_num_heads=4, mamba_head_dim=32,
        ssm_state_size=16, n_groups=2, chunk_size=8, n_routed_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=64, moe_latent_size=32, n_group=2,
        topk_group=1, norm_topk_prob=False, routed_scaling_factor=2.5, max_position_embeddings=512)),
    # the nemotron_h architecture: config.json without num_experts_per_tok, read as is (through transformers'
    # AutoConfig, which fills it in, the converter takes every NemotronH for nemotron_h_moe)
    "nemotron_h_dense": (NemotronHConfig, NemotronHForCausalLM, dict(
        vocab_size=V, hidden_size=32, layers_block_type=["mamba", "attention", "mlp", "mamba"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=64, mamba_num_heads=4, mamba_head_dim=16,
        ssm_state_size=8, n_groups=2, chunk_size=8, max_position_embeddings=512)),
    # mamba, mamba, attention (half of each head rotated, as Bamba-9B's attn_rotary_emb says), mamba
    "bamba": (BambaConfig, BambaForCausalLM, dict(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_indices=[2], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
        mamba_n_groups=2, mamba_chunk_size=8, max_position_embeddings=512)),
    # Granite 4.0-H: no rotary, MoE with a shared expert, the granite multipliers away from 1
    "granitemoehybrid": (GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, dict(
        vocab_size=V, hidden_size=64, intermediate_size=32, shared_intermediate_size=64, num_hidden_layers=3,
        layer_types=["mamba", "attention", "mamba"], num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
        mamba_n_groups=2, mamba_chunk_size=8, position_embedding_type=None, embedding_multiplier=3.0,
        attention_multiplier=0.1, residual_multiplier=0.6, logits_scaling=2.5, max_position_embeddings=256)),
    # Llama 3.1's rope scaling: two frequencies between the bounds, two scaled by the whole factor
    "llama3": (LlamaConfig, LlamaForCausalLM, dict(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096,
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=2048))),
}
# config.json as the published checkpoints write it (what the converter reads): Bamba-9B's attn_rotary_emb (head
# size 8 * partial_rotary_factor 0.5); Granite 4.0-H's layer_types spelled mamba / attention (with transformers
# 5.24's spelling the converter takes no layer for attention, interleaves no q/k rows and writes head_count_kv 0)
CONFIG_EDITS = {"bamba": {"attn_rotary_emb": 4}, "granitemoehybrid": {"layer_types": ["mamba", "attention", "mamba"]},
                "nemotron_h_dense": {"num_experts_per_tok": None}}  # None: left out
RAW_CONFIG = ("nemotron_h_dense",)
ARCHS = {"jamba": "jamba", "falcon_h1": "falcon-h1", "nemotron_h": "nemotron_h_moe", "nemotron_h_dense": "nemotron_h",
         "bamba": "granitehybrid", "granitemoehybrid": "granitehybrid", "llama3": "llama"}
CLASSES = {"jamba": "JambaConfig", "falcon_h1": "FalconH1Config", "nemotron_h": "NemotronHConfig",
           "nemotron_h_dense": "NemotronHConfig", "bamba": "BambaConfig", "granitemoehybrid": "GraniteMoeHybridConfig",
           "llama3": "LlamaConfig"}
# falcon-h1: the multipliers the converter folded into these weights (the file keeps no record of them)
FOLDED = ("embed_tokens", "lm_head", "q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj", "gate_proj",
          "down_proj")
TOKENS = [(37 * i + 11) % 300 + 3 for i in range(24)]
PROMPTS = [[250], [7, 3, 2], list(range(20, 33))]


def _build(arch: str):
    config_cls, model_cls, cfg = MODELS[arch]
    hf = build_hf_model(config_cls, model_cls, tie_word_embeddings=False, **cfg)
    # transformers initialises norms, D, dt_bias and the router bias to constants: perturb every 1-D parameter so a
    # mis-wired one changes the output
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return hf


@pytest.fixture(scope="module")
def converted(converter, tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("gguf_hybrids")
    models, jobs = {}, []
    for arch in MODELS:
        hf = _build(arch)
        folder = save_model(hf, str(root / arch), tokenizer_dir)
        if arch in CONFIG_EDITS:
            with open(os.path.join(folder, "config.json")) as fh:
                saved = json.load(fh)
            saved.update(CONFIG_EDITS[arch])
            with open(os.path.join(folder, "config.json"), "w") as fh:
                json.dump({k: v for k, v in saved.items() if v is not None}, fh)
        files = {t: f"{folder}-{t}.gguf" for t in ("f32", "q8_0")}
        jobs += [x for t, path in files.items() for x in (folder, path, t)]
        models[arch] = hf, folder, files
    raw = os.pathsep.join(models[arch][1] for arch in RAW_CONFIG)
    run = subprocess.run([sys.executable, "-c", CONVERT, converter, *jobs], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "RAW_CONFIG": raw})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return models


@pytest.mark.parametrize("arch", list(MODELS))
def test_float32_file_gives_the_checkpoint_back(converted, arch):
    """The file's tensors under Hugging Face names are the checkpoint's (A_log through -exp and log: round-off);
    Falcon-H1's folded ones are the only others; the config read from the metadata is the model's."""
    hf, folder, files = converted[arch]
    ckpt = GGUFCheckpoint(files["f32"])
    config, ours = ckpt.hf_config(), dict(ckpt.tensors_hf())
    assert ckpt.arch == ARCHS[arch] and type(config).__name__ == CLASSES[arch]
    state = load_file(os.path.join(folder, "model.safetensors"))  # the checkpoint's names (experts per expert)
    assert set(ours) == set(state)
    for name, value in ours.items():
        if arch == "falcon_h1" and any(k in name for k in FOLDED):
            assert not torch.equal(value, state[name]), name  # every multiplier is away from 1
            continue
        torch.testing.assert_close(value, state[name], rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")
    ref = hf.config
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "layers_block_type", "layer_types", "attn_layer_indices", "num_experts",
                "num_local_experts", "num_experts_per_tok", "n_routed_experts", "moe_latent_size", "n_group",
                "topk_group", "norm_topk_prob", "routed_scaling_factor", "embedding_multiplier", "logits_scaling",
                "residual_multiplier", "attention_multiplier", "rms_norm_eps", "mamba_dt_rank", "mamba_d_head",
                "mamba_head_dim", "mamba_n_groups", "position_embedding_type"):
        if arch != "falcon_h1" or "multiplier" not in key:
            assert getattr(config, key, None) == getattr(ref, key, None), key
    if arch in ("bamba", "llama3"):
        assert config.rope_parameters == ref.rope_parameters


@pytest.mark.parametrize("arch", list(MODELS))
def test_float32_file_gives_transformers_logits_and_tokens(converted, arch):
    hf, folder, files = converted[arch]
    ref = hf_logits(hf, TOKENS)
    greedy = hf_greedy(hf, PROMPTS, 8)
    # max_model_len: no-rope files (granitehybrid, nemotron_h) say context_length 2**20, which sizes a 4 GiB cache
    with LLM(files["f32"], tokenizer=folder, dtype="float32", enable_prefix_caching=False, max_model_len=256) as llm:
        for chunk in (len(TOKENS), 1):
            # float32 throughout: the scans' association order, A through -exp and log, Falcon-H1's multipliers
            # applied to the weights rather than the activations
            torch.testing.assert_close(engine_teacher_forced_logits(llm, TOKENS, chunk), ref,
                                       atol=2e-4 * ref.abs().max(), rtol=0, msg=lambda m: f"chunk {chunk}: {m}")
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == greedy


@pytest.mark.parametrize("arch", list(MODELS))
def test_q8_0_file_gives_the_logits_of_its_values(converted, arch, tmp_path):
    """The reference is transformers' model of the config read from the file, holding the file's values
    (dequantized): the Q8_0 linears stay quantized with the file's codes, stacked experts are dequantized."""
    _, folder, files = converted[arch]
    ckpt = GGUFCheckpoint(files["q8_0"])
    assert "Q8_0" in ckpt.linear_format().split(",")
    # saved as a checkpoint, so that transformers reads the checkpoint names (experts per expert) as it would
    ref_dir = str(tmp_path / "dequantized")
    ckpt.hf_config().save_pretrained(ref_dir)
    save_file({k: v if isinstance(v, torch.Tensor) else v.to_float() for k, v in ckpt.tensors_hf()},
              os.path.join(ref_dir, "model.safetensors"))
    ref_model = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    ref = hf_logits(ref_model, TOKENS)
    with LLM(files["q8_0"], tokenizer=folder, dtype="float32", quantization="int8_weight_only",
             enable_prefix_caching=False, max_model_len=256) as llm:
        kept = {n: m.fmt for n, m in llm.llm_engine.runner.model.named_modules() if isinstance(m, QuantLinear)}
        assert len(kept) >= 4 and set(kept.values()) == {"q8_0"}, kept
        for chunk in (len(TOKENS), 1):
            torch.testing.assert_close(engine_teacher_forced_logits(llm, TOKENS, chunk), ref,
                                       atol=2e-4 * ref.abs().max(), rtol=0, msg=lambda m: f"chunk {chunk}: {m}")


@pytest.mark.parametrize("theta, head_dim, factor, low, high, old", [
    (500000.0, 128, 8.0, 1.0, 4.0, 8192),  # Llama 3.1 8B
    (500000.0, 64, 32.0, 1.0, 4.0, 8192),  # Llama 3.2 1B
    (10000.0, 16, 8.0, 1.0, 4.0, 2048),
    (10000.0, 16, 4.0, 2.0, 8.0, 1024),  # low_freq_factor 2: the same factors as (1, 4, 512)
    (10000.0, 16, 8.0, 1.0, 2.0, 2048),  # one frequency between the bounds
    (10000.0, 16, 8.0, 1.0, 1.5, 128),  # none between them
])
def test_llama3_rope_parameters_give_the_converters_factors(theta, head_dim, factor, low, high, old):
    factors = gguf_configs._converter_factors(theta, head_dim, factor, low, high, old)
    params = gguf_configs.llama3_rope(factors, theta, head_dim)
    assert params["rope_type"] == "llama3" and params["factor"] == factor and params["low_freq_factor"] == 1.0
    again = gguf_configs._converter_factors(theta, head_dim, params["factor"], 1.0, params["high_freq_factor"],
                                          params["original_max_position_embeddings"])
    np.testing.assert_allclose(again, factors, rtol=1e-6)
    if low == 1.0 and sum(1 < f < factor for f in factors) >= 2:  # the line is fixed: the original numbers
        assert (params["high_freq_factor"], params["original_max_position_embeddings"]) == (high, old)
    # the frequencies our rotary computes from them are transformers' for the original parameters
    from stateserve.layers.rotary import RotaryEmbedding

    ours = RotaryEmbedding(head_dim, {**params, "rope_theta": theta}, 1 << 17).inv_freq
    orig = RotaryEmbedding(head_dim, {"rope_type": "llama3", "rope_theta": theta, "factor": factor,
                                      "low_freq_factor": low, "high_freq_factor": high,
                                      "original_max_position_embeddings": old}, 1 << 17).inv_freq
    torch.testing.assert_close(ours, orig, rtol=1e-6, atol=0)


def test_what_no_config_holds_is_refused():
    with pytest.raises(ValueError, match="not the factors of Llama 3 rope scaling"):
        gguf_configs.llama3_rope(np.array([1.0, 2.0, 1.5, 8.0], np.float32), 10000.0, 8)  # not monotonic
    with pytest.raises(ValueError, match="not the factors of Llama 3 rope scaling"):
        # three between the bounds, not on one line in the frequency
        gguf_configs.llama3_rope(np.array([1.0, 1.1, 5.0, 5.5, 8.0], np.float32), 10000.0, 10)
    with pytest.raises(ValueError, match="follow no period and offset"):
        gguf_configs._period([False, True, True, False, False], "attention layers", "x.gguf")
    assert gguf_configs._period([False, True, False, True], "MoE layers", "x.gguf") == (2, 1)
    assert gguf_configs._period([False] * 3, "attention layers", "x.gguf") == (4, 3)
    assert math.isclose(gguf_configs._f32(np.float32(1e-6)), 1e-6)
