"""Speculative decoding beyond greedy equality: construction errors, the state a verify step leaves (compared slot by
slot with plain decoding's), snapshots only of committed state, exact sampling (chi-square), stop rules, penalties,
logprobs, n > 1 and seeds inside accepted runs, abort during a verify step, and the CLI, server and metrics."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from stateserve import LLM, SamplingParams
from test_spec_decode import ARCHS, PROMPTS, OracleProposer, assert_clean, greedy, run
from test_spec_decode import verify_every_request  # noqa: F401  (autouse: drafts for every running request)
from utils import build_hf_model, demo_model, save_model, start_server

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = {}

    def get(arch: str) -> tuple:
        if arch not in cache:
            cache[arch] = ARCHS[arch](tmp_path_factory.mktemp(arch))
        return cache[arch]
    return get


def _oracle_for(path: str, params: SamplingParams, prompts=PROMPTS, error: float = 0.3, **kw) -> OracleProposer:
    kw.setdefault("skip_tokenizer_init", True)
    with LLM(path, enable_prefix_caching=False, **kw) as plain:
        ref = run(plain, params, prompts)
    return OracleProposer({tuple(p): r.outputs[0].token_ids for p, r in zip(prompts, ref)}, error), ref


# ---- construction ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec,message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown key"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens must be an integer in \[1"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4 is more than prompt_lookup_max=2"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs `model`"),
])
def test_bad_speculative_config_is_refused_at_construction(spec, message, models):
    _, path = models("llama")
    with pytest.raises(ValueError, match=message):
        LLM(path, skip_tokenizer_init=True, speculative_config=spec)


def test_draft_model_with_another_vocabulary_is_refused(models, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    _, path = models("llama")
    other = save_model(build_hf_model(LlamaConfig, LlamaForCausalLM, vocab_size=200, hidden_size=32,
                                      intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2), str(tmp_path / "other"))
    with pytest.raises(ValueError, match="has a vocabulary of 200 tokens, the target 300"):
        LLM(path, skip_tokenizer_init=True, speculative_config={"method": "draft_model", "model": other,
                                                                "num_speculative_tokens": 2})


# ---- state -------------------------------------------------------------------------------------------------------
def _states_by_position(llm: LLM, params: SamplingParams, proposer=None) -> dict[int, dict[str, torch.Tensor]]:
    """Step one request through the engine; after each step, its state slot's tensors by computed tokens."""
    engine = llm.llm_engine
    if proposer is not None:
        engine.speculator.proposer = proposer
    engine.add_request("r", PROMPTS[2], params)
    req = engine.requests["r"]
    storage = engine.runner.caches.storage
    seen = {}
    while not req.is_finished:
        engine.step()
        if not req.is_finished:
            seen[req.num_computed_tokens] = {f"{name}.{key}": t[req.state_slot].clone()
                                            for name, states in storage.states.items() for key, t in states.items()}
    engine.pop_output("r")
    return seen


@pytest.mark.parametrize("arch", ["mamba", "mamba2", "qwen3_next", "jamba"])
def test_state_after_verify_equals_plain_decoding(arch, models):
    """After every verify step (partial acceptances included), the request's state slot holds what plain decoding
    holds after the same tokens: the rollback picks the right position and the verify rounds run the decode update.
    Tolerance: float32 round-off of the projections, which see k+1 rows instead of one (their products may sum in
    another order); the update itself is plain decoding's kernel."""
    _, path = models(arch)
    params = greedy()
    proposer, _ = _oracle_for(path, params, prompts=[PROMPTS[2]])
    with LLM(path, skip_tokenizer_init=True, enable_prefix_caching=False) as plain:
        ref = _states_by_position(plain, params)
    with LLM(path, skip_tokenizer_init=True, enable_prefix_caching=False, speculative_config=NGRAM) as llm:
        spec = _states_by_position(llm, params, proposer)
        assert llm.llm_engine.stats["spec_decode_num_drafts"] > 0
    common = sorted(set(spec) & set(ref))
    assert len(common) >= 5
    for pos in common:
        for name, tensor in ref[pos].items():
            torch.testing.assert_close(spec[pos][name], tensor, rtol=1e-4, atol=1e-5, msg=f"{name} at {pos}")


@pytest.mark.parametrize("arch,mode", [("mamba2", "all"), ("bamba", "all"), ("mamba", "align"),
                                       ("qwen3_next", "align")])
def test_snapshots_of_a_verify_step_are_committed_state(arch, mode, models):
    """Pass 1 generates with drafts; pass 2's prompts are pass 1's whole sequences, so they hit snapshots taken at
    block boundaries inside the outputs, i.e. in verify steps. Their continuations must be plain decoding's (a
    snapshot of the speculative state, past the accepted drafts, changes them: tried)."""
    _, path = models(arch)
    params = greedy()
    proposer, ref = _oracle_for(path, params)
    longer = [p + r.outputs[0].token_ids for p, r in zip(PROMPTS, ref)]
    follow, ref2 = _oracle_for(path, params, prompts=longer)
    proposer.reference.update(follow.reference)
    with LLM(path, skip_tokenizer_init=True, mamba_cache_mode=mode, speculative_config=NGRAM) as llm:
        llm.llm_engine.speculator.proposer = proposer
        run(llm, params)
        outs = run(llm, params, longer)
        assert sum(o.num_cached_tokens for o, p in zip(outs, PROMPTS) if o.num_cached_tokens > len(p)) > 0
        for o, r in zip(outs, ref2):
            assert o.outputs[0].token_ids == r.outputs[0].token_ids
        assert_clean(llm)


def test_bfloat16_states_are_rounded_per_token_as_in_plain_decoding(models):
    """With bfloat16 SSM states, plain decoding rounds the state after every token. A verify step must too (its
    rounds of the decode update do); a scan over the k+1 tokens would round once per chunk and put nearly every
    element a bfloat16 ulp or more off (measured: all of them). Allowed: the rare element whose rounding the
    projections' float32 round-off flips and what that carries forward (measured: 0.05%)."""
    _, path = models("mamba2")
    params, kw = greedy(), dict(mamba_ssm_cache_dtype="bfloat16")
    proposer, _ = _oracle_for(path, params, prompts=[PROMPTS[2]], **kw)
    with LLM(path, skip_tokenizer_init=True, enable_prefix_caching=False, **kw) as plain:
        ref = _states_by_position(plain, params)
    with LLM(path, skip_tokenizer_init=True, enable_prefix_caching=False, speculative_config=NGRAM, **kw) as llm:
        spec = _states_by_position(llm, params, proposer)
    common = sorted(set(spec) & set(ref))
    assert len(common) >= 5
    for pos in common:
        for name, a in ref[pos].items():
            if name.endswith(".ssm"):
                assert a.dtype == torch.bfloat16
                one_ulp = a.float().abs() * 2 ** -8
                off = (spec[pos][name].float() - a.float()).abs() > one_ulp * 1.01
                assert off.float().mean().item() < 0.01, f"{name} at {pos}"


# ---- sampling ----------------------------------------------------------------------------------------------------
CHI2_999_DF11 = 31.26  # the chi-square distribution's 99.9% quantile with 11 degrees of freedom


class ConstantProposer(OracleProposer):
    def __init__(self, token: int) -> None:
        super().__init__({}, 0.0)
        self.token = token

    def propose(self, wanted) -> None:
        for req, k in wanted:
            req.spec_token_ids = [self.token] * k


def test_rejection_sampling_keeps_the_target_distribution(tmp_path):
    """On a 12-token vocabulary: the second and third tokens of 3000 sampled requests (emitted by a verify step whose
    one draft is always token 5) against their exact marginals (sum_t1 p(t1) p(t2 | t1), and so on), and the same
    without drafts. An acceptance rule that accepts too often fails this (tried: always accepting)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = build_hf_model(LlamaConfig, LlamaForCausalLM, vocab_size=12, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    path = save_model(hf, str(tmp_path / "toy"))
    prompt, temperature = [1, 2, 3], 3.0
    with torch.no_grad():
        first = (hf(torch.tensor([prompt])).logits[0, -1] / temperature).softmax(-1)
        seconds = torch.stack([(hf(torch.tensor([prompt + [t]])).logits[0, -1] / temperature).softmax(-1)
                               for t in range(12)])
        pairs = torch.tensor([prompt + [a, b] for a in range(12) for b in range(12)])
        thirds = (hf(pairs).logits[:, -1] / temperature).softmax(-1)  # [144, 12]
    expected = {1: first @ seconds,  # [12] exact marginals of the second and third tokens
                2: ((first[:, None] * seconds).reshape(144, 1) * thirds).sum(0)}
    params = SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True)
    n = 3000
    for spec in (None, NGRAM):
        with LLM(path, skip_tokenizer_init=True, enable_prefix_caching=False, max_num_seqs=256, seed=1,
                 speculative_config=spec) as llm:
            if spec is not None:
                llm.llm_engine.speculator.proposer = ConstantProposer(5)
            outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
            if spec is not None:
                assert llm.llm_engine.stats["spec_decode_num_drafts"] == n
        for position, marginal in expected.items():
            counts = torch.bincount(torch.tensor([o.outputs[0].token_ids[position] for o in outs]),
                                    minlength=12).float()
            chi2 = ((counts - n * marginal) ** 2 / (n * marginal)).sum().item()
            assert chi2 < CHI2_999_DF11, (spec, position, chi2, counts, n * marginal)


def test_seeded_sampling_repeats_with_speculation(models):
    _, path = models("llama")
    params = SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, seed=7, n=2)
    _, ref = _oracle_for(path, greedy())
    outs = []
    for _ in range(2):  # the same drafts each time (as prompt lookup and a draft model give): the same samples
        with LLM(path, skip_tokenizer_init=True, speculative_config=NGRAM) as llm:
            llm.llm_engine.speculator.proposer = OracleProposer(
                {tuple(p): r.outputs[0].token_ids for p, r in zip(PROMPTS, ref)}, 0.3)
            outs.append([[c.token_ids for c in o.outputs] for o in run(llm, params)])
            assert llm.llm_engine.stats["spec_decode_num_drafts"] > 0
    assert outs[0] == outs[1]


# ---- stop rules, penalties, logprobs, n ----------------------------------------------------------------------------
def _stop_cases(ref_tokens: list[int]) -> dict[str, dict]:
    return {
        "stop_token_inside_run": dict(stop_token_ids=[ref_tokens[10]]),
        "max_tokens_inside_run": dict(max_tokens=13),
        "min_tokens_before_stop": dict(min_tokens=12, stop_token_ids=[ref_tokens[3]]),
        "penalties": dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3),
        "logprobs": dict(logprobs=4),
        "n": dict(n=3),
    }


@pytest.mark.parametrize("case", list(_stop_cases(list(range(20)))))
@pytest.mark.parametrize("arch", ["llama", "mamba2"])
def test_stop_rules_penalties_and_logprobs_inside_accepted_runs(arch, case, models):
    """Drafts from plain decoding with the same parameters (so most are accepted and runs are long): the output,
    finish reason and stop reason are plain decoding's when a stop id, max_tokens or min_tokens falls inside an
    accepted run, and penalties and logprobs see each verified position's own history."""
    _, path = models(arch)
    base = dict(max_tokens=30, temperature=0, ignore_eos=True)
    _, first = _oracle_for(path, SamplingParams(**base), prompts=PROMPTS[:1])
    params = SamplingParams(**{**base, **_stop_cases(first[0].outputs[0].token_ids)[case]})
    proposer, ref = _oracle_for(path, params, error=0.15)
    with LLM(path, skip_tokenizer_init=True, speculative_config=NGRAM) as llm:
        llm.llm_engine.speculator.proposer = proposer
        outs = run(llm, params)
        assert llm.llm_engine.stats["spec_decode_num_accepted_tokens"] > 0
        for o, r in zip(outs, ref):
            for mine, theirs in zip(o.outputs, r.outputs):
                assert (mine.token_ids, mine.finish_reason, mine.stop_reason) == \
                       (theirs.token_ids, theirs.finish_reason, theirs.stop_reason)
                if theirs.logprobs is not None:
                    assert [d.keys() for d in mine.logprobs] == [d.keys() for d in theirs.logprobs]
        assert_clean(llm)


def test_abort_during_a_verify_step(models):
    """A request aborted while its verify step runs (as the server's abort can land mid-step) ends with "abort";
    its kept states and blocks go back, and the requests beside it still give plain decoding's tokens."""
    _, path = models("bamba")
    proposer, ref = _oracle_for(path, greedy())
    with LLM(path, skip_tokenizer_init=True, speculative_config=NGRAM, mamba_cache_mode="all") as llm:
        engine = llm.llm_engine
        engine.speculator.proposer = proposer
        state = engine.runner.model_state
        original = state.after_step
        aborted = []

        def abort_mid_step(batch):
            original(batch)
            for i in batch.spec_seqs:
                if batch.requests[i].request_id == "1" and not aborted:
                    engine.abort_request("1")
                    aborted.append(True)
        state.after_step = abort_mid_step
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), p, greedy())
        done = {}
        while engine.has_unfinished():
            for gid in engine.step():
                done[gid] = engine.pop_output(gid)
        assert aborted and done["1"].outputs[0].finish_reason == "abort"
        for i, r in enumerate(ref):
            if i != 1:
                assert done[str(i)].outputs[0].token_ids == r.outputs[0].token_ids
        assert_clean(llm)


# ---- CLI, server, metrics, stats log -----------------------------------------------------------------------------
PASSAGE = ("The with statement is used to wrap the execution of a block with methods defined by a context manager. "
           "This allows common try except finally usage patterns to be encapsulated for convenient reuse. ")
COPY_PROMPT = PASSAGE + PASSAGE + "The with statement is used"
SPEC_JSON = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                        "prompt_lookup_max": 3})


def _plain_text(model: str, prompt: str, max_tokens: int) -> str:
    with LLM(model, enable_prefix_caching=False) as llm:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return out[0].outputs[0].text


def test_cli_generate_with_speculative_config():
    model = demo_model("llama-demo")
    env = {**os.environ, "STATESERVE_DISABLE_TQDM": "1"}
    env.pop("STATESERVE_CONFIGURE_LOGGING", None)
    cmd = [sys.executable, "-m", "stateserve.entrypoints.cli", "generate", "--model", model, "--prompt", COPY_PROMPT,
           "--max-tokens", "24", "--speculative-config", SPEC_JSON]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Speculative decoding: {'method': 'ngram'" in proc.stdout + proc.stderr
    assert f"Output: {_plain_text(model, COPY_PROMPT, 24)!r}" in proc.stdout
    bad = subprocess.run(cmd[:-1] + ['{"method": "ngram", "num_speculative_tokens": 0}'], capture_output=True,
                         text=True, env=env, cwd=REPO, timeout=300)
    assert bad.returncode != 0 and "num_speculative_tokens must be an integer" in bad.stderr


def test_server_with_speculation_streams_plain_text_and_reports_metrics():
    import httpx2
    import openai

    model = demo_model("llama-demo")
    expected = _plain_text(model, COPY_PROMPT, 32)
    proc, url, lines = start_server(model, "--speculative-config", SPEC_JSON,
                                    env={"STATESERVE_LOG_STATS_INTERVAL": "0.05"})
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        done = client.completions.create(model=model, prompt=COPY_PROMPT, max_tokens=32, temperature=0)
        assert done.choices[0].text == expected
        stream = client.completions.create(model=model, prompt=COPY_PROMPT, max_tokens=32, temperature=0,
                                           stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == expected
        metrics = httpx2.get(url + "/metrics", timeout=10).text
        drafted = float(re.search(r"^stateserve:spec_decode_num_draft_tokens_total (\S+)", metrics, re.M).group(1))
        accepted = float(re.search(r"^stateserve:spec_decode_num_accepted_tokens_total (\S+)", metrics,
                                   re.M).group(1))
        assert 0 < accepted <= drafted
        assert any("Speculative decoding: mean accepted length" in line for line in lines), "".join(lines)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.parametrize("arch", ["llama", "mamba2"])
def test_stop_string_inside_accepted_runs(arch, models, tmp_path):
    """With a tokenizer in the folder, oracle drafts (most accepted) and a stop string taken from the middle of plain
    decoding's text: the speculative run ends at the same place, with the same text and stop reason."""
    import shutil

    from utils import make_tokenizer

    _, source = models(arch)
    path = str(tmp_path / arch)
    shutil.copytree(source, path)
    make_tokenizer(path)
    base = dict(temperature=0, max_tokens=36, ignore_eos=True)
    with LLM(path, enable_prefix_caching=False) as plain:
        text = run(plain, SamplingParams(**base), PROMPTS[:1])[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    params = SamplingParams(**base, stop=[stop])
    proposer, ref = _oracle_for(path, params, prompts=PROMPTS[:1], error=0.1, skip_tokenizer_init=False)
    assert ref[0].outputs[0].finish_reason == "stop"
    with LLM(path, speculative_config=NGRAM) as llm:
        llm.llm_engine.speculator.proposer = proposer
        out = run(llm, params, PROMPTS[:1])[0]
        assert out.metrics.num_accepted_tokens > 0
    mine, theirs = out.outputs[0], ref[0].outputs[0]
    assert (mine.text, mine.token_ids, mine.finish_reason, mine.stop_reason) == \
           (theirs.text, theirs.token_ids, "stop", stop)


def test_low_acceptance_stops_speculating(models):
    """Drafts that are always wrong: after a few verify steps the request pauses drafting (longer after each
    relapse), so most of its tokens are plain decode steps; its tokens are still plain decoding's."""
    _, path = models("mamba2")
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    proposer, ref = _oracle_for(path, params, prompts=PROMPTS[:1], error=1.0)
    with LLM(path, skip_tokenizer_init=True, speculative_config=NGRAM) as llm:
        llm.llm_engine.speculator.proposer = proposer
        out = run(llm, params, PROMPTS[:1])[0]
    assert out.outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert out.metrics.num_accepted_tokens == 0
    assert 4 <= out.metrics.num_verify_steps <= 15  # of ~60 decode steps
