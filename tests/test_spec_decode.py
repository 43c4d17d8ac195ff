"""Speculative decoding gives plain decoding's greedy tokens (and logprobs) on every architecture: drafts verified
in one forward batched with other requests' decodes and prefill chunks, recurrent state rolled back to the last
accepted token, in every mamba_cache_mode, with prefix hits on a second pass, and with a cache small enough to
preempt. Drafts come from an oracle that knows plain decoding's tokens and gets each one wrong with probability
0.3 (acceptance neither 0 nor 1, so every rollback length happens), from a draft model (the target with perturbed
weights, or a model of another kind), and from prompt lookup."""
from __future__ import annotations

import copy
import random

import pytest
import torch

from stateserve import LLM, SamplingParams
from stateserve.spec_decode.proposer import Proposer
from test_bamba import _build as bamba
from test_jamba import _build as jamba
from test_llama import _build as llama_or_qwen2
from test_mamba import _build as mamba1
from test_mamba2 import _build as mamba2
from test_nemotron_h import _build as nemotron_h
from test_qwen3_next import _build as qwen3_next
from test_zamba2 import _build as zamba2
from utils import save_model

ARCHS = {
    "llama": lambda t: llama_or_qwen2("llama", t),
    "qwen2": lambda t: llama_or_qwen2("qwen2", t),
    "mamba": lambda t: mamba1("mamba", t),
    "mamba2": mamba2,
    "jamba": jamba,
    "bamba": bamba,
    "nemotron_h": lambda t: nemotron_h(t, hybrid_override_pattern="M*-*", head_dim=16),
    "zamba2": zamba2,
    "qwen3_next": qwen3_next,
}
RECURRENT = {"mamba", "mamba2", "jamba", "bamba", "nemotron_h", "zamba2", "qwen3_next"}
ATTENTION_FREE = {"mamba", "mamba2"}
# mixed lengths: prompts of 9-41 tokens, chunked by a 32-token budget, so verify steps share steps with prefills
PROMPTS = [[(7 * i + 3 * j) % 290 + 5 for j in range(n)] for i, n in enumerate([9, 17, 41, 5, 33, 24])]
NEW_TOKENS = 36


@pytest.fixture(autouse=True)
def verify_every_request(monkeypatch):
    """Tests verify drafts of many requests in one step; the default cap keeps batched steps near plain decoding
    (test_verify_rows_are_capped checks it)."""
    from stateserve.spec_decode import speculator

    monkeypatch.setattr(speculator, "MAX_VERIFY_ROWS", 1 << 10)


class OracleProposer(Proposer):
    """Drafts plain decoding's next tokens (looked up by prompt), each replaced by a wrong one with probability
    `error`; keeps no state, like prompt lookup."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], error: float, seed: int = 0) -> None:
        self.reference, self.error, self.rng = reference, error, random.Random(seed)
        self.num_proposed = 0

    def propose(self, wanted) -> None:
        for req, k in wanted:
            ref = self.reference[tuple(req.prompt_token_ids)]
            drafts = ref[req.num_output_tokens:req.num_output_tokens + k]
            req.spec_token_ids = [t if self.rng.random() >= self.error else (t + 1) % 300 for t in drafts]
            self.num_proposed += len(drafts)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=2, **kw)


def run(llm: LLM, params: SamplingParams, prompts=PROMPTS):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def assert_same_as_plain(outs, ref, tol: float = 1e-4) -> None:
    for o, r in zip(outs, ref):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        for mine, theirs in zip(o.outputs[0].logprobs, r.outputs[0].logprobs):
            assert mine.keys() == theirs.keys()
            for t in mine:
                assert abs(mine[t].logprob - theirs[t].logprob) < tol


def assert_clean(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.check_integrity()
    assert engine.cache.is_idle_and_full()
    proposer = engine.speculator.proposer
    if hasattr(proposer, "cache"):
        proposer.cache.check_integrity()
        assert proposer.cache.is_idle_and_full()


def _spec_llm(path: str, mode: str, tight: bool, arch: str, **kw) -> LLM:
    extra = {}
    if tight and arch not in ATTENTION_FREE:  # fewer KV blocks than the running sequences need
        extra = dict(num_gpu_blocks_override=10, max_num_seqs=6)
    return LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=32, enable_prefix_caching=mode != "off",
               mamba_cache_mode=None if mode == "off" or arch not in RECURRENT else mode, **extra, **kw)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = {}

    def get(arch: str):
        if arch not in cache:
            hf, path = ARCHS[arch](tmp_path_factory.mktemp(arch))
            with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=32, enable_prefix_caching=False) as llm:
                cache[arch] = (hf, path, run(llm, greedy()))
        return cache[arch]
    return get


@pytest.mark.parametrize("mode", ["none", "all", "align"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_speculation_gives_plain_greedy_tokens(arch, mode, built):
    """Two passes with the oracle's drafts (second: prefix hits in all/align); mode none runs with a cache small
    enough that sequences get preempted and recomputed."""
    if mode != "none" and arch not in RECURRENT and mode == "align":
        pytest.skip("mamba_cache_mode is for recurrent models; llama/qwen2 run all and none")
    _, path, ref = built(arch)
    oracle = OracleProposer({tuple(p): r.outputs[0].token_ids for p, r in zip(PROMPTS, ref)}, error=0.3)
    tight = mode == "none"
    with _spec_llm(path, mode, tight, arch, speculative_config={"method": "ngram", "num_speculative_tokens": 4}) \
            as llm:
        llm.llm_engine.speculator.proposer = oracle
        for rounds in range(2):
            outs = run(llm, greedy())
            assert_same_as_plain(outs, ref)
            assert_clean(llm)
        stats = llm.llm_engine.stats
        assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
        metrics = outs[0].metrics
        assert metrics.num_verify_steps > 0 and 1 < metrics.mean_accepted_length < 5
        if mode != "none":
            assert sum(o.num_cached_tokens for o in outs) > 0  # the second pass hit the prefix cache
        if tight and arch not in ATTENTION_FREE:
            assert stats["preemptions"] > 0


def _perturbed_copy(hf, path: str, scale: float) -> str:
    draft = copy.deepcopy(hf)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=gen) * scale * p.std())
    return save_model(draft, path + "-draft")


@pytest.mark.parametrize("arch", ["llama", "mamba", "mamba2", "bamba", "qwen3_next", "zamba2"])
def test_draft_model_with_perturbed_weights(arch, built):
    """The draft is the target with perturbed weights: some drafts are accepted, some not; the draft's own KV and
    state are rolled back too (else its later drafts, and so the acceptance, would drift)."""
    hf, path, ref = built(arch)
    draft = _perturbed_copy(hf, path, 0.15)
    with _spec_llm(path, "all", False, arch, speculative_config={"method": "draft_model", "model": draft,
                                                                  "num_speculative_tokens": 3}) as llm:
        for _ in range(2):
            assert_same_as_plain(run(llm, greedy()), ref)
            assert_clean(llm)
        stats = llm.llm_engine.stats
        assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]


@pytest.mark.parametrize("arch,draft_arch", [("mamba2", "mamba2"), ("bamba", "bamba"), ("llama", "llama")])
def test_draft_model_equal_to_target_accepts_everything(arch, draft_arch, built):
    """A draft that is the target itself proposes plain decoding's tokens: every draft is accepted, which holds only
    if the draft's rollback restores exactly the state after the last accepted token."""
    _, path, ref = built(arch)
    with _spec_llm(path, "none", False, arch, speculative_config={"method": "draft_model", "model": path,
                                                                   "num_speculative_tokens": 4}) as llm:
        outs = run(llm, greedy())
        assert_same_as_plain(outs, ref)
        stats = llm.llm_engine.stats
        assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0
        assert_clean(llm)


@pytest.mark.parametrize("arch,draft_arch", [("mamba", "llama"), ("bamba", "mamba2")])
def test_draft_model_of_another_kind(arch, draft_arch, built):
    _, path, ref = built(arch)
    _, draft, _ = built(draft_arch)
    with _spec_llm(path, "align", True, arch, speculative_config={"method": "draft_model", "model": draft,
                                                                   "num_speculative_tokens": 2}) as llm:
        assert_same_as_plain(run(llm, greedy()), ref)
        assert llm.llm_engine.stats["spec_decode_num_draft_tokens"] > 0
        assert_clean(llm)


@pytest.mark.parametrize("arch", ["llama", "mamba2", "jamba"])
def test_prompt_lookup_on_repetitive_prompts(arch, built):
    """Real ngram drafting: prompts that repeat a span, greedy outputs that loop; same tokens as plain decoding."""
    _, path, _ = built(arch)
    prompts = [p[:12] * 3 for p in PROMPTS]
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=32, enable_prefix_caching=False) as plain:
        ref = run(plain, greedy(), prompts)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    with _spec_llm(path, "all", False, arch, speculative_config=spec) as llm:
        assert_same_as_plain(run(llm, greedy(), prompts), ref)
        assert llm.llm_engine.stats["spec_decode_num_accepted_tokens"] > 0
        assert_clean(llm)


def test_verify_rows_are_capped(built):
    """With the default cap, a step verifies at most MAX_VERIFY_ROWS rows in all: one request drafts k, six running
    requests share 8 - 6 = 2 draft rows, nine draft nothing."""
    from stateserve.spec_decode import speculator

    _, path, ref = built("llama")
    rows = []
    with _spec_llm(path, "none", False, "llama", speculative_config={"method": "ngram", "num_speculative_tokens": 4}) \
            as llm:
        engine = llm.llm_engine
        engine.speculator.proposer = OracleProposer({tuple(p): r.outputs[0].token_ids for p, r in zip(PROMPTS, ref)},
                                                    0.0)
        speculator.MAX_VERIFY_ROWS = 8  # the module default (the fixture raised it)
        original = engine.runner.execute

        def record(sched):
            decoding = [r for r in sched.requests if 0 < r.num_computed_tokens == r.num_tokens - 1
                        and r not in sched.admitted]  # (an admitted prefix hit may have one prompt token left)
            rows.append((len(decoding), len(decoding) + sum(len(r.spec_token_ids) for r in decoding)))
            return original(sched)
        engine.runner.execute = record
        assert_same_as_plain(run(llm, greedy()), ref)
        run(llm, greedy(), PROMPTS[:1])
        run(llm, greedy(), PROMPTS + PROMPTS[:3])
    assert all(total <= max(n, 8) for n, total in rows) and any(n < total == 8 for n, total in rows)
    assert any(n == 9 for n, _ in rows) and all(total == n for n, total in rows if n >= 8)
    assert any(total == 5 for n, total in rows if n == 1)  # one request alone: 1 + k rows
