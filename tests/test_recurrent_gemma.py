"""RecurrentGemma (RG-LRU recurrent blocks + local attention) against transformers 5.24 on a tiny random model:
batched chunked-prefill greedy tokens (and their logprobs), teacher-forced logits through the real caches,
prefix-cache snapshots of the conv and LRU states (mamba_cache_mode all / align) with hits, preemption and
recompute, the RG-LRU states after decode steps against a full forward, speculative decoding's rollback of both
states, and the errors of bad configs. Prompts run well past the 6-token attention window."""
from __future__ import annotations

import json
import math
import os
import random

import pytest
import torch
from transformers import RecurrentGemmaConfig
from transformers import RecurrentGemmaForCausalLM as HfRecurrentGemma

from stateserve import LLM, SamplingParams
from stateserve.core.batch import SchedulerOutput, build_input_batch
from stateserve.core.request import Request
from stateserve.layers.rg_lru import linear_scan
from stateserve.models.loader import iterate_safetensors, load_weights
from stateserve.models.recurrent_gemma import RecurrentGemmaForCausalLM as Ours
from stateserve.spec_decode.proposer import Proposer
from utils import assert_cache_sized, assert_greedy_matches, build_hf_model, engine_teacher_forced_logits, hf_greedy, \
    hf_logits, save_model

MIB = 1 << 20
# r, r, a, r: two recurrent blocks between attention ones; GQA 4/2 heads of 8 with partial rotary (0.5); a 6-token
# window; 4 gate blocks of 8 in the LRU (lru_width = hidden: transformers' decode cache is sized by hidden_size,
# so its generate fails with a wider LRU); a soft cap the logits reach
CONFIG = dict(vocab_size=300, hidden_size=32, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=4, lru_width=32, attention_window_size=6, conv1d_width=4, logits_soft_cap=12.0,
              block_types=["recurrent", "recurrent", "attention"], pad_token_id=0, bos_token_id=1, eos_token_id=2)
PROMPTS = [[250], [7, 3, 2], list(range(20, 29)), list(range(100, 116)), list(range(40, 57)),
           [(17 * i) % 290 + 3 for i in range(40)]]
LLM_KW = dict(skip_tokenizer_init=True, kv_cache_memory_bytes=32 * MIB)


def _build(tmp_path, **extra):
    hf = build_hf_model(RecurrentGemmaConfig, HfRecurrentGemma, **{**CONFIG, **extra})
    # norms start at zero (scale 1 + w) and gate biases at zero: perturb every 1-D parameter so a mis-wired one shows
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 1 or name.endswith("gate_bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
            # transformers' init keeps the mixers' outputs small beside the sqrt(hidden)-scaled embeddings, so
            # a wrong state would hardly move a logit: make the temporal blocks count
            if name.endswith(("linear_out.weight", "o_proj.weight")):
                p.mul_(6.0)
    return hf, save_model(hf, str(tmp_path / "rg"))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("recurrent_gemma"))


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=0)


def _scored(llm: LLM, prompts, n: int = 6) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens with their logprobs: a slightly wrong state may leave decisive tokens alone, not logprobs."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(n), use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outs]


def _assert_same(ours, ref, tol: float = 1e-4) -> None:
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(ours, ref, strict=True):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < tol, (logprobs, ref_logprobs)


def test_linear_scan_matches_the_sequential_recurrence():
    g = torch.Generator().manual_seed(0)
    for L in (1, 2, 7, 33):
        a, b, h0 = torch.rand(L, 5, generator=g), torch.randn(L, 5, generator=g), torch.randn(5, generator=g)
        h, ref = h0.clone(), []
        for t in range(L):
            h = a[t] * h + b[t]
            ref.append(h)
        torch.testing.assert_close(linear_scan(a, b, h0), torch.stack(ref))


def test_weight_names_load_one_to_one(built):
    hf, path = built
    ours = Ours(hf.config, torch.float32)
    names = [n for n, _ in iterate_safetensors(path, show_progress=False)]
    assert {ours.map_weight_name(n)[0] for n in names} == set(dict(ours.named_parameters()))
    load_weights(ours, iterate_safetensors(path, show_progress=False))  # strict: every tensor lands, none missing


def test_greedy_parity_chunked(built):
    hf, path = built
    ref = hf_greedy(hf, PROMPTS, 10)
    # 16-token steps: the 40-token prompt takes three chunks, and prefill chunks share steps with decodes
    with LLM(path, max_num_batched_tokens=16, enable_prefix_caching=False, **LLM_KW) as llm:
        scored = _scored(llm, PROMPTS, 10)
        assert_greedy_matches([tokens for tokens, _ in scored], ref, hf, PROMPTS)
        # greedy tokens of this tiny model lean on the current token's embedding: its logprobs show a wrong state
        for p, (tokens, logprobs) in zip(PROMPTS, scored):
            ref_lp = torch.log_softmax(hf_logits(hf, p + tokens)[len(p) - 1:-1], dim=-1)
            theirs = ref_lp.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
            torch.testing.assert_close(torch.tensor(logprobs), theirs, atol=1e-4, rtol=0)
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.cache.is_idle_and_full()


def test_teacher_forced_logits(built):
    hf, path = built
    tokens = [(7 * i) % 290 + 3 for i in range(40)]  # far past the 6-token window
    ref = hf_logits(hf, tokens)
    with LLM(path, **LLM_KW) as llm:
        for chunk in (1, 7, 64):
            torch.testing.assert_close(engine_teacher_forced_logits(llm, tokens, chunk), ref, atol=2e-4, rtol=1e-4,
                                       msg=lambda m: f"chunk {chunk}: {m}")


def test_wider_lru_teacher_forced_logits(tmp_path):
    """lru_width 48 beside hidden 32 (gate blocks of 12), MHA and full rotary: teacher-forced logits only, as
    transformers' own decode cannot run such a model (it sizes its conv cache by hidden_size)."""
    hf, path = _build(tmp_path, lru_width=48, num_key_value_heads=4, partial_rotary_factor=1.0)
    tokens = [(5 * i) % 290 + 3 for i in range(30)]
    ref = hf_logits(hf, tokens)
    with LLM(path, **LLM_KW) as llm:
        for chunk in (1, 11):
            torch.testing.assert_close(engine_teacher_forced_logits(llm, tokens, chunk), ref, atol=2e-4, rtol=1e-4,
                                       msg=lambda m: f"chunk {chunk}: {m}")


def _toks(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


_COLD: list = []


@pytest.mark.parametrize("mode", ["all", "align"])
def test_prefix_cache_snapshots(mode, built):
    """Conv and LRU snapshots at block boundaries (block size 8, 16-token steps: taken mid-chunk in `all`), resumed
    from on later prompts: the tokens and logprobs of a cold engine, with hits."""
    _, path = built
    bs = 8
    shared = _toks(5 * bs + 3, 1)
    prompts = [shared + _toks(9, 2), shared + _toks(20, 3), shared + _toks(2, 4)]
    kw = dict(block_size=bs, max_num_batched_tokens=16, **LLM_KW)
    if not _COLD:  # one cold run serves both modes
        with LLM(path, enable_prefix_caching=False, **kw) as cold:
            _COLD.append(_scored(cold, prompts))
    with LLM(path, enable_prefix_caching=True, mamba_cache_mode=mode, **kw) as llm:
        outs = [llm.generate([{"prompt_token_ids": p}], _greedy(6), use_tqdm=False)[0] for p in prompts]
        _assert_same([(o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                                                o.outputs[0].logprobs)])
                      for o in outs], _COLD[0])
        hits = [o.num_cached_tokens for o in outs]
        assert hits[0] == 0
        if mode == "all":
            assert hits[1] == hits[2] == 5 * bs
        else:  # align: the second request ends a chunk where sharing stops, so the third gets the hit
            assert hits[2] == 5 * bs
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.cache.is_idle_and_full()


# six prompts of 20-35 tokens, 16 new tokens each: every sequence needs three to four 16-token blocks
SIX_MIXED = [[(5 * i + 11 * j) % 290 + 3 for j in range(20 + 3 * i)] for i in range(6)]


def test_preemption_recompute_gives_same_tokens(built):
    """8 KV blocks for 5 running sequences: some are preempted and recomputed (their slots freed and zeroed) and
    give the tokens of an engine with room for all."""
    _, path = built
    num_blocks, max_seqs, new = 8, 5, 16
    assert max_seqs * math.ceil((min(map(len, SIX_MIXED)) + new) / 16) > num_blocks
    kw = dict(skip_tokenizer_init=True, max_num_batched_tokens=64, enable_prefix_caching=False)
    with LLM(path, kv_cache_memory_bytes=32 * MIB, **kw) as roomy:
        ref = _scored(roomy, SIX_MIXED, new)
    with LLM(path, num_gpu_blocks_override=num_blocks, max_num_seqs=max_seqs, **kw) as tight:
        assert_cache_sized(tight, num_blocks, max_seqs)
        _assert_same(_scored(tight, SIX_MIXED, new), ref)
        assert tight.llm_engine.stats["preemptions"] > 0
        tight.llm_engine.check_integrity()
        assert tight.llm_engine.cache.is_idle_and_full()


def test_states_after_decode_match_full_forward(built):
    """Through the engine's caches: a prompt of 13 tokens in chunks of 8 and 5, then 9 decode-only steps; each
    recurrent block's conv state and LRU state are then transformers' after one forward over all 22 tokens."""
    hf, path = built
    tokens = [(11 * i) % 290 + 3 for i in range(22)]
    with torch.no_grad():
        hf(torch.tensor([tokens]), use_cache=True)  # transformers keeps these states on the modules
    with LLM(path, enable_prefix_caching=False, **LLM_KW) as llm:
        engine, runner = llm.llm_engine, llm.llm_engine.runner
        req = Request("probe", list(tokens), SamplingParams(max_tokens=1), arrival_index=0)
        try:
            with torch.inference_mode():
                for n in [8, 5] + [1] * 9:
                    engine.cache.allocate(req, n)
                    sched = SchedulerOutput()
                    sched.add(req, n)
                    batch = build_input_batch(sched, runner.device)
                    assert batch.is_decode_only == (n == 1)
                    runner.model(batch.input_ids, batch.positions, runner.model_state.prepare_meta(batch))
                    req.num_computed_tokens += n
            checked = 0
            for i, (ours, theirs) in enumerate(zip(runner.model.model.layers, hf.model.layers)):
                if ours.block_type != "recurrent":
                    continue
                states = ours.temporal_block.states
                torch.testing.assert_close(states["conv"][req.state_slot], theirs.temporal_block.conv1d_state[0],
                                           atol=1e-5, rtol=1e-4, msg=lambda m: f"conv, layer {i}: {m}")
                torch.testing.assert_close(states["lru"][req.state_slot],
                                           theirs.temporal_block.rg_lru.recurrent_states[0], atol=1e-5, rtol=1e-4,
                                           msg=lambda m: f"lru, layer {i}: {m}")
                checked += 1
            assert checked == 3
        finally:
            engine.cache.free(req)


class _Oracle(Proposer):
    """Drafts plain decoding's next tokens, each replaced by a wrong one with probability 0.3, so every rollback
    length happens."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]]) -> None:
        self.reference, self.rng = reference, random.Random(0)

    def propose(self, wanted) -> None:
        for req, k in wanted:
            drafts = self.reference[tuple(req.prompt_token_ids)][req.num_output_tokens:req.num_output_tokens + k]
            req.spec_token_ids = [t if self.rng.random() >= 0.3 else (t + 1) % 300 for t in drafts]


def test_speculative_decoding_rolls_back_states(built, monkeypatch):
    """Drafts verified round by round through the batched one-token update beside prefill chunks, the conv and
    LRU states rolled back to the last accepted token, snapshots in mode all: the plain greedy tokens and logprobs,
    on both passes (the second with prefix hits)."""
    from stateserve.spec_decode import speculator

    monkeypatch.setattr(speculator, "MAX_VERIFY_ROWS", 1 << 10)  # verify every request's drafts in one step
    _, path = built
    prompts = [[(7 * i + 3 * j) % 290 + 5 for j in range(n)] for i, n in enumerate([9, 17, 41, 5])]
    kw = dict(max_num_batched_tokens=32, **LLM_KW)
    with LLM(path, enable_prefix_caching=False, **kw) as plain:
        ref = _scored(plain, prompts, 16)
    with LLM(path, enable_prefix_caching=True, mamba_cache_mode="all",
             speculative_config={"method": "ngram", "num_speculative_tokens": 4}, **kw) as llm:
        llm.llm_engine.speculator.proposer = _Oracle({tuple(p): r[0] for p, r in zip(prompts, ref)})
        for _ in range(2):
            _assert_same(_scored(llm, prompts, 16), ref)
        stats = llm.llm_engine.stats
        assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.cache.is_idle_and_full()


def test_block_mixes_route():
    base = RecurrentGemmaConfig(**CONFIG)
    assert Ours.resolve_flags(base) == (False, True)
    assert Ours.resolve_flags(RecurrentGemmaConfig(**{**CONFIG, "block_types": ["recurrent"]})) == (True, False)
    assert Ours.resolve_flags(RecurrentGemmaConfig(**{**CONFIG, "block_types": ["attention"]})) == (False, False)


def test_bad_configs_name_what_is_wrong(tmp_path):
    # transformers' config turns any name but "recurrent" into attention; the model class names it instead
    with pytest.raises(ValueError, match="unknown block type 'mamba'"):
        Ours(RecurrentGemmaConfig(**{**CONFIG, "block_types": ["recurrent", "mamba"]}), torch.float32)
    with pytest.raises(ValueError, match="hidden_activation 'relu'"):
        Ours(RecurrentGemmaConfig(**{**CONFIG, "hidden_activation": "relu"}), torch.float32)
    with pytest.raises(ValueError, match="lru_width=50 is not a multiple of num_attention_heads=4"):
        Ours(RecurrentGemmaConfig(**{**CONFIG, "lru_width": 50}), torch.float32)
    # through the engine: the folder's config names the bad block type
    _, path = _build(tmp_path, num_hidden_layers=2)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["block_types"] = ["recurrent", "local_attention"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="unknown block type 'local_attention'"):
        LLM(path, **LLM_KW)
