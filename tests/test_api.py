"""Offline API behaviour on a tiny Llama: text prompts, sampling options, seeds, n > 1, stops, logprobs,
preemption, abort, and clear errors for bad input that leave other requests untouched."""
from __future__ import annotations

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from stateserve import LLM, SamplingParams
from stateserve.core.request import Request
from utils import assert_cache_sized, build_hf_model, hf_greedy, save_model

CFG = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir):
    hf = build_hf_model(LlamaConfig, LlamaForCausalLM, **CFG)
    return hf, save_model(hf, str(tmp_path_factory.mktemp("llama")), tokenizer_dir)


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model_dir[1], max_num_batched_tokens=32, max_num_seqs=8) as llm:
        yield llm


def ids(n, start=3):
    return {"prompt_token_ids": [(start + 7 * i) % 290 + 3 for i in range(n)]}


def test_text_prompts_and_output_fields(llm, model_dir):
    hf, _ = model_dir
    tok = llm.get_tokenizer()
    prompts = ["The quick brown fox", "Attention reads every"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [o.prompt for o in outs] == prompts
    ref = hf_greedy(hf, [tok(p).input_ids for p in prompts], 8)
    for o, r in zip(outs, ref):
        assert o.prompt_token_ids == tok(o.prompt).input_ids
        c = o.outputs[0]
        assert c.token_ids == r and c.finish_reason == "length" and o.finished
        assert c.text == tok.decode(r, skip_special_tokens=True)
        assert c.cumulative_logprob is None and c.logprobs is None


def test_seed_reproduces_whatever_the_batch(llm):
    p = SamplingParams(max_tokens=10, temperature=1.0, top_k=50, top_p=0.9, seed=1234)
    alone = llm.generate([ids(5)], p)[0].outputs[0].token_ids
    others = SamplingParams(max_tokens=12, temperature=1.5)
    batched = llm.generate([ids(9, 11), ids(5), ids(20, 2)], [others, p, others])
    assert batched[1].outputs[0].token_ids == alone
    different = llm.generate([ids(5)], SamplingParams(max_tokens=10, temperature=1.0, top_k=50, top_p=0.9,
                                                      seed=99))[0].outputs[0].token_ids
    assert different != alone


def test_n_samples_and_logprobs(llm):
    out = llm.generate([ids(6)], SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=7, logprobs=2))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        assert len(c.logprobs) == 5
        total = sum(step[t].logprob for step, t in zip(c.logprobs, c.token_ids))
        assert c.cumulative_logprob == pytest.approx(total, abs=1e-4)
        for step, t in zip(c.logprobs, c.token_ids):
            assert t in step and len(step) in (2, 3)
            assert all(lp.logprob <= 0 for lp in step.values())


def test_greedy_logprobs_rank_one(llm):
    c = llm.generate([ids(4)], SamplingParams(max_tokens=4, temperature=0, logprobs=1))[0].outputs[0]
    for step, t in zip(c.logprobs, c.token_ids):
        assert step[t].rank == 1


def test_stop_token_ids_and_min_tokens(llm):
    base = llm.generate([ids(4)], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].outputs[0]
    stop_at = base.token_ids[2]
    c = llm.generate([ids(4)], SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[stop_at]))[0].outputs[0]
    first = base.token_ids.index(stop_at)
    assert c.token_ids == base.token_ids[:first + 1]
    assert c.finish_reason == "stop" and c.stop_reason == stop_at
    c2 = llm.generate([ids(4)], SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[stop_at],
                                               min_tokens=6))[0].outputs[0]
    assert len(c2.token_ids) == 6 and stop_at not in c2.token_ids


def test_stop_string_not_in_text(llm):
    base = llm.generate(["The quick"], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].outputs[0]
    text = base.text
    assert len(text) > 4
    stop = text[2:4]
    c = llm.generate(["The quick"], SamplingParams(max_tokens=10, temperature=0, stop=[stop]))[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[:text.index(stop)]


def test_penalties_change_output(llm):
    plain = llm.generate([ids(3)], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    pen = llm.generate([ids(3)], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                                 repetition_penalty=5.0, frequency_penalty=2.0))[0]
    toks = pen.outputs[0].token_ids
    assert toks != plain.outputs[0].token_ids
    assert len(set(toks)) >= len(set(plain.outputs[0].token_ids))


def test_preemption_gives_same_tokens(model_dir):
    """num_gpu_blocks_override=8 gives the engine exactly 8 KV blocks, whatever its (default, roomy) memory budget
    holds; the requests that do not fit get preempted and recomputed, with the tokens of an unconstrained run."""
    _, path = model_dir
    prompts = [ids(20 + 3 * i, i) for i in range(6)]
    p = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    with LLM(path, max_num_batched_tokens=64) as roomy:
        assert roomy.llm_engine.runner.caches.plan.num_blocks > 8
        ref = [o.outputs[0].token_ids for o in roomy.generate(prompts, p)]
    # 8 blocks of 16 tokens cannot hold six 50-token sequences at once: requests get preempted
    with LLM(path, max_num_batched_tokens=64, num_gpu_blocks_override=8) as tight:
        assert_cache_sized(tight, 8)
        outs = tight.generate(prompts, p)
        assert tight.llm_engine.stats["preemptions"] > 0
        assert [o.outputs[0].token_ids for o in outs] == ref
        tight.llm_engine.check_integrity()
        assert tight.llm_engine.cache.is_idle_and_full()


def test_abort_frees_everything(llm):
    engine = llm.llm_engine
    engine.add_request("a", ids(40)["prompt_token_ids"], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", ids(10)["prompt_token_ids"], SamplingParams(max_tokens=3, temperature=0))
    engine.step()  # a is mid-prefill (budget 32)
    engine.abort_request("a")
    while engine.has_unfinished():
        engine.step()
    assert engine.pop_output("a").outputs[0].finish_reason == "abort"
    assert len(engine.pop_output("b").outputs[0].token_ids) == 3
    engine.check_integrity()
    assert engine.cache.is_idle_and_full()


BAD_PROMPTS = [
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": [5] * 129}, "max_model_len"),
    ({"prompt_token_ids": [5, 300]}, "outside the vocabulary"),
    ({"prompt_token_ids": [5, -1]}, "outside the vocabulary"),
    ("", "empty"),
]


@pytest.mark.parametrize("prompt,msg", BAD_PROMPTS)
def test_bad_prompt_clear_error_and_others_untouched(llm, prompt, msg):
    good = ids(5)
    before = llm.generate([good], SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=msg):
        llm.generate([good, prompt], SamplingParams(max_tokens=4, temperature=0))
    assert not llm.llm_engine.has_unfinished()
    after = llm.generate([good], SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].token_ids
    assert before == after
    assert llm.llm_engine.cache.is_idle_and_full()


@pytest.mark.parametrize("kwargs,msg", [
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n must"), ({"max_tokens": 0}, "max_tokens"), ({"top_k": -5}, "top_k"),
    ({"min_p": 2.0}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
])
def test_bad_sampling_params(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kwargs)


def test_unknown_keywords_raise_type_error(model_dir):
    with pytest.raises(TypeError, match="bogus"):
        SamplingParams(bogus=1)
    with pytest.raises(TypeError, match="not_an_arg"):
        LLM(model_dir[1], not_an_arg=3)


def test_dtype_given_as_torch_dtype_or_name():
    import torch

    from stateserve.config import EngineConfig

    assert EngineConfig(model="m", dtype=torch.bfloat16).dtype == "bfloat16"  # vLLM takes torch dtypes too
    assert EngineConfig(model="m", dtype=torch.float32).dtype == "float32"
    with pytest.raises(ValueError, match="dtype must be float32, bfloat16 or float16, got torch.int8"):
        EngineConfig(model="m", dtype=torch.int8)
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        EngineConfig(model="m", dtype="fp8")


def test_generate_after_shutdown_raises(model_dir):
    llm = LLM(model_dir[1], skip_tokenizer_init=True)
    llm.shutdown()
    llm.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([ids(3)])


def test_request_state_isolated():
    r = Request("x", [1, 2], SamplingParams(), 0)
    r.append_token(5)
    assert r.prompt_token_ids == [1, 2] and r.token_ids == [1, 2, 5] and r.group_id == "x"


def test_top_k_one_is_greedy(llm):
    g = llm.generate([ids(7)], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].token_ids
    k1 = llm.generate([ids(7)], SamplingParams(max_tokens=8, temperature=0.8, top_k=1, seed=3))[0].outputs[0]
    assert k1.token_ids == g
