"""Pipeline parallelism (distributed/pipeline.py): the layers cut into two stages, one per process. A stage runs the
same kernels on the same rows as one rank does, so with the same thread count (one per rank on these 2-core machines:
kernels split their sums by threads) tokens AND logprobs must equal pipeline_parallel_size=1 exactly, for a Llama with an odd layer count, Bamba (Mamba2 + attention: state slots and snapshots live with their stage)
and Mamba2, with chunked prefill, prefix caching in every mamba_cache_mode and preemption."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from stateserve import LLM, SamplingParams
from stateserve.distributed.pipeline import RemoteLayer, stage_bounds
from test_bamba import _build as bamba
from test_mamba2 import _build as mamba2
from utils import build_hf_model, demo_model, hf_greedy, save_model

PROMPTS = [[250], [7, 3, 2], list(range(20, 29)), list(range(100, 140)), [(17 * i) % 290 + 3 for i in range(40)]]
KW = dict(skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24, max_num_batched_tokens=16)


@pytest.fixture
def one_thread(monkeypatch):
    """The one-rank reference computes on one thread, as each rank does."""
    from stateserve import envs
    from stateserve.platform import cpu_threads

    monkeypatch.setenv("STATESERVE_NUM_THREADS", "1")
    envs.disable_envs_cache()
    cpu_threads.reset_governor()
    yield
    monkeypatch.undo()
    envs.disable_envs_cache()
    cpu_threads.reset_governor()


def _scored(llm: LLM, prompts=PROMPTS, max_new: int = 10):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True, logprobs=2))
    return [(o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in step.items())
                                      for step in o.outputs[0].logprobs]) for o in outs]


def _llama(tmp_path):
    hf = build_hf_model(LlamaConfig, LlamaForCausalLM, vocab_size=300, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return hf, save_model(hf, str(tmp_path / "llama3"))


def test_stage_bounds_share_layers_evenly():
    assert stage_bounds(3, 2) == [0, 2, 3]
    assert stage_bounds(8, 4) == [0, 2, 4, 6, 8]
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 is more than the model's 2 layers"):
        stage_bounds(2, 3)


@pytest.mark.parametrize("arch", ["llama", "bamba", "mamba2"])
def test_two_stages_equal_one_exactly(arch, tmp_path, one_thread):
    """Greedy tokens (transformers') and logprobs (one rank's, bit for bit); a second pass from the prefix cache; a
    cache small enough to preempt. Rank 0 holds only its stage's layers and caches."""
    hf, path = {"llama": _llama, "bamba": bamba, "mamba2": mamba2}[arch](tmp_path)
    prefix = {"enable_prefix_caching": True, **({"mamba_cache_mode": "all"} if arch != "llama" else {})}
    with LLM(path, **prefix, **KW) as one:
        ref, ref_cached = _scored(one), _scored(one)  # the second pass resumes from cached prefixes
    assert [t for t, _ in ref] == hf_greedy(hf, PROMPTS, 10)
    with LLM(path, pipeline_parallel_size=2, **prefix, **KW) as two:
        assert _scored(two) == ref
        assert _scored(two) == ref_cached
        assert two.llm_engine.stats["prefix_cache_hits"] > 0
        runner = two.llm_engine.runner
        layers = list(runner.model.modules())
        remote = [m for m in layers if isinstance(m, RemoteLayer)]
        assert remote and all(m.owner == 1 for m in remote)
        owned = {f"{n}." for n, m in runner.model.named_modules() if n.count(".") == 2 and n.endswith(
            tuple(str(i) for i in range(8))) and not isinstance(m, RemoteLayer)}
        cached = list(runner.caches.storage.kv) + list(runner.caches.storage.states)
        assert cached and all(any(name.startswith(prefix) for prefix in owned) for name in cached), (owned, cached)
        two.llm_engine.check_integrity()
    tight = {"num_gpu_blocks_override": 14, "block_size": 4} if arch != "mamba2" else {"max_num_seqs": 2}
    with LLM(path, **tight, **KW) as small:
        ref_tight = _scored(small)  # recomputed after preemption: other chunks than `ref`
    with LLM(path, pipeline_parallel_size=2, **tight, **KW) as small:
        assert _scored(small) == ref_tight
        if arch != "mamba2":
            assert small.llm_engine.stats["preemptions"] > 0


def test_align_mode_snapshots_on_a_hybrid(tmp_path, one_thread):
    hf, path = bamba(tmp_path)
    align = {"enable_prefix_caching": True, "mamba_cache_mode": "align"}
    with LLM(path, **align, **KW) as one:
        ref, ref_cached = _scored(one), _scored(one)
    with LLM(path, pipeline_parallel_size=2, **align, **KW) as two:
        assert _scored(two) == ref
        assert _scored(two) == ref_cached
        assert two.llm_engine.stats["prefix_cache_hits"] > 0


def test_a_model_without_a_layer_loop_is_refused(tmp_path):
    from test_zamba2 import _build as zamba2

    _, path = zamba2(tmp_path)
    with pytest.raises(ValueError, match="Zamba2ForCausalLM does not support pipeline parallelism"):
        LLM(path, pipeline_parallel_size=2, **KW)
    with pytest.raises(ValueError, match="Zamba2ForCausalLM does not support pipeline parallelism"):
        LLM(path, pipeline_parallel_size=2, tensor_parallel_size=2, **KW)


def test_cli_generate_with_two_stages():
    model = demo_model("llama-demo")
    with LLM(model, kv_cache_memory_bytes=1 << 24) as llm:
        expected = llm.generate(["The cat"], SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].text
    out = subprocess.run([sys.executable, "-m", "stateserve.entrypoints.cli", "generate", "--model", model,
                          "--prompt", "The cat", "--max-tokens", "12", "--kv-cache-memory-bytes", str(1 << 24),
                          "--pipeline-parallel-size", "2"], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         env={**os.environ, "STATESERVE_DISABLE_TQDM": "1"})
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "Pipeline parallelism: 2 ranks (gloo over loopback)" in text, text
    assert f"Output: {expected!r}" in text, text


def test_each_stage_loads_only_its_layers(tmp_path, tokenizer_dir):
    """`stateserve generate --pipeline-parallel-size 2` on a 12-layer bfloat16 checkpoint: the other stage's layers
    never get memory on a rank (release_other_stages: meta before loading, their tensors skipped), so each rank's
    load peaks near half the model (checked to fail without the release: 1.1x the model there)."""
    import re

    import torch

    cfg = dict(vocab_size=300, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
               num_key_value_heads=12, max_position_embeddings=256)
    hf = build_hf_model(LlamaConfig, LlamaForCausalLM, **cfg).to(torch.bfloat16)
    path = save_model(hf, str(tmp_path / "llama"), tokenizer_dir)
    del hf
    env = {**os.environ, "STATESERVE_DISABLE_TQDM": "1"}
    out = subprocess.run([sys.executable, "-m", "stateserve.entrypoints.cli", "generate", "--model", path, "--prompt",
                          "hi", "--max-tokens", "2", "--dtype", "bfloat16", "--kv-cache-memory-bytes", str(1 << 24),
                          "--pipeline-parallel-size", "2"], capture_output=True, text=True, env=env, timeout=300)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    pattern = (r"Pipeline rank (\d)/2: layers (\d+)-(\d+) loaded \(its stage\); resident memory peaked ([\d.]+) GiB "
               r"above the [\d.]+ GiB before loading \(the whole model: ([\d.]+) GiB\)")
    ranks = {int(m.group(1)): (int(m.group(2)), int(m.group(3)), float(m.group(4)), float(m.group(5)))
             for m in re.finditer(pattern, log)}
    assert ranks.keys() == {0, 1} and (ranks[0][:2], ranks[1][:2]) == ((0, 5), (6, 11)), log
    for *_, peak, whole in ranks.values():
        assert 0.15 < whole < 0.2 and peak < 0.75 * whole, log
