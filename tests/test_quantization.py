"""Load-time Q8_0 quantization (issue 36): codes equal ggml's reference quantizer bit for bit, teacher-forced logits
of quantized Llama, Mamba, Mamba2 and Bamba equal transformers' with the same dequantized weights (and, in the int8
mode, the same activation rounding), which layers are quantized, the memory they take and the load log."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize
from torch import nn
from transformers import (BambaConfig, BambaForCausalLM, LlamaConfig, LlamaForCausalLM, Mamba2Config,
                          Mamba2ForCausalLM, MambaConfig, MambaForCausalLM)

from stateserve import LLM
from stateserve.quantization import q8_0
from stateserve.quantization.linear import QuantLinear
from utils import build_hf_model, engine_teacher_forced_logits, hf_logits, save_model

MODELS = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(vocab_size=300, hidden_size=64, intermediate_size=128,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                 max_position_embeddings=256)),
    "mamba": (MambaConfig, MambaForCausalLM, dict(vocab_size=300, hidden_size=64, state_size=8, num_hidden_layers=2,
                                                 tie_word_embeddings=False)),
    "mamba2": (Mamba2Config, Mamba2ForCausalLM, dict(vocab_size=300, hidden_size=64, num_heads=8, head_dim=16,
                                                    expand=2, state_size=16, n_groups=1, num_hidden_layers=2,
                                                    conv_kernel=4, chunk_size=256, tie_word_embeddings=False)),
    "bamba": (BambaConfig, BambaForCausalLM, dict(vocab_size=300, hidden_size=64, intermediate_size=128,
                                                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                                 attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32,
                                                 mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8,
                                                 tie_word_embeddings=False, max_position_embeddings=256)),
}
TOKENS = [(37 * i + 11) % 290 + 3 for i in range(24)]


def _gguf_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    raw = gguf_quantize(w.float().numpy(), GGMLQuantizationType.Q8_0).reshape(w.shape[0], -1, 34)
    scales = np.ascontiguousarray(raw[..., :2]).view(np.float16)[..., 0]
    codes = np.ascontiguousarray(raw[..., 2:]).view(np.int8).reshape(w.shape)
    return torch.from_numpy(codes), torch.from_numpy(scales)


def test_codes_equal_ggml_reference():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g) * torch.logspace(-6, 4, 64).unsqueeze(1)
    w[3] = 0  # all-zero blocks: scale 0, codes 0
    w[4, :32] = torch.arange(32) - 15.5  # many values at exactly half a step
    w[5, :32] = torch.tensor([127.0, 0.5, -0.5, 1.5, -1.5, 2.5, 126.5, -126.5] * 4)  # ties after scaling by 1
    w[6, :32] = torch.full((32,), -3.0)  # every code -127
    for weight in (w, w.to(torch.bfloat16)):
        codes, scales = q8_0.quantize(weight)
        ref_codes, ref_scales = _gguf_q8_0(weight.float())
        assert torch.equal(codes, ref_codes)
        assert torch.equal(scales.view(torch.int16), ref_scales.view(torch.int16))
    ones = torch.full((1, 32), 0.5)
    assert torch.equal(q8_0.quantize(ones)[0], torch.full((1, 32), 127, dtype=torch.int8))
    with pytest.raises(ValueError, match="multiple of 32"):
        q8_0.quantize(torch.zeros(4, 48))


def _reference(hf: nn.Module, activations: bool) -> nn.Module:
    """transformers' model with every linear the engine quantizes (K a multiple of 32, not tied) holding its Q8_0
    weight dequantized, and in the int8 mode its input rounded per block as the kernels round it."""
    tied = {id(p) for name, p in hf.named_parameters() if "embed" in name}
    for module in hf.modules():
        if isinstance(module, nn.Linear) and module.in_features % 32 == 0 and id(module.weight) not in tied:
            with torch.no_grad():
                module.weight.copy_(q8_0.dequantize(*q8_0.quantize(module.weight)))
            if activations:
                module.register_forward_pre_hook(lambda _, args: (q8_0.fake_quantize(args[0]).to(args[0].dtype),))
    return hf


@pytest.mark.parametrize("arch", list(MODELS))
def test_teacher_forced_logits_equal_the_dequantized_model(arch, tmp_path):
    config_cls, model_cls, cfg = MODELS[arch]
    hf = build_hf_model(config_cls, model_cls, **cfg)
    path = save_model(hf, str(tmp_path / arch))
    exact = hf_logits(hf, TOKENS)
    weight_only_ref = hf_logits(_reference(build_hf_model(config_cls, model_cls, **cfg), False), TOKENS)
    int8_ref = hf_logits(_reference(build_hf_model(config_cls, model_cls, **cfg), True), TOKENS)
    scale = exact.abs().max()
    for mode, ref in (("int8_weight_only", weight_only_ref), ("int8", int8_ref)):
        with LLM(path, dtype="float32", quantization=mode, enable_prefix_caching=False, skip_tokenizer_init=True) as llm:
            model = llm.llm_engine.runner.model
            assert any(isinstance(m, QuantLinear) for m in model.modules())
            assert not any(isinstance(m, nn.Linear) and m.in_features % 32 == 0 for m in model.modules())
            for chunk in (len(TOKENS), 5, 1):  # one prefill, chunks, and token by token (the decode path)
                ours = engine_teacher_forced_logits(llm, TOKENS, chunk)
                err = (ours - ref).abs().amax(dim=-1)  # per position
                if mode == "int8_weight_only":  # float32 round-off of the same products
                    assert err.max() <= 2e-4 * scale, (mode, chunk, err)
                else:
                    # Float32 round-off (another summation order, threads) can move some x * (1 / d) across a half
                    # and flip one activation code by one step, which later positions carry on (attention, the
                    # recurrent state): no tight bound holds. The logits must be far closer to the reference with
                    # the activation rounding than to the one without it, and never further off than that rounding
                    # moves them.
                    to_a8 = (ours - ref).abs().mean()
                    to_weight_only = (ours - weight_only_ref).abs().mean()
                    assert to_a8 <= 0.25 * to_weight_only, (chunk, float(to_a8), float(to_weight_only))
                    assert err.max() <= (int8_ref - weight_only_ref).abs().max(), (chunk, err)
        assert (int8_ref - weight_only_ref).abs().max() > 1e-3 * scale  # the two modes differ measurably


def test_which_layers_are_quantized_and_their_memory(tmp_path):
    config_cls, model_cls, cfg = MODELS["mamba"]
    hf = build_hf_model(config_cls, model_cls, **cfg)
    path = save_model(hf, str(tmp_path / "mamba"))
    with LLM(path, dtype="bfloat16", quantization="int8", skip_tokenizer_init=True) as llm:
        model = llm.llm_engine.runner.model
        quantized = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
        kept = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        # dt_proj's K is dt_rank (4): not a multiple of the block
        assert all(n.endswith(("in_proj", "x_proj", "out_proj")) or n == "lm_head" for n in quantized)
        assert "lm_head" in quantized and all(n.endswith("dt_proj") for n in kept), kept
        for name in quantized:
            layer = model.get_submodule(name)
            assert not hasattr(layer, "weight")  # no float copy beside the codes
            ideal = layer.out_features * layer.in_features * (1 + 2 / 32)  # codes and fp16 scales
            assert layer.weight_bytes <= 1.15 * ideal


def test_cli_flag_quantizes_and_the_load_log_says_so():
    """`stateserve generate --quantization int8` on the bundled Llama demo: the load line names the format and its
    GiB, and the text comes out (both modes; a bad value is refused by the CLI, naming the choices)."""
    import os
    import re
    import subprocess
    import sys

    from utils import demo_model

    env = {**os.environ, "STATESERVE_DISABLE_TQDM": "1"}
    for mode in ("int8", "int8_weight_only"):
        proc = subprocess.run([sys.executable, "-m", "stateserve.entrypoints.cli", "generate", "--model",
                               demo_model("llama-demo"), "--prompt", "The with statement", "--max-tokens", "4",
                               "--temperature", "0", "--quantization", mode], capture_output=True, text=True,
                              env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr
        log = proc.stdout + proc.stderr
        assert re.search(rf"Model loading took \d+\.\d+ GiB memory and \d+\.\d+ seconds; weights quantized to "
                         rf"{mode} \(Q8_0\): \d+ linears, \d+\.\d+ GiB", log), log
    bad = subprocess.run([sys.executable, "-m", "stateserve.entrypoints.cli", "generate", "--prompt", "x",
                          "--quantization", "q3"], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode != 0 and "int8_weight_only" in bad.stderr
    with pytest.raises(ValueError, match="quantization must be"):
        LLM(demo_model("llama-demo"), quantization="q3")


def test_the_cpp_kernel_is_what_runs_in_decode(tmp_path):
    """No silent fallback: where the C++ kernels are built, every quantized layer holds them, and a greedy decode
    calls them (one, two and several rows: decodes of 1 and 3 requests, and the prefill)."""
    from stateserve.platform import cpu_kernels
    from stateserve import SamplingParams

    module = cpu_kernels.load()
    if module is None:
        pytest.skip("STATESERVE_CPU_KERNELS=0 or no compiler: the PyTorch path is the only one (tested above)")
    assert module.q8_0_supported()
    config_cls, model_cls, cfg = MODELS["llama"]
    path = save_model(build_hf_model(config_cls, model_cls, **cfg), str(tmp_path / "llama"))
    with LLM(path, dtype="bfloat16", quantization="int8", skip_tokenizer_init=True) as llm:
        layers = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, QuantLinear)]
        assert layers and all(m.kernel is module.q8_0_linear for m in layers)
        rows: list[int] = []
        for layer in layers:
            def counting(x, *args, _kernel=layer.kernel):
                rows.append(x.shape[0])
                return _kernel(x, *args)
            layer.kernel = counting
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
        llm.generate([{"prompt_token_ids": [5, 6, 7 + i]} for i in range(3)], params, use_tqdm=False)
        assert {1, 3} <= set(rows) and max(rows) >= 9, sorted(set(rows))
