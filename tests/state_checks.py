"""Engine-level checks every recurrent-state model gets (Kimi Linear, MiniMax, LFM2, Qwen3.5, OLMo Hybrid, Zamba,
RecurrentGemma, xLSTM, ...): prefix caching resumed from snapshots, preemption with recompute and speculative
decoding's rollback, each compared with a cold engine on tokens and logprobs (a wrong state may leave decisive
tokens alone, not their logprobs); and the bfloat16 teacher-forced logits beside transformers'."""
from __future__ import annotations

import contextlib
import copy
import random

import torch

from stateserve import LLM, SamplingParams
from stateserve.spec_decode.proposer import Proposer
from utils import assert_cache_sized, engine_teacher_forced_logits, hf_logits


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


_COLD: dict = {}


def cold_scored(path: str, prompts, n: int = 6, **kw) -> list[tuple[list[int], list[float]]]:
    """scored() on an engine without prefix caching, kept per model, prompts and engine options: one cold run
    serves every mode of a parametrised test."""
    key = (path, tuple(map(tuple, prompts)), n, tuple(sorted(kw.items())))
    if key not in _COLD:
        with small_llm(path, enable_prefix_caching=False, **kw) as cold:
            _COLD[key] = scored(cold, prompts, n)
    return _COLD[key]


def check_prefix_cache_one_by_one(path: str, mode: str, prompts, rounds: int = 1, n: int = 6,
                                  **kw) -> list[list[int]]:
    """Each prompt alone, in order, `rounds` times over, on a prefix-caching engine: the cold engine's tokens and
    logprobs every time. Returns each round's cached-token counts, for the caller's own hit assertions."""
    ref = cold_scored(path, prompts, n, **kw)
    hits = []
    with small_llm(path, enable_prefix_caching=True, mamba_cache_mode=mode, **kw) as llm:
        for _ in range(rounds):
            outs = [llm.generate([{"prompt_token_ids": p}], greedy_params(n, logprobs=0), use_tqdm=False)[0]
                    for p in prompts]
            assert_same(tokens_and_logprobs(outs), ref)
            hits.append([o.num_cached_tokens for o in outs])
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.cache.is_idle_and_full()
    return hits


class _Oracle(Proposer):
    """Drafts plain decoding's next tokens, each replaced by a wrong one with probability 0.3, so every rollback
    length happens."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]]) -> None:
        self.reference, self.rng = reference, random.Random(0)

    def propose(self, wanted) -> None:
        for req, k in wanted:
            drafts = self.reference[tuple(req.prompt_token_ids)][req.num_output_tokens:req.num_output_tokens + k]
            req.spec_token_ids = [t if self.rng.random() >= 0.3 else (t + 1) % 300 for t in drafts]


def check_speculative_rollback_exact(path: str, monkeypatch, **engine_kw) -> None:
    """Drafts (30% wrong) verified in batched steps beside prefill chunks, the state rolled back to the last
    accepted token, snapshots in mode all: the plain greedy tokens and logprobs on both passes (the second with
    prefix hits). engine_kw: more options of the speculating engine (e.g. tensor_parallel_size)."""
    from stateserve.spec_decode import speculator

    monkeypatch.setattr(speculator, "MAX_VERIFY_ROWS", 1 << 10)  # verify every request's drafts in one step
    prompts = [[(7 * i + 3 * j) % 290 + 5 for j in range(n)] for i, n in enumerate([9, 17, 41, 5])]
    kw = dict(max_num_batched_tokens=32)
    with small_llm(path, enable_prefix_caching=False, **kw) as plain:
        ref = scored(plain, prompts, 16)
    with small_llm(path, enable_prefix_caching=True, mamba_cache_mode="all",
                   speculative_config={"method": "ngram", "num_speculative_tokens": 4}, **kw, **engine_kw) as llm:
        llm.llm_engine.speculator.proposer = _Oracle({tuple(p): r[0] for p, r in zip(prompts, ref)})
        for _ in range(2):
            assert_same(scored(llm, prompts, 16), ref)
        stats = llm.llm_engine.stats
        assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.cache.is_idle_and_full()


def check_teacher_forced_logits(path: str, ref: torch.Tensor, tokens: list[int], atol: float, rtol: float = 1e-4,
                                chunks=(1, 7, 64)) -> None:
    """Our logits over `tokens`, fed in `chunks`-token steps through the real caches, against transformers' `ref`
    (float32 on both sides: only summation order differs, so the caller's atol is float32 round-off)."""
    with small_llm(path) as llm:
        for chunk in chunks:
            torch.testing.assert_close(engine_teacher_forced_logits(llm, tokens, chunk), ref, atol=atol, rtol=rtol,
                                       msg=lambda m: f"chunk {chunk}: {m}")


def check_bfloat16_logits(hf, path: str, tokens: list[int], chunks, reference_patch=None) -> dict[int, float]:
    """LLM(dtype="bfloat16") teacher-forced in `chunks`-token steps against transformers with the model cast to
    bfloat16 (a copy: `hf` may be a module's shared model). Returns each chunk's max error.

    Tolerance, from the computation: both sides round the same weights to bfloat16, then every activation (2^-9
    relative) in a different order, so a logit's error is not a rounding of that logit but of the final hidden
    state times the head: about 1% of the logits' spread (s ~ 4-5 for these decisive heads), sigma ~ 0.04, mean
    |error| ~ 0.03; over ~10^4 logits the largest is ~4.5 sigma (measured 0.20-0.32). atol 0.5 (8 bfloat16 ulps of
    logits in [8, 16)), rtol 0: the error does not grow with the logit. The mean must stay under one such ulp
    (0.0625), and ours no further than transformers' own bfloat16 from float32 math on the same rounded weights
    (measured 0.96-1.04 times): a state, norm or accumulation kept in bfloat16 where transformers keeps float32
    would be further.

    reference_patch: for a family whose transformers bfloat16 rounds something to bfloat16 that we keep in float32
    by design, far enough to miss these bounds on its own (its error against float32 math several times ours), a
    context manager under which transformers computes that one op in float32; everything else stays its bfloat16
    arithmetic, and the 1.25x bound is against the patched reference's own error (so it stays as strict: that op
    of ours must then be as close to float32 math as transformers' patched one)."""
    with contextlib.nullcontext() if reference_patch is None else reference_patch():
        ref = hf_logits(copy.deepcopy(hf).to(torch.bfloat16), tokens)
    exact = hf_logits(copy.deepcopy(hf).to(torch.bfloat16).float(), tokens)  # bfloat16 weights, float32 math
    theirs = (ref - exact).abs().mean()
    errors = {}
    with small_llm(path, dtype="bfloat16") as llm:
        for chunk in chunks:
            ours = engine_teacher_forced_logits(llm, tokens, chunk)
            torch.testing.assert_close(ours, ref, atol=0.5, rtol=0, msg=lambda m: f"chunk {chunk}: {m}")
            assert (ours - ref).abs().mean() < 0.0625, chunk
            assert (ours - exact).abs().mean() <= 1.25 * theirs, (chunk, (ours - exact).abs().mean(), theirs)
            errors[chunk] = float((ours - ref).abs().max())
    return errors


def make_routing_decisive(hf, gate_suffix: str = "mlp.gate", code: float = 3.0, scale: float = 2.0,
                          seed: int = 11) -> None:
    """Rewire a tiny MoE's routers (4 experts, 2 per token, groups of 2 where grouped) so that bfloat16 cannot flip
    an expert choice: random routers leave some tokens' 2nd and 3rd experts nearly tied, and bfloat16's ~1% error
    in the router input then picks another expert in one run but not the other (transformers' own bfloat16 moved
    logits by up to 9 that way). Scaling a router does not help: its rounding error scales with it. Instead the
    embedding carries a +-`code` sign in hidden dims 0 and 1, which no layer writes to (rows 0 and 1 of every
    projection into the hidden size zeroed: otherwise the mixers' outputs soon drown the code), and every router
    reads only those: expert logits scale * (+-x0 +- x1/2), so sign(x0) picks the pair {0, 1} or {2, 3} (also as
    a group), with a gap of about scale * |x0| between the 2nd and 3rd, and x1 sets the weights within the pair.
    The margin is checked, not assumed: check_routing_decisive."""
    gates = [m for n, m in hf.named_modules() if n.endswith(gate_suffix)]
    assert gates and all(g.weight.shape[0] == 4 for g in gates), gate_suffix
    hidden = hf.config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 2 and p.shape[0] == hidden and p is not hf.get_input_embeddings().weight:
                p[:2] = 0  # a Linear into the hidden size (its internal ones too: harmless)
            elif p.dim() == 1 and p.shape[0] == hidden and name.endswith(".bias"):
                p[:2] = 0
            elif p.dim() == 3 and p.shape[1] == hidden and name.endswith("down_proj"):
                p[:, :2] = 0  # fused experts [E, hidden, I]
        emb = hf.get_input_embeddings().weight
        for d in (0, 1):
            emb[:, d] = code * (2 * torch.randint(0, 2, (emb.shape[0],), generator=gen) - 1)
        rows = torch.tensor([[1.0, 0.5], [1.0, -0.5], [-1.0, 0.5], [-1.0, -0.5]]) * scale
        for g in gates:
            g.weight.zero_()
            g.weight[:, :2] = rows


def check_routing_decisive(hf, tokens: list[int], gate_suffix: str = "mlp.gate", rel: float = 0.05) -> None:
    """Each router's choices over `tokens` (transformers, float32) survive noise of `rel` (5%: several times
    bfloat16's error in a router's input, ~1%) times the input's RMS added to the router input, and are not all
    the same."""
    calls = []
    hooks = [m.register_forward_hook(lambda mod, args, kwargs, out: calls.append((mod, args, kwargs, out[-1])),
                                     with_kwargs=True)
             for n, m in hf.named_modules() if n.endswith(gate_suffix)]
    try:
        hf_logits(hf, tokens)
    finally:
        for h in hooks:
            h.remove()
    assert calls
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for mod, (x, *rest), kwargs, picked in calls:
            picked = picked.sort(-1).values
            assert len({tuple(r) for r in picked.tolist()}) > 1, "every token routed alike"
            rms = x.float().pow(2).mean(-1, keepdim=True).sqrt()
            for _ in range(4):
                noisy = x + rel * rms * torch.randn(x.shape, generator=gen)
                assert torch.equal(mod(noisy, *rest, **kwargs)[-1].sort(-1).values, picked)
