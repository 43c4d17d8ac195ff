"""Preemption by recompute and prefix-cache snapshots on the hybrid architectures (recurrent state slots and paged
KV together), one test of each parametrized over the architectures. Each model is the tiny one of its own test file
(that file's _build), and each tight cache is sized by what it holds, not in bytes: num_gpu_blocks_override KV blocks
of 16 tokens, and max_num_seqs running sequences (one state slot each)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from stateserve import LLM, SamplingParams
from test_bamba import _build as bamba
from test_falcon_h1 import _build as falcon_h1
from test_granitemoehybrid import _build as granitemoehybrid
from test_jamba import _build as jamba
from test_nemotron_h import _build as nemotron_h
from test_qwen3_next import _build as qwen3_next
from test_zamba2 import _build as zamba2
from utils import assert_cache_sized, assert_greedy_matches, hf_greedy

# six prompts of 20-35 tokens, 30 new tokens each: every sequence needs four or five blocks
SIX_MIXED = [[(5 * i + 11 * j) % 290 + 3 for j in range(20 + 3 * i)] for i in range(6)]


def _thirty_token_prompts(n: int) -> list[list[int]]:
    return [list(range(10 + 7 * i, 40 + 7 * i)) for i in range(n)]


@dataclass(frozen=True)
class Tight:
    build: object  # the architecture's tiny-model builder: build(tmp_path, **config) -> (hf model, folder)
    prompts: list[list[int]]
    max_tokens: int
    max_num_batched_tokens: int
    num_blocks: int  # KV blocks: fewer than the running sequences need, so some get preempted
    max_num_seqs: int  # running sequences, and so running state slots
    config: dict = field(default_factory=dict)
    exact: bool = True  # token for token against the roomy run (else a near-tie may flip at the divergence)
    check_hf: bool = True  # the roomy run's first two outputs are transformers' greedy too


# The sizes are those the byte budgets of the per-model tests came to (the same blocks and running slots).
PREEMPTION = {
    "bamba": Tight(bamba, SIX_MIXED, 30, 64, num_blocks=8, max_num_seqs=5,
                   config=dict(attn_layer_indices=[1, 3])),  # two KV layers
    "falcon_h1": Tight(falcon_h1, _thirty_token_prompts(5), 20, 32, num_blocks=10, max_num_seqs=4, exact=False,
                       check_hf=False),  # parity with transformers: test_falcon_h1.py
    # two attention layers: KV blocks weigh more against the Mamba state
    "granitemoehybrid": Tight(granitemoehybrid, _thirty_token_prompts(6), 24, 32, num_blocks=10, max_num_seqs=4,
                              config=dict(layer_types=["mamba", "attention", "attention"]), exact=False,
                              check_hf=False),
    "jamba": Tight(jamba, SIX_MIXED, 30, 64, num_blocks=9, max_num_seqs=5),
    "nemotron_h": Tight(nemotron_h, SIX_MIXED, 30, 64, num_blocks=8, max_num_seqs=8,
                        config=dict(hybrid_override_pattern="M*-*", head_dim=16)),  # two KV layers
    "qwen3_next": Tight(qwen3_next, SIX_MIXED, 30, 64, num_blocks=8, max_num_seqs=8, check_hf=False),
    "zamba2": Tight(zamba2, _thirty_token_prompts(4), 16, 32, num_blocks=10, max_num_seqs=4, exact=False,
                    check_hf=False),
}


def _params(max_new: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("arch", list(PREEMPTION))
def test_preemption_recompute_gives_same_tokens(arch, tmp_path):
    """A cache too small for the running sequences preempts some; recomputed from scratch (their state slots freed
    and re-zeroed too), they give the tokens of an engine with room for all."""
    spec = PREEMPTION[arch]
    hf, path = spec.build(tmp_path, **spec.config)
    prompts = [{"prompt_token_ids": p} for p in spec.prompts]
    running = min(spec.max_num_seqs, len(spec.prompts))
    assert running * math.ceil((min(map(len, spec.prompts)) + spec.max_tokens) / 16) > spec.num_blocks
    # reference: the same engine with room for every sequence
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=spec.max_num_batched_tokens,
             enable_prefix_caching=False) as roomy:
        ref = [o.outputs[0].token_ids for o in roomy.generate(prompts, _params(spec.max_tokens))]
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=spec.max_num_batched_tokens,
             enable_prefix_caching=False, num_gpu_blocks_override=spec.num_blocks,
             max_num_seqs=spec.max_num_seqs) as tight:
        assert_cache_sized(tight, spec.num_blocks, spec.max_num_seqs)
        outs = [o.outputs[0].token_ids for o in tight.generate(prompts, _params(spec.max_tokens))]
        assert tight.llm_engine.stats["preemptions"] > 0
        if spec.exact:
            assert outs == ref
        else:
            assert_greedy_matches(outs, ref, hf, spec.prompts)
        tight.llm_engine.check_integrity()
        assert tight.llm_engine.cache.is_idle_and_full()
    if spec.check_hf:
        ids = spec.prompts[:2]
        assert_greedy_matches(ref[:2], hf_greedy(hf, ids, spec.max_tokens), hf, ids)


SNAPSHOTS = {"falcon_h1": (falcon_h1, "align"), "granitemoehybrid": (granitemoehybrid, "all"),
             "zamba2": (zamba2, "all")}


@pytest.mark.parametrize("arch", list(SNAPSHOTS))
def test_prefix_cache_snapshots(arch, tmp_path):
    """Mamba snapshots taken mid-chunk (block size 4) and resumed from must not change greedy output."""
    build, mode = SNAPSHOTS[arch]
    hf, path = build(tmp_path)
    shared = list(range(30, 60))
    first = [shared + [7, 8], shared[:13] + [9]]
    second = [shared + [7, 8, 11], shared[:13] + [250, 3]]
    ref = hf_greedy(hf, first + second, 6)
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=16, block_size=4, enable_prefix_caching=True,
             mamba_cache_mode=mode) as llm:
        outs = [o for rnd in (first, second) for o in llm.generate([{"prompt_token_ids": p} for p in rnd],
                                                                  _params(6))]
        assert_greedy_matches([o.outputs[0].token_ids for o in outs], ref, hf, first + second)
        assert min(o.num_cached_tokens for o in outs[len(first):]) >= 12  # really resumed from snapshots
        llm.llm_engine.check_integrity()
