"""RecurrentGemma (RG-LRU recurrent blocks + local attention) against transformers 5.24 on a tiny random model:
batched chunked-prefill greedy tokens (and their logprobs), teacher-forced logits through the real caches,
prefix-cache snapshots of the conv and LRU states (mamba_cache_mode all / align) with hits, preemption and
recompute, the RG-LRU states after decode steps against a full forward, speculative decoding's rollback of both
states, and the errors of bad configs. Prompts run well past the 6-token attention window."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch
from transformers import RecurrentGemmaConfig
from transformers import RecurrentGemmaForCausalLM as HfRecurrentGemma

from stateserve import SamplingParams
from stateserve.core.batch import SchedulerOutput, build_input_batch
from stateserve.core.request import Request
from stateserve.layers.rg_lru import linear_scan
from stateserve.models.loader import iterate_safetensors, load_weights
from stateserve.models.recurrent_gemma import RecurrentGemmaForCausalLM as Ours
from state_checks import (check_bfloat16_logits, check_preemption_exact, check_prefix_cache_one_by_one,
                          check_speculative_rollback_exact, check_teacher_forced_logits, greedy_params, scored,
                          small_llm, tokens_and_logprobs)
from utils import assert_greedy_matches, build_hf_model, engine_teacher_forced_logits, hf_greedy, hf_logits, save_model

# r, r, a, r: two recurrent blocks between attention ones; GQA 4/2 heads of 8 with partial rotary (0.5); a 6-token
# window; 4 gate blocks of 8 in the LRU (lru_width = hidden: transformers' decode cache is sized by hidden_size,
# so its generate fails with a wider LRU); a soft cap the logits reach
CONFIG = dict(vocab_size=300, hidden_size=32, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=4, lru_width=32, attention_window_size=6, conv1d_width=4, logits_soft_cap=12.0,
              block_types=["recurrent", "recurrent", "attention"], pad_token_id=0, bos_token_id=1, eos_token_id=2)
PROMPTS = [[250], [7, 3, 2], list(range(20, 29)), list(range(100, 116)), list(range(40, 57)),
           [(17 * i) % 290 + 3 for i in range(40)]]


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
    with small_llm(path, max_num_batched_tokens=16, enable_prefix_caching=False) as llm:
        ours = scored(llm, PROMPTS, 10)
        assert_greedy_matches([tokens for tokens, _ in ours], ref, hf, PROMPTS)
        # greedy tokens of this tiny model lean on the current token's embedding: its logprobs show a wrong state
        for p, (tokens, logprobs) in zip(PROMPTS, ours):
            ref_lp = torch.log_softmax(hf_logits(hf, p + tokens)[len(p) - 1:-1], dim=-1)
            theirs = ref_lp.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
            torch.testing.assert_close(torch.tensor(logprobs), theirs, atol=1e-4, rtol=0)
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.cache.is_idle_and_full()


def test_teacher_forced_logits(built):
    hf, path = built
    tokens = [(7 * i) % 290 + 3 for i in range(40)]  # far past the 6-token window
    ref = hf_logits(hf, tokens)
    check_teacher_forced_logits(path, ref, tokens, atol=2e-4)


def test_bfloat16_logits(built):
    """One whole-prompt step, resumed 7-token steps and token by token (the decode conv, RG-LRU step and the 6-token
    window) beside transformers' bfloat16 (tolerance derived in check_bfloat16_logits)."""
    hf, path = built
    check_bfloat16_logits(hf, path, [(7 * i) % 290 + 3 for i in range(40)], (40, 7, 1))


def test_wider_lru_teacher_forced_logits(tmp_path):
    """lru_width 48 beside hidden 32 (gate blocks of 12), MHA and full rotary: teacher-forced logits only, as
    transformers' own decode cannot run such a model (it sizes its conv cache by hidden_size)."""
    hf, path = _build(tmp_path, lru_width=48, num_key_value_heads=4, partial_rotary_factor=1.0)
    tokens = [(5 * i) % 290 + 3 for i in range(30)]
    ref = hf_logits(hf, tokens)
    with small_llm(path) as llm:
        for chunk in (1, 11):
            torch.testing.assert_close(engine_teacher_forced_logits(llm, tokens, chunk), ref, atol=2e-4, rtol=1e-4,
                                       msg=lambda m: f"chunk {chunk}: {m}")


def _toks(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


@pytest.mark.parametrize("mode", ["all", "align"])
def test_prefix_cache_snapshots(mode, built):
    """Conv and LRU snapshots at block boundaries (block size 8, 16-token steps: taken mid-chunk in `all`), resumed
    from on later prompts: the tokens and logprobs of a cold engine, with hits."""
    bs = 8
    shared = _toks(5 * bs + 3, 1)
    prompts = [shared + _toks(9, 2), shared + _toks(20, 3), shared + _toks(2, 4)]
    [hits] = check_prefix_cache_one_by_one(built[1], mode, prompts, block_size=bs, max_num_batched_tokens=16)
    assert hits[0] == 0
    if mode == "all":
        assert hits[1] == hits[2] == 5 * bs
    else:  # align: the second request ends a chunk where sharing stops, so the third gets the hit
        assert hits[2] == 5 * bs


def test_preemption_recompute_gives_same_tokens(built):
    check_preemption_exact(built[1], 16)


def test_states_after_decode_match_full_forward(built):
    """Through the engine's caches: a prompt of 13 tokens in chunks of 8 and 5, then 9 decode-only steps; each
    recurrent block's conv state and LRU state are then transformers' after one forward over all 22 tokens."""
    hf, path = built
    tokens = [(11 * i) % 290 + 3 for i in range(22)]
    with torch.no_grad():
        hf(torch.tensor([tokens]), use_cache=True)  # transformers keeps these states on the modules
    with small_llm(path, enable_prefix_caching=False) as llm:
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


def test_speculative_decoding_rolls_back_states(built, monkeypatch):
    """Drafts verified round by round through the batched one-token update: the conv and LRU states rolled back."""
    check_speculative_rollback_exact(built[1], monkeypatch)


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
        small_llm(path)


# ---- the window-bounded KV cache -----------------------------------------------------------------------------------
LONG = [[(13 * i + 5) % 290 + 3 for i in range(60)], [(7 * i + 2) % 290 + 3 for i in range(45)]]


def _hf_logprobs(hf, prompt: list[int], out: list[int]) -> list[float]:
    """transformers' logprob of each generated token, teacher-forced over prompt + output."""
    logp = torch.log_softmax(hf_logits(hf, prompt + out).double(), -1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(out)]


def test_kv_blocks_leaving_the_window_are_given_back(built):
    """Every attention layer declares its 6-token window, so the cache gives back blocks that leave it: sequences of
    60 + 30 tokens (23 blocks of 4 each) run two at a time in a 6-block cache (without the give-back the 60-token
    prompt is refused: it needs 15 blocks), with transformers' tokens and logprobs."""
    hf, path = built
    ref = hf_greedy(hf, LONG, 30)
    with small_llm(path, block_size=4, max_num_batched_tokens=8, enable_prefix_caching=False,
                   num_gpu_blocks_override=6) as tight:
        assert tight.llm_engine.cache.window == 6
        # the window mask comes from host-side lengths each step: no decode graph may freeze it
        assert "sliding-window" in tight.llm_engine.runner.model_state.graph_unsupported_reason()
        ours = scored(tight, LONG, 30)
        tight.llm_engine.check_integrity()
        assert tight.llm_engine.cache.is_idle_and_full()
    assert [t for t, _ in ours] == ref
    for prompt, (tokens, logprobs) in zip(LONG, ours):
        assert max(abs(a - b) for a, b in zip(logprobs, _hf_logprobs(hf, prompt, tokens))) < 1e-4


@pytest.mark.parametrize("mode", ["all", "align"])
def test_window_prefix_hit_needs_only_the_window_blocks(built, mode):
    """In a 7-block cache the first pass evicts its own early blocks; a prompt extending it still resumes (the
    blocks of the last window and an LRU snapshot suffice), with transformers' tokens and logprobs."""
    hf, path = built
    first, second = LONG[0], LONG[0] + [9, 8, 7]
    ref = hf_greedy(hf, [second], 8)[0]
    with small_llm(path, block_size=4, max_num_batched_tokens=8, enable_prefix_caching=True, mamba_cache_mode=mode,
                   num_gpu_blocks_override=7) as llm:
        scored(llm, [first], 4)
        cache = llm.llm_engine.cache
        assert cache.block_pool.lookup(cache.keys(Request("x", second, SamplingParams(), 0), 1)[0]) is None
        outs = llm.generate([{"prompt_token_ids": second}], greedy_params(8, logprobs=0), use_tqdm=False)
        assert outs[0].num_cached_tokens >= 56
        [(tokens, logprobs)] = tokens_and_logprobs(outs)
        assert tokens == ref
        assert max(abs(a - b) for a, b in zip(logprobs, _hf_logprobs(hf, second, tokens))) < 1e-4
        llm.llm_engine.check_integrity()
