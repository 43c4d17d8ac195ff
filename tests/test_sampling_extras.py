"""The sampling parameters past OpenAI's basic set (issue 35): logit_bias, include_stop_str_in_output,
truncate_prompt_tokens for generation, and stop strings honoured only once min_tokens tokens exist. Offline here;
through the server and the openai client in tests/test_server_extras.py."""
from __future__ import annotations

import pytest

from stateserve import LLM, SamplingParams
from stateserve.sampling_params import SamplingParamsError
from utils import demo_model


@pytest.fixture(scope="module")
def llm():
    with LLM(demo_model("llama-demo"), enable_prefix_caching=False) as engine:
        yield engine


PROMPT = "The with statement is used to"


def _one(llm: LLM, prompt=PROMPT, **kw):
    return llm.generate([prompt], SamplingParams(temperature=0, **kw), use_tqdm=False)[0]


def test_logit_bias_forces_and_bans_tokens(llm):
    plain = _one(llm, max_tokens=8).outputs[0].token_ids
    forced = _one(llm, max_tokens=5, logit_bias={77: 100.0}).outputs[0].token_ids
    assert forced == [77] * 5
    banned = _one(llm, max_tokens=8, logit_bias={plain[0]: -100.0}).outputs[0].token_ids
    assert banned[0] != plain[0]
    same = _one(llm, max_tokens=8, logit_bias={plain[0]: 0.0}).outputs[0].token_ids
    assert same == plain


def test_logit_bias_refuses_bad_values(llm):
    with pytest.raises(SamplingParamsError, match="logit_bias must map token ids"):
        SamplingParams(logit_bias={5: 101.0})
    with pytest.raises(SamplingParamsError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})
    with pytest.raises(ValueError, match="logit_bias has token id.* outside the vocabulary"):
        _one(llm, logit_bias={10**6: 1.0})


def test_include_stop_str_in_output(llm):
    text = _one(llm, max_tokens=30).outputs[0].text
    stop = text[10:14]
    cut = _one(llm, max_tokens=30, stop=[stop]).outputs[0]
    kept = _one(llm, max_tokens=30, stop=[stop], include_stop_str_in_output=True).outputs[0]
    first = text.find(stop)
    assert (cut.text, cut.stop_reason) == (text[:first], stop)
    assert (kept.text, kept.stop_reason, kept.finish_reason) == (text[:first + len(stop)], stop, "stop")


def test_stop_string_before_min_tokens_does_not_cut(llm):
    """A stop string whose first occurrence lies in the first tokens is not honoured there when min_tokens asks for
    more: the text runs past it (the old behaviour cut it at the early occurrence once min_tokens was reached)."""
    out = _one(llm, max_tokens=30).outputs[0]
    stop = out.text[:3]
    early = _one(llm, max_tokens=30, stop=[stop]).outputs[0]
    assert early.text == ""  # honoured at once without min_tokens
    late = _one(llm, max_tokens=30, stop=[stop], min_tokens=12).outputs[0]
    assert len(late.token_ids) >= 12
    assert late.text.startswith(out.text[:3]) and len(late.text) > 3


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    ids = llm.get_tokenizer()(PROMPT * 4).input_ids
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=6,
                                                                   truncate_prompt_tokens=5), use_tqdm=False)[0]
    direct = llm.generate([{"prompt_token_ids": ids[-5:]}], SamplingParams(temperature=0, max_tokens=6),
                          use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-5:]
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids
    whole = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, truncate_prompt_tokens=-1),
                         use_tqdm=False)[0]
    assert whole.prompt_token_ids == ids
    with pytest.raises(SamplingParamsError, match="truncate_prompt_tokens must be -1"):
        SamplingParams(truncate_prompt_tokens=0)


def test_best_of_returns_the_n_most_likely_samples(llm):
    """best_of=6, n=2: six samples run (seeded), and the two with the highest cumulative logprob come back, in that
    order; without logprobs asked, none are shown. The same six samples with n=6 and logprobs tell which those are."""
    def sample(**kw):
        return llm.generate([PROMPT], SamplingParams(temperature=1.0, max_tokens=8, seed=3, **kw),
                            use_tqdm=False)[0].outputs

    every = sample(n=6, logprobs=0)
    best = sample(n=2, best_of=6)
    ranked = sorted(every, key=lambda o: o.cumulative_logprob, reverse=True)[:2]
    assert [o.token_ids for o in best] == [o.token_ids for o in ranked]
    assert [o.index for o in best] == [0, 1] and best[0].logprobs is None and best[0].cumulative_logprob is None
    shown = sample(n=2, best_of=6, logprobs=1)
    assert [o.token_ids for o in shown] == [o.token_ids for o in ranked] and shown[0].logprobs is not None
    with pytest.raises(SamplingParamsError, match="best_of must be an integer >= n"):
        SamplingParams(n=3, best_of=2)
