"""Tensor and pipeline parallelism together, and quantized weights under either (distributed/, quantization/).

A grid of 2 stages x 2 tensor-parallel ranks: each stage's two ranks split its layers as tensor_parallel_size=2
alone would, and every rank runs on one thread as the 2-rank run's do (2 cores), so tokens AND logprobs must equal
tensor_parallel_size=2 exactly, for a Llama with an odd layer count and Bamba (Mamba2 + attention), with chunked
prefill, prefix caching (second pass) and a cache small enough to preempt. Quantized weights are quantized after
the split, each rank its share: with shares that start at a block boundary the blocks are the whole model's, so
int8 on two ranks gives one int8 rank's tokens, and its logprobs within float32 round-off; a pipeline stage runs
the very kernels of one rank on the same rows, so int8 and a GGUF file's Q8_0 blocks on two stages equal one rank
exactly."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from stateserve import LLM, SamplingParams
from stateserve.distributed.pipeline import RemoteLayer
from stateserve.distributed.sharding import RowParallelLinear
from stateserve.quantization.linear import QuantLinear
from test_bamba import _build as bamba
from test_gguf import _convert, converter  # noqa: F401  (a fixture)
from test_pipeline_parallel import KW, PROMPTS, _scored, one_thread  # noqa: F401  (a fixture)
from utils import build_hf_model, demo_model, hf_greedy, save_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _llama(tmp_path, **extra):
    cfg = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    hf = build_hf_model(LlamaConfig, LlamaForCausalLM, **{**cfg, **extra})
    return hf, save_model(hf, str(tmp_path / "llama3"))


@pytest.mark.parametrize("arch", ["llama", "bamba"])
def test_two_stages_of_two_ranks_equal_two_ranks_exactly(arch, tmp_path):
    hf, path = {"llama": _llama, "bamba": bamba}[arch](tmp_path)
    prefix = {"enable_prefix_caching": True, **({"mamba_cache_mode": "all"} if arch != "llama" else {})}
    with LLM(path, tensor_parallel_size=2, **prefix, **KW) as two:
        ref, ref_cached = _scored(two), _scored(two)
    assert [t for t, _ in ref] == hf_greedy(hf, PROMPTS, 10)
    with LLM(path, tensor_parallel_size=2, pipeline_parallel_size=2, **prefix, **KW) as grid:
        assert _scored(grid) == ref
        assert _scored(grid) == ref_cached
        engine = grid.llm_engine
        assert engine.stats["prefix_cache_hits"] > 0
        runner = engine.runner
        assert (runner.group.size, runner.tensor_group.size, runner.tensor_group.rank) == (4, 2, 0)
        remote = [m for m in runner.model.modules() if isinstance(m, RemoteLayer)]
        assert remote and all(m.owner == 2 for m in remote)  # stage 1's rank of tensor rank 0
        assert any(isinstance(m, RowParallelLinear) for m in runner.model.modules())
        engine.check_integrity()


def test_a_tiny_cache_preempts_and_recomputes_on_the_grid(tmp_path):
    _, path = _llama(tmp_path)
    tight = {**KW, "kv_cache_memory_bytes": 1 << 15}  # a few blocks: long prompts take turns
    with LLM(path, tensor_parallel_size=2, **tight) as two:
        ref = _scored(two)
    with LLM(path, tensor_parallel_size=2, pipeline_parallel_size=2, **tight) as grid:
        assert _scored(grid) == ref
        assert grid.llm_engine.stats["preemptions"] > 0


def test_int8_on_two_ranks_quantizes_each_share(tmp_path):
    """Each rank quantizes its share after the split (the row-parallel projections' input columns included); the
    model's tokens are one int8 rank's and its logprobs agree within float32 round-off. Fails if the ranks
    quantized before the split (refused), or cut a block."""
    _, path = _llama(tmp_path)
    with LLM(path, quantization="int8", **KW) as one:
        ref = _scored(one)
    with LLM(path, quantization="int8", tensor_parallel_size=2, **KW) as two:
        ours = _scored(two)
        model = two.llm_engine.runner.model
        row = [m for m in model.modules() if isinstance(m, RowParallelLinear)]
        assert row and all(isinstance(m.local, QuantLinear) and m.local.fmt == "q8_0" for m in row)
    for (tokens, steps), (ref_tokens, ref_steps) in zip(ours, ref):
        assert tokens == ref_tokens
        for step, ref_step in zip(steps, ref_steps):
            assert [t for t, _ in step] == [t for t, _ in ref_step]
            torch.testing.assert_close(torch.tensor([lp for _, lp in step]), torch.tensor([lp for _, lp in ref_step]),
                                       atol=1e-4, rtol=0)


def test_int8_and_a_gguf_files_blocks_on_two_stages_equal_one_rank(tmp_path, converter, one_thread):  # noqa: F811
    hf, path = _llama(tmp_path, vocab_size=32000)  # the converter's bundled token list has 32000 entries
    prompts = [[5, 9, 13], list(range(100, 140))]
    gguf = _convert(converter, path, "q8_0")
    for model, extra in ((path, {"quantization": "int8"}), (gguf, {})):
        with LLM(model, **extra, **KW) as one:
            ref = _scored(one, prompts)
        with LLM(model, pipeline_parallel_size=2, **extra, **KW) as two:
            assert _scored(two, prompts) == ref
            model_here = two.llm_engine.runner.model
            assert any(isinstance(m, QuantLinear) for m in model_here.modules())
            assert not any(p.is_meta for p in model_here.parameters())  # the other stage's layers are gone
    with pytest.raises(ValueError, match="tensor parallelism cannot split a GGUF file's quantized tensors"):
        LLM(gguf, tensor_parallel_size=2, **KW)


def test_cli_generate_on_a_grid_of_quantized_ranks():
    """`stateserve generate --tensor-parallel-size 2 --pipeline-parallel-size 2 --quantization int8` says how its
    ranks are laid out and prints what the API gives on two int8 ranks."""
    model = demo_model("llama-demo")
    with LLM(model, tensor_parallel_size=2, quantization="int8", kv_cache_memory_bytes=1 << 24) as llm:
        expected = llm.generate(["The cat"], SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].text
    out = subprocess.run([sys.executable, "-m", "stateserve.entrypoints.cli", "generate", "--model", model,
                          "--prompt", "The cat", "--max-tokens", "12", "--kv-cache-memory-bytes", str(1 << 24),
                          "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2", "--quantization", "int8"],
                         capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={**os.environ, "STATESERVE_DISABLE_TQDM": "1"})
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "Tensor x pipeline parallelism: 4 ranks (2 stages of 2 tensor-parallel ranks)" in text, text
    assert len(re.findall(r"weights quantized to int8", text)) == 4, text  # every rank quantized its share
    assert f"Output: {expected!r}" in text, text
