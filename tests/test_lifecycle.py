"""Lifecycle: load logging, idempotent shutdown that returns memory, cached environment settings, and the
reference runner agreeing with the default one on every supported model kind."""
from __future__ import annotations

import gc
import logging
import os
import random

import pytest

from stateserve import LLM, SamplingParams, envs
from prefix_models import BUILDERS, model_path


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return model_path("llama", tmp_path_factory)


def test_load_logs_memory_and_time(llama_path, caplog):
    with caplog.at_level(logging.INFO, logger="stateserve"):
        LLM(llama_path, skip_tokenizer_init=True).shutdown()
    text = caplog.text
    assert "Model loading took" in text and "GiB memory and" in text and "seconds" in text
    assert "Available KV cache memory" in text and "KV blocks" in text


def test_shutdown_cycles_keep_memory_flat(llama_path):
    prompt = [{"prompt_token_ids": list(range(3, 40))}]
    params = SamplingParams(max_tokens=8, temperature=0)
    kw = dict(skip_tokenizer_init=True, kv_cache_memory_bytes=64 << 20, load_format="dummy",
              hf_overrides={"hidden_size": 256, "intermediate_size": 512})
    for _ in range(2):  # warm up allocator and lazy imports
        with LLM(llama_path, **kw) as llm:
            llm.generate(prompt, params)
    gc.collect()
    base = rss_bytes()
    for _ in range(10):
        llm = LLM(llama_path, **kw)
        llm.generate(prompt, params)
        llm.shutdown()
        llm.shutdown()
    gc.collect()
    # ten engines each holding a 64 MiB cache would add 640 MiB if anything leaked
    assert rss_bytes() - base < 48 << 20


def test_envs_cache(monkeypatch):
    monkeypatch.setenv("STATESERVE_CPU_KV_CACHE_SPACE", "1.5")
    envs.disable_envs_cache()
    assert envs.STATESERVE_CPU_KV_CACHE_SPACE == 1.5
    envs.enable_envs_cache()
    monkeypatch.setenv("STATESERVE_CPU_KV_CACHE_SPACE", "2.5")
    assert envs.STATESERVE_CPU_KV_CACHE_SPACE == 1.5  # frozen
    envs.disable_envs_cache()
    assert envs.STATESERVE_CPU_KV_CACHE_SPACE == 2.5
    monkeypatch.setenv("STATESERVE_DISABLE_TQDM", "maybe")
    with pytest.raises(ValueError, match="STATESERVE_DISABLE_TQDM"):
        envs.STATESERVE_DISABLE_TQDM
    with pytest.raises(AttributeError):
        envs.STATESERVE_NO_SUCH_VARIABLE
    assert "STATESERVE_RUNNER" in dir(envs)


def test_frozen_environ_is_what_the_process_runs_with(monkeypatch):
    """What an engine hands the processes it starts: the frozen strings while the cache is on (os.environ may have
    changed since), os.environ's otherwise; apply_environ sets and unsets them and reads afresh."""
    monkeypatch.setenv("STATESERVE_PACK_LINEARS", "0")
    monkeypatch.delenv("STATESERVE_HUGE_PAGES", raising=False)
    envs.disable_envs_cache()
    envs.enable_envs_cache()
    monkeypatch.setenv("STATESERVE_PACK_LINEARS", "1")
    monkeypatch.setenv("STATESERVE_HUGE_PAGES", "0")
    frozen = envs.frozen_environ()
    assert frozen["STATESERVE_PACK_LINEARS"] == "0" and frozen["STATESERVE_HUGE_PAGES"] is None
    envs.disable_envs_cache()
    assert envs.frozen_environ()["STATESERVE_PACK_LINEARS"] == "1"
    envs.apply_environ(frozen)
    assert os.environ["STATESERVE_PACK_LINEARS"] == "0" and "STATESERVE_HUGE_PAGES" not in os.environ
    assert envs.STATESERVE_PACK_LINEARS is False and envs.STATESERVE_HUGE_PAGES is True


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_reference_runner_agrees(kind, tmp_path_factory, monkeypatch):
    path = model_path(kind, tmp_path_factory)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 300) for _ in range(n)]} for n in (1, 7, 23, 40)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=16) as llm:
        fast = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    monkeypatch.setenv("STATESERVE_RUNNER", "reference")
    envs.disable_envs_cache()
    try:
        with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=16) as ref_llm:
            assert type(ref_llm.llm_engine.runner).__name__ == "ReferenceRunner"
            ref = [o.outputs[0].token_ids for o in ref_llm.generate(prompts, params)]
            ref_llm.llm_engine.check_integrity()
    finally:
        monkeypatch.delenv("STATESERVE_RUNNER")
        envs.disable_envs_cache()
    assert fast == ref


def test_max_num_seqs_lowered_with_warning(llama_path, caplog):
    block_bytes = 2 * 16 * 2 * 8 * 4 * 2  # K+V, 16 tokens, 2 kv heads of 8 dims, fp32, 2 layers
    with caplog.at_level(logging.WARNING, logger="stateserve"):
        with LLM(llama_path, skip_tokenizer_init=True, max_num_seqs=64,
                 kv_cache_memory_bytes=10 * block_bytes) as llm:
            assert llm.llm_engine.max_num_seqs == 10
            out = llm.generate([{"prompt_token_ids": [5] * 20}] * 12, SamplingParams(max_tokens=4))
            assert len(out) == 12
    assert "max_num_seqs=64 lowered to 10" in caplog.text


def test_prompt_that_can_never_fit_is_rejected(llama_path):
    with LLM(llama_path, skip_tokenizer_init=True, num_gpu_blocks_override=3) as llm:
        with pytest.raises(ValueError, match="needs 4 KV blocks"):
            llm.generate([{"prompt_token_ids": [5] * 60}])
        assert len(llm.generate([{"prompt_token_ids": [5] * 20}])) == 1


# ---- activation profiling and cache sizing -----------------------------------------------------------------
def _bert(tmp_path_factory):
    from transformers import BertConfig, BertModel
    from utils import build_hf_model, save_model
    hf = build_hf_model(BertConfig, BertModel, vocab_size=120, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=40, type_vocab_size=2)
    return save_model(hf, str(tmp_path_factory.mktemp("bert")))


def _bart(tmp_path_factory):
    from transformers import BartConfig, BartForConditionalGeneration
    from utils import build_hf_model, save_model
    hf = build_hf_model(BartConfig, BartForConditionalGeneration, vocab_size=300, d_model=32, encoder_layers=1,
                        decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                        decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=1, bos_token_id=0,
                        eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)
    return save_model(hf, str(tmp_path_factory.mktemp("bart")))


@pytest.mark.parametrize("kind", ["llama", "mamba", "mamba2", "bamba", "bert", "bart"])
def test_profile_runs_for_every_kind(kind, tmp_path_factory, caplog):
    from stateserve.runner import activation_profile

    path = {"bert": _bert, "bart": _bart}.get(kind, lambda f: model_path(kind, f))(tmp_path_factory)
    activation_profile._cpu_profiles.clear()  # measure now, not from an earlier test's engine
    with caplog.at_level(logging.INFO, logger="stateserve"):
        with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=300) as llm:
            runner = llm.llm_engine.runner
            if kind == "bart":  # no dummy forward: a decoder step needs a real encoder input
                assert runner.activation_source.startswith("estimated")
                assert runner.activation_bytes == 300 * 300 * 4 * 2
            else:
                assert runner.activation_source == "measured", runner.activation_source
                assert "Activation memory:" in caplog.text and "dummy forward of 256 tokens" in caplog.text
                assert len(activation_profile._cpu_profiles) == 1  # kept: the next engine of this config skips it
            if runner.caches.storage is not None:  # nothing of the dummy forward is left in any cache
                for t in [t for kv in runner.caches.storage.kv.values() for t in kv] + \
                         [t for layer in runner.caches.storage.states.values() for t in layer.values()]:
                    assert not t.any()
            for m in runner.model.modules():
                if hasattr(m, "states") and runner.caches.storage is not None and not runner.caches.storage.states:
                    assert m.states is None  # temporary profile states were unbound
    if kind == "bert":
        with LLM(path, skip_tokenizer_init=True) as llm:
            assert len(llm.embed([{"prompt_token_ids": [5, 6, 7]}])) == 1


def test_profile_sees_activations_and_scales(tmp_path_factory):
    """In a fresh process: resident-memory sampling only sees growth, and a process that already freed big
    tensors reuses that memory (glibc also raises its mmap threshold), so the suite's process would hide it."""
    import subprocess
    import sys

    path = model_path("llama", tmp_path_factory)
    script = f"""
from stateserve import LLM
# wide enough that a 256-token forward needs megabytes: [256, 8192] float32 MLP activations are 8 MiB
kw = dict(skip_tokenizer_init=True, load_format="dummy", hf_overrides={{"intermediate_size": 8192}})
with LLM({str(path)!r}, max_num_batched_tokens=256, **kw) as llm:
    small = llm.llm_engine.runner.activation_bytes
assert small > 4 << 20, small
with LLM({str(path)!r}, max_num_batched_tokens=1024, **kw) as llm:  # same 256-token forward, scaled by 4
    assert llm.llm_engine.runner.activation_bytes == 4 * small
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_cpu_budget_subtracts_activations(llama_path, monkeypatch):
    from stateserve.runner import model_runner

    with LLM(llama_path, skip_tokenizer_init=True) as llm:
        runner = llm.llm_engine.runner
        monkeypatch.setattr(model_runner, "_available_host_memory", lambda: 10 << 30)
        runner.activation_bytes = 0
        assert runner.cache_budget_bytes() == 4 << 30  # the default space fits in 40% of 10 GiB
        runner.activation_bytes = 2 << 30
        assert runner.cache_budget_bytes() == int(0.4 * (8 << 30))
        monkeypatch.setenv("STATESERVE_CPU_KV_CACHE_SPACE", "1")
        envs.disable_envs_cache()
        try:
            assert runner.cache_budget_bytes() == 1 << 30
        finally:
            monkeypatch.delenv("STATESERVE_CPU_KV_CACHE_SPACE")
            envs.disable_envs_cache()


@pytest.mark.parametrize("setting,free_bytes,expect_packed", [("1", None, True), ("0", None, False),
                                                             ("1", 1024, False)])
def test_linear_packing_switch_and_memory_guard(llama_path, monkeypatch, caplog, setting, free_bytes, expect_packed):
    """Linear weights get a copy in the panel kernel's layout by default; STATESERVE_PACK_LINEARS=0 or too little
    free memory (the copy over a quarter of it) leaves them plain, saying why. Greedy tokens are the same either
    way."""
    import torch

    from stateserve.layers import linear
    from stateserve.platform import cpu_kernels
    from stateserve.runner import model_runner

    kernels = cpu_kernels.load()
    if kernels is None or not kernels.packed_linear_supported(torch.float32, 64):
        pytest.skip("no panel kernel here")
    monkeypatch.setenv("STATESERVE_PACK_LINEARS", setting)
    envs.disable_envs_cache()
    if free_bytes is not None:
        monkeypatch.setattr(model_runner, "_available_host_memory", lambda: free_bytes)
    prompts = [{"prompt_token_ids": list(range(3, 40))}, {"prompt_token_ids": list(range(50, 60))}]
    with caplog.at_level(logging.INFO, logger="stateserve"):
        llm = LLM(llama_path, skip_tokenizer_init=True, kv_cache_memory_bytes=64 << 20)
    try:
        linears = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, linear.FastLinear)]
        assert linears and all((m.packed is not None) == expect_packed for m in linears)
        if free_bytes is not None:
            assert "packing skipped" in caplog.text
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0))
        tokens = [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()
    monkeypatch.setenv("STATESERVE_PACK_LINEARS", "0")
    envs.disable_envs_cache()
    with LLM(llama_path, skip_tokenizer_init=True, kv_cache_memory_bytes=64 << 20) as plain:
        assert [list(o.outputs[0].token_ids) for o in plain.generate(prompts, SamplingParams(max_tokens=6,
                                                                                            temperature=0))] == tokens
