"""Llama and Qwen2: batched greedy parity with transformers under chunked prefill, teacher-forced logits."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from stateserve import LLM, SamplingParams
from state_checks import check_teacher_forced_logits
from utils import (assert_greedy_matches, build_hf_model, engine_teacher_forced_logits, hf_greedy, hf_logits,
                   save_model)

PROMPTS = [[1, 5, 9], [7, 3, 2, 8, 10, 11, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52],
           [100, 120, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28,
            29, 30, 31, 32, 33, 34, 35, 36, 37, 38], [250]]

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


def _build(kind: str, tmp_path, **extra):
    if kind == "qwen2":
        hf = build_hf_model(Qwen2Config, Qwen2ForCausalLM, **{**BASE, **extra})
    else:
        hf = build_hf_model(LlamaConfig, LlamaForCausalLM, **{**BASE, **extra})
    return hf, save_model(hf, str(tmp_path / kind))


CASES = [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True}),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
                                   "rope_theta": 10000.0}}),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
               "max_position_embeddings": 24}),
    ("qwen2", {}),
]


@pytest.mark.parametrize("kind,extra", CASES, ids=["llama", "tied", "linear", "llama3", "dynamic", "qwen2"])
def test_greedy_parity_chunked(kind, extra, tmp_path):
    hf, path = _build(kind, tmp_path, **extra)
    max_new = 12
    prompts = PROMPTS
    if "max_position_embeddings" in extra:
        # dynamic NTK: run past the trained context so the scaling is exercised
        prompts = [p[:20] for p in PROMPTS]
    ref = hf_greedy(hf, prompts, max_new)
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=16, max_model_len=None,
             enable_prefix_caching=False) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True))
        ours = [o.outputs[0].token_ids for o in outs]
        assert_greedy_matches(ours, ref, hf, prompts)
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.cache.is_idle_and_full()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_teacher_forced_logits(kind, tmp_path):
    hf, path = _build(kind, tmp_path)
    tokens = list(range(3, 60))
    ref = hf_logits(hf, tokens)
    # float32 end to end: differences come only from summation order
    check_teacher_forced_logits(path, ref, tokens, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: the qkv bias
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_layer_matches_op_by_op(kind, dtype, tmp_path, monkeypatch):
    """decoder_layer_decode_ (a whole layer's decode step in one call) calls the kernels the layer calls op by op:
    teacher-forced decode logits are identical with the fused path on and off, and the fused kernel ran for every
    layer of every decode step."""
    from stateserve.layers.decoder_layer import DecoderLayer
    from stateserve.platform import cpu_kernels, kernels as kernel_table
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("C++ CPU kernels unavailable")
    _, path = _build(kind, tmp_path)
    tokens = list(range(3, 30))
    calls = []

    class Spy:  # counts the fused calls, forwards everything else
        def __getattr__(self, name):
            return getattr(kernels, name)

        def decoder_layer_decode_(self, *args):
            calls.append(1)
            return kernels.decoder_layer_decode_(*args)

    with kernel_table.using(kernel_table.build(Spy())), LLM(path, skip_tokenizer_init=True, dtype=dtype) as llm:
        fused = engine_teacher_forced_logits(llm, tokens, 1)
        assert len(calls) == (len(tokens) - 1) * BASE["num_hidden_layers"]  # the first token is a prefill
        monkeypatch.setattr(DecoderLayer, "_fused_decode", lambda *args: None)
        op_by_op = engine_teacher_forced_logits(llm, tokens, 1)
    assert torch.equal(fused, op_by_op)
