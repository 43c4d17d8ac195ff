"""Tensor parallelism (two ranks: a worker process, gloo over loopback) of the recurrent and MoE layers: Mamba
(MambaMixer), Mamba2 with one B/C group (its gated norm's group spans the ranks), Jamba (Mamba1 + attention +
SparseMoE), Bamba (Mamba2 with local norm groups + attention) and Qwen3-Next (Gated DeltaNet in its grouped layout,
SparseMoE with a shared expert). Each is the tiny float32 model of its own test file, split over 2 ranks against
the same engine on 1 rank and transformers: batched greedy tokens under chunked prefill, logprobs to float32
round-off, prefix-cache snapshots resumed from, preemption by recompute, and a size that does not divide (through
LLM, and each rule's refusal in process)."""
from __future__ import annotations

import pytest

from stateserve import LLM, SamplingParams
from stateserve.distributed.driver import RankFailedError
from stateserve.distributed.sharding import TensorParallelError
from test_bailing_hybrid import _build as bailing
from test_bamba import _build as bamba
from test_jamba import _build as jamba
from test_kimi_linear import _build as kimi
from test_mamba import _build as mamba_build
from test_mamba2 import _build as mamba2_build
from test_minimax import _build as minimax
from test_lfm2 import _build as lfm
from test_nemotron_h import _build as nemotron_h
from test_olmo_hybrid import _build as olmo_hybrid
from test_qwen3_next import _build as qwen3_next
from test_recurrent_gemma import _build as recurrent_gemma
from test_xlstm import _build as xlstm
from state_checks import check_speculative_rollback_exact
from utils import assert_greedy_matches, engine_teacher_forced_logits, hf_greedy

# mixed lengths: one token, a few, several 16-token prefill chunks
PROMPTS = [[250], [7, 3, 2], list(range(20, 29)), list(range(100, 117)), [(17 * i) % 290 + 3 for i in range(40)]]
# six prompts of 20-35 tokens: with 30 new tokens each needs 4-5 KV blocks (test_hybrid_cache.py's sizes)
SIX_MIXED = [[(5 * i + 11 * j) % 290 + 3 for j in range(20 + 3 * i)] for i in range(6)]
MAX_NEW = 10
TOP = 5  # logprobs per step compared
# Split products sum in another order than on one rank: float32 round-off (~1e-7 relative) grown through the layers
# and the recurrence. Logprob differences must stay within this fraction of the logits' scale (the spread of the
# largest of the top logprobs, at least 1), far below what one mis-split channel makes (measured: <= 1.5e-5).
REL_TOL = 1e-4


def mamba(tmp_path, **extra):
    return mamba_build("mamba", tmp_path, **extra)


def mamba2(tmp_path, **extra):
    return mamba2_build(tmp_path, **extra)


def _llm(path: str, tp: int, **kw) -> LLM:
    kw = {"max_num_batched_tokens": 16, "enable_prefix_caching": False, "kv_cache_memory_bytes": 1 << 24, **kw}
    return LLM(path, skip_tokenizer_init=True, tensor_parallel_size=tp, **kw)


def _generate(llm: LLM, prompts: list[list[int]], max_new: int, logprobs: int | None = TOP):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True, logprobs=logprobs))
    return outs, [o.outputs[0].token_ids for o in outs]


def _assert_logprobs_close(ours, ref) -> None:
    """Same tokens, and each step's logprobs (the tokens both rank among the top) within REL_TOL of the scale."""
    worst = 0.0
    for a, b in zip(ours, ref):
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            scale = max(1.0, max(abs(lp.logprob) for lp in step_b.values()))
            common = step_a.keys() & step_b.keys()
            assert len(common) >= TOP - 1, (step_a, step_b)  # at most a near-tie at the last place swapped
            for tok in common:
                diff = abs(step_a[tok].logprob - step_b[tok].logprob)
                assert diff <= REL_TOL * scale, (tok, step_a[tok].logprob, step_b[tok].logprob, scale)
                worst = max(worst, diff / scale)
    print(f"largest logprob difference: {worst:.2e} of the scale")


# (builder, its config, tolerance of transformers' near-ties at a divergence: test_<arch>.py's)
PARITY = {
    "mamba": (mamba, {}, 1e-4),
    "mamba2_g1": (mamba2, {"n_groups": 1, "chunk_size": 8}, 1e-4),  # the gated norm's group spans both ranks
    "bamba": (bamba, {}, 1e-4),  # two B/C groups: one per rank, the norm groups local
    "qwen3_next": (qwen3_next, {}, 1e-3),  # gated attention ([q | gate] rows per head) split too
    "lfm3": (lambda tmp_path, **kw: lfm("lfm3", tmp_path, **kw), {}, 1e-4),  # attention with a per-head gate
    "kimi_linear": (kimi, {}, 1e-4),  # KDA and MLA (the latent cache whole on each rank), MoE
    "bailing_hybrid": (bailing, {}, 1e-4),  # KDA with full-rank gates, MLA with rotary and a per-head gate
    "minimax": (minimax, {}, 1e-4),  # lightning attention (its norm over all heads spans the ranks), MoE
    # q/k norms over all heads span the ranks; with one KV head it is replicated on both (its squares count once)
    "olmo_hybrid": (olmo_hybrid, {}, 1e-4),
    "olmo_hybrid_kv1": (olmo_hybrid, {"num_key_value_heads": 1}, 1e-4),
    "recurrent_gemma": (recurrent_gemma, {}, 1e-4),  # the RG-LRU's heads (its gates' blocks), local attention, MLP
    "xlstm": (xlstm, {}, 1e-4),  # mLSTM heads (their gates, per-head norms, matrix states), the feed-forward
    # NemotronH with every bias on (kept once on the split products) and its MoE with latent experts
    "nemotron_h": (nemotron_h, {"layers_block_type": ["mamba", "moe", "attention", "mlp"], "use_bias": True,
                                "mlp_bias": True, "moe_latent_size": 16}, 1e-4),
}


@pytest.mark.parametrize("arch", list(PARITY))
def test_two_ranks_match_one_rank_and_transformers(arch, tmp_path):
    build, config, tol = PARITY[arch]
    hf, path = build(tmp_path, **config)
    ref = hf_greedy(hf, PROMPTS, MAX_NEW)
    tokens = PROMPTS[-1]
    with _llm(path, 1) as llm:
        one, one_tokens = _generate(llm, PROMPTS, MAX_NEW)
        one_forced = engine_teacher_forced_logits(llm, tokens, 7)
    with _llm(path, 2) as llm:
        two, two_tokens = _generate(llm, PROMPTS, MAX_NEW)
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.cache.is_idle_and_full()
        for chunk in (1, 7):  # one-token decode steps and 7-token prefill chunks, through the real caches
            forced = engine_teacher_forced_logits(llm, tokens, chunk)
            scale = one_forced.abs().amax(-1, keepdim=True).clamp(min=1.0)
            assert ((forced - one_forced).abs() <= REL_TOL * scale).all(), (forced - one_forced).abs().max()
    assert two_tokens == one_tokens
    assert_greedy_matches(two_tokens, ref, hf, PROMPTS, tol=tol)
    _assert_logprobs_close(two, one)


@pytest.mark.parametrize("arch", ["mamba2_g1", "bamba"])
def test_speculative_rollback_on_two_ranks(arch, tmp_path, monkeypatch):
    """Verify steps with rejected drafts on two ranks: the kept states, the rollback's slot swaps and the committed
    snapshots (journalled to the worker) leave plain one-rank decoding's tokens and logprobs, on both passes."""
    build, config, _ = PARITY[arch]
    _, path = build(tmp_path, **config)
    check_speculative_rollback_exact(path, monkeypatch, tensor_parallel_size=2)


def test_jamba_moe_and_preemption(tmp_path):
    """Jamba (Mamba1 with weighted dt/B/C norms, attention, SparseMoE): two ranks match one rank and transformers
    under chunked prefill, and with a cache too small for the running sequences (some preempted and recomputed)
    still give the same tokens."""
    hf, path = jamba(tmp_path)
    max_new = 30
    with _llm(path, 1) as llm:
        one, one_tokens = _generate(llm, SIX_MIXED, max_new)
        one_forced = engine_teacher_forced_logits(llm, SIX_MIXED[-1], 7)
    with _llm(path, 2) as llm:
        two, two_tokens = _generate(llm, SIX_MIXED, max_new)
        forced = engine_teacher_forced_logits(llm, SIX_MIXED[-1], 7)
    scale = one_forced.abs().amax(-1, keepdim=True).clamp(min=1.0)
    assert ((forced - one_forced).abs() <= REL_TOL * scale).all(), (forced - one_forced).abs().max()
    assert two_tokens == one_tokens
    _assert_logprobs_close(two, one)
    ids = SIX_MIXED[:3]
    assert_greedy_matches(two_tokens[:3], hf_greedy(hf, ids, max_new), hf, ids)
    with _llm(path, 2, num_gpu_blocks_override=9, max_num_seqs=5) as tight:
        _, tight_tokens = _generate(tight, SIX_MIXED, max_new, logprobs=None)
        assert tight.llm_engine.stats["preemptions"] > 0
        tight.llm_engine.check_integrity()
        assert tight.llm_engine.cache.is_idle_and_full()
    assert tight_tokens == one_tokens


@pytest.mark.parametrize("arch,mode", [("mamba2_g1", "all"), ("mamba2_g1", "align"), ("bamba", "all"),
                                       ("bamba", "align")])
def test_prefix_cache_snapshots(arch, mode, tmp_path):
    """State snapshots taken mid-chunk (block size 4) on every rank and resumed from in a second round: its prompts
    hit the cache and the tokens stay transformers'."""
    build, config, tol = PARITY[arch]
    hf, path = build(tmp_path, **config)
    shared = list(range(30, 60))
    first = [shared + [7, 8], shared[:13] + [9]]
    second = [shared + [7, 8, 11], shared[:13] + [250, 3], shared[:22]]
    ref = hf_greedy(hf, first + second, 6)
    with _llm(path, 2, block_size=4, enable_prefix_caching=True, mamba_cache_mode=mode) as llm:
        outs = [o for rnd in (first, second) for o in _generate(llm, rnd, 6, logprobs=None)[0]]
        assert llm.llm_engine.stats["prefix_cache_hits"] > 0
        hits = [o.num_cached_tokens for o in outs[len(first):]]
        assert min(hits) >= 12, hits  # every prompt of the second round resumed from a snapshot
        llm.llm_engine.check_integrity()
    assert_greedy_matches([o.outputs[0].token_ids for o in outs], ref, hf, first + second, tol=tol)


def test_size_that_does_not_divide_is_refused(tmp_path):
    """Three Mamba2 heads over two ranks: TensorParallelError naming the size. (Rank 0's own error, or, when the
    worker's identical error ended it first, the RankFailedError that rank 0 raises from it.)"""
    _, path = mamba2(tmp_path, num_heads=3, hidden_size=24)
    with pytest.raises((TensorParallelError, RankFailedError)) as info:
        _llm(path, 2)
    err = info.value if isinstance(info.value, TensorParallelError) else info.value.__cause__
    assert isinstance(err, TensorParallelError), repr(info.value)
    assert "Mamba2 num_heads=3 is not divisible by tensor_parallel_size=2" in str(err)


def _mamba2_mixer(**kw):
    from stateserve.layers.mamba2_mixer import Mamba2Mixer
    return Mamba2Mixer(**{"hidden_size": 32, "num_heads": 4, "head_dim": 8, "state_size": 8, "n_groups": 2, **kw})


def _delta_net(num_k_heads: int, num_v_heads: int):
    import torch

    from stateserve.layers.delta_rule import GatedDeltaNet
    return GatedDeltaNet(32, num_k_heads, num_v_heads, 8, 8, 4, 1e-6, "silu", torch.float32)


def _moe(intermediate: int):
    from stateserve.layers.moe import SparseMoE
    return SparseMoE(4, 2, 32, intermediate, norm_topk_prob=True)


def _mamba(intermediate: int):
    from stateserve.layers.selective_scan import MambaMixer
    return MambaMixer(32, intermediate, 8, 4, 4, True, False)


# layer, tensor_parallel_size, the message
REFUSED = {
    "mamba_d_inner": (lambda: _mamba(30), 4, "intermediate_size (Mamba d_inner)=30 is not divisible by "
                                            "tensor_parallel_size=4"),
    "mamba2_heads": (lambda: _mamba2_mixer(num_heads=6, n_groups=3), 4, "Mamba2 num_heads=6 is not divisible"),
    "mamba2_groups": (lambda: _mamba2_mixer(num_heads=6, n_groups=3), 2, "Mamba2 n_groups=3 is neither a multiple "
                                                                         "nor a divisor of tensor_parallel_size=2"),
    # 48 channels, 24 a rank: a norm group of 16 is neither within a rank nor whole ranks
    "mamba2_norm_group": (lambda: _mamba2_mixer(num_heads=6, norm_group_size=16), 2,
                          "gated norm groups of 16 channels cannot be split over tensor_parallel_size=2 ranks of 24"),
    "delta_net_heads": (lambda: _delta_net(3, 6), 2, "linear_num_key_heads=3 is not a multiple of "
                                                     "tensor_parallel_size=2"),
    "delta_net_value_heads": (lambda: _delta_net(1, 2), 4, "linear_num_value_heads=2"),
    "moe_intermediate": (lambda: _moe(30), 4, "moe intermediate_size (per expert)=30 is not divisible by "
                                              "tensor_parallel_size=4"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_rules_name_the_size_that_does_not_divide(case):
    """Each rule's refusal, in process (the split itself runs no collective)."""
    from stateserve.distributed.group import ParallelGroup
    from stateserve.distributed.sharding import split_model

    make, size, message = REFUSED[case]
    with pytest.raises(TensorParallelError, match=message.replace("(", r"\(").replace(")", r"\)")):
        split_model(make(), ParallelGroup(size - 1, size), vocab_size=300)
