"""Engine-level checks every recurrent-state model gets (the Kimi Linear family, MiniMax): prefix caching resumed
from snapshots and preemption with recompute, each compared with a cold engine on tokens and logprobs (a wrong
state may leave decisive tokens alone, not their logprobs)."""
from __future__ import annotations

from stateserve import LLM, SamplingParams
from utils import assert_cache_sized


def small_llm(path: str, **kw) -> LLM:
    # 32 MiB of cache, not the default GiBs: zeroing those dominated each engine start
    kw.setdefault("kv_cache_memory_bytes", 32 << 20)
    return LLM(path, skip_tokenizer_init=True, **kw)


def greedy_params(max_new: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True, **kw)


def tokens_and_logprobs(outs) -> list[tuple[list[int], list[float]]]:
    return [(o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outs]


def scored(llm: LLM, prompts, n: int = 6) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens with their logprobs."""
    return tokens_and_logprobs(llm.generate([{"prompt_token_ids": p} for p in prompts],
                                            greedy_params(n, logprobs=0), use_tqdm=False))


def assert_same(ours, ref, tol: float = 1e-4) -> None:
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(ours, ref, strict=True):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < tol, (logprobs, ref_logprobs)


def check_prefix_cache_exact(path: str, mode: str) -> None:
    """Snapshots (block size 4, mid-chunk and at chunk ends) resumed from on a second pass: the cold run's tokens
    and logprobs, with hits."""
    shared = [(3 * j) % 290 + 5 for j in range(30)]
    prompts = [shared + [7, 8], shared[:13] + [9], shared + [7, 8, 11], shared[:22] + [250, 3]]
    with small_llm(path, enable_prefix_caching=False, max_num_batched_tokens=16) as cold:
        ref = scored(cold, prompts)
    with small_llm(path, max_num_batched_tokens=16, block_size=4, enable_prefix_caching=True,
                   mamba_cache_mode=mode) as llm:
        first = scored(llm, prompts[:2])
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[2:]], greedy_params(6, logprobs=0),
                            use_tqdm=False)
        assert_same(first, ref[:2])
        assert_same(tokens_and_logprobs(outs), ref[2:])
        assert min(o.num_cached_tokens for o in outs) >= 12  # really resumed from snapshots
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.cache.is_idle_and_full()


def check_preemption_exact(path: str, max_new: int) -> None:
    """Fewer KV blocks than the running sequences need: some are preempted and recomputed (state slots freed and
    re-zeroed), giving the tokens and logprobs of an engine with room for all."""
    prompts = [[(5 * i + 11 * j) % 290 + 3 for j in range(20 + 3 * i)] for i in range(6)]
    kw = dict(max_num_batched_tokens=64, enable_prefix_caching=False)
    with small_llm(path, **kw) as roomy:
        ref = scored(roomy, prompts, max_new)
    with small_llm(path, num_gpu_blocks_override=8, max_num_seqs=6, **kw) as tight:
        assert_cache_sized(tight, 8, 6)
        assert_same(scored(tight, prompts, max_new), ref)
        assert tight.llm_engine.stats["preemptions"] > 0
        tight.llm_engine.check_integrity()
        assert tight.llm_engine.cache.is_idle_and_full()
