"""Zamba v1 (ZambaForCausalLM): greedy parity with transformers under batched chunked prefill, teacher-forced logits
through the real caches (tied shared block or per-depth copies, GQA, one or several Mamba heads), prefix caching
(mamba_cache_mode all / align, logprobs compared) and preemption by recompute, and bad configs refused with a clear
error. The hybrid structure is Zamba2's (tests/test_zamba2.py); this file tests what v1 changes: the multi-head
Mamba1 mixer (interleaved in_proj, per-head x_proj / dt_proj), the adapter-free shared block, its gelu MLP."""
from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import ZambaConfig, ZambaForCausalLM

from stateserve import LLM, SamplingParams
from stateserve.models.loader import iterate_safetensors, load_weights
from stateserve.models.zamba import ZambaForCausalLM as Ours
from utils import (assert_greedy_matches, build_hf_model, engine_teacher_forced_logits, hf_greedy, hf_logits,
                   save_model)

BASE = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4,
            num_key_value_heads=2, n_mamba_heads=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
            layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "mamba"], tie_word_embeddings=False,
            max_position_embeddings=256, pad_token_id=0, eos_token_id=1,
            # at 0.3 float32 rounding in transformers' own result (measured against float64) reaches 2.5e-3
            initializer_range=0.15)
PROMPTS = [list(range(5, 5 + n)) for n in (1, 3, 9, 16, 17, 40)] + [[250, 7, 11]]


def _build(tmp_path, **extra):
    hf = build_hf_model(ZambaConfig, ZambaForCausalLM, **{**BASE, **extra})
    return hf, save_model(hf, str(tmp_path / "zamba"))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = {}

    def get(name: str = "base", **extra):
        if name not in cache:
            cache[name] = _build(tmp_path_factory.mktemp(name), **extra)
        return cache[name]
    return get


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=0)


def _scored(llm: LLM, prompts, n: int = 8) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens with their logprobs: a slightly wrong state may leave decisive tokens alone, not logprobs."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(n), use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outs]


def _assert_same(ours, ref, tol: float = 1e-4) -> None:
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(ours, ref, strict=True):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < tol, (logprobs, ref_logprobs)


@pytest.mark.parametrize("case", ["base", "tied"])
def test_weight_names_load_one_to_one(case, built):
    hf, path = built(case, **({"tie_word_embeddings": True} if case == "tied" else {}))
    ours = Ours(hf.config, torch.float32)
    names = [n for n, _ in iterate_safetensors(path, show_progress=False)]
    mapped = {t[0] for t in map(ours.map_weight_name, names) if t is not None}
    # named_parameters() names a shared parameter once (the block at its first depth, the embedding)
    assert mapped - set(ours.tied_params) == set(dict(ours.named_parameters()))
    load_weights(ours, iterate_safetensors(path, show_progress=False))  # strict: every tensor lands, none missing


def test_greedy_parity_chunked(built):
    """Seven prompts at once, 16-token steps: prompts split across steps and batched with others' decodes."""
    hf, path = built()
    ref = hf_greedy(hf, PROMPTS, 10)
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=16, enable_prefix_caching=False) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy(10), use_tqdm=False)
        assert_greedy_matches([o.outputs[0].token_ids for o in outs], ref, hf, PROMPTS, tol=1e-3)
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.cache.is_idle_and_full()


# name -> (config changes, the chunk sizes the 50 tokens are fed in: token by token runs the decode path)
TF_CASES = {
    "base": ({}, (1, 7, 50)),
    # one shared block tied across depths (transformers ties it only with tied embeddings), MHA, one Mamba head,
    # silu MLP, a hybrid first layer
    "tied-variants": (dict(tie_word_embeddings=True, num_key_value_heads=4, n_mamba_heads=1, hidden_act="silu",
                           layers_block_type=["hybrid", "mamba", "hybrid", "hybrid", "mamba"]), (5, 50)),
}


@pytest.mark.parametrize("case", list(TF_CASES))
def test_teacher_forced_logits(case, built):
    extra, chunks = TF_CASES[case]
    hf, path = built(case, **extra)
    tokens = [(7 * i) % 290 + 3 for i in range(50)]
    ref = hf_logits(hf, tokens)
    with LLM(path, skip_tokenizer_init=True) as llm:
        for chunk in chunks:
            torch.testing.assert_close(engine_teacher_forced_logits(llm, tokens, chunk), ref, atol=5e-4, rtol=1e-4)


def test_prefix_cache_exact_with_hits(built):
    """Recurrent snapshots at 16-token block boundaries (every boundary with "all", chunk ends with "align") and
    the paged KV together: the second pass resumes from them and gives the cold tokens and logprobs."""
    _, path = built()
    shared = [(7 * j) % 290 + 3 for j in range(5 * 16 + 3)]
    prompts = [shared + [11, 12, 13], shared[:40] + [250, 3], shared + [9] * 20]
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=32, block_size=16,
             enable_prefix_caching=False) as cold:
        ref = _scored(cold, prompts)
    for mode in ("all", "align"):
        with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=32, block_size=16,
                 enable_prefix_caching=True, mamba_cache_mode=mode) as llm:
            first = [_scored(llm, [p])[0] for p in prompts]
            again = [llm.generate([{"prompt_token_ids": p}], _greedy(8), use_tqdm=False)[0] for p in prompts]
            _assert_same(first, ref)
            _assert_same([(o.outputs[0].token_ids, [lp[t].logprob for t, lp in
                                                    zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
                          for o in again], ref)
            assert all(o.num_cached_tokens >= 32 for o in again), (mode, [o.num_cached_tokens for o in again])
            llm.llm_engine.check_integrity()
            assert llm.llm_engine.cache.is_idle_and_full()


# six prompts of 20-35 tokens, 20 new tokens each: every sequence needs three or four 16-token blocks per depth
SIX_MIXED = [[(5 * i + 11 * j) % 290 + 3 for j in range(20 + 3 * i)] for i in range(6)]


def test_preemption_recompute_exact(built):
    """Too few KV blocks for six sequences: some are preempted, their state slots freed and re-zeroed, and
    recomputed; they give the tokens and logprobs of an engine with room for all."""
    _, path = built()
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=64, enable_prefix_caching=False) as roomy:
        ref = _scored(roomy, SIX_MIXED, 20)
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=64, enable_prefix_caching=False,
             num_gpu_blocks_override=8, max_num_seqs=8) as tight:
        outs = _scored(tight, SIX_MIXED, 20)
        assert tight.llm_engine.stats["preemptions"] > 0
        _assert_same(outs, ref)
        tight.llm_engine.check_integrity()
        assert tight.llm_engine.cache.is_idle_and_full()


def _edit_config(path: str, **changes) -> None:
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(file, "w") as f:
        json.dump(cfg, f)


def test_unknown_layer_type_is_refused(tmp_path):
    _, path = _build(tmp_path, num_hidden_layers=2, layers_block_type=["mamba", "hybrid"])
    _edit_config(path, layers_block_type=["mamba", "full_attention"])
    with pytest.raises(ValueError, match=r"Zamba: layers_block_type has unknown layer type\(s\) \[.full_attention.\]"):
        LLM(path, skip_tokenizer_init=True)


@pytest.mark.parametrize("change, message", [
    (dict(attention_hidden_size=48), r"attention_hidden_size=48 is not supported.*2 \* hidden_size = 64"),
    (dict(hidden_mamba_act="gelu"), r"hidden_mamba_act='gelu' is not supported"),
    (dict(n_mamba_heads=3), r"not divisible by n_mamba_heads=3"),
])
def test_unsupported_options_are_refused(change, message):
    cfg = ZambaConfig(**BASE)
    for key, value in change.items():  # set after construction: ZambaConfig validates some of these itself
        setattr(cfg, key, value)
    with pytest.raises(ValueError, match=message):
        Ours(cfg, torch.float32)
