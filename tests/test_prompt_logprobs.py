"""SamplingParams(prompt_logprobs=k) (vLLM's semantics: None for the first prompt token, then per prompt token its
logprob, rank and the top k), against transformers' log-softmax in float32, for a decoder, an attention-free model
and a hybrid; chunked prefill, prefix caching (a cached prefix must not skip them) and preemption included."""
from __future__ import annotations

import pytest
import torch

from stateserve import LLM, SamplingParams
from test_spec_decode import ARCHS, PROMPTS

LONG = [p * 3 for p in PROMPTS[:4]]  # 27-123 tokens: several chunks of 32 and full 16-token blocks
TOL = 1e-4  # float32 logprobs against transformers' (measured: <= 3.4e-5; bamba's 3rd and 4th lie 3.8e-6 apart)


@pytest.mark.parametrize("arch", ["llama", "mamba2", "bamba", "qwen3_next"])
def test_prompt_logprobs_match_transformers(arch, tmp_path):
    hf, path = ARCHS[arch](tmp_path)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=3)
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=32, **(
            {"mamba_cache_mode": "all"} if arch != "llama" else {})) as llm:
        for rounds in range(2):  # the second pass finds the prompts' blocks cached, and must compute them anyway
            outs = llm.generate([{"prompt_token_ids": p} for p in LONG], params, use_tqdm=False)
            for prompt, out in zip(LONG, outs):
                with torch.no_grad():
                    ref = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)  # [P, vocab]
                got = out.prompt_logprobs
                assert len(got) == len(prompt) and got[0] is None
                for pos in range(1, len(prompt)):
                    entry, row = got[pos], ref[pos - 1]
                    token = prompt[pos]
                    assert abs(entry[token].logprob - row[token].item()) < TOL
                    # ties within round-off may order either way: the rank and the top 3 are checked up to them
                    surely_above = int((row > row[token] + TOL).sum())
                    maybe_above = int((row > row[token] - TOL).sum()) - 1  # (the token itself counted out)
                    assert surely_above + 1 <= entry[token].rank <= maybe_above + 1, (pos, entry[token].rank)
                    fourth = row.topk(4).values[-1].item()
                    clear_top = [t for t in row.topk(3).indices.tolist() if row[t] > fourth + TOL]
                    assert set(clear_top) <= set(entry), (pos, clear_top, entry.keys())
                    assert all(row[t] >= fourth - TOL for t in entry if t != token), (pos, entry.keys())
                assert out.num_cached_tokens == 0  # prompt logprobs never take a prefix hit


def test_prompt_logprobs_survive_preemption(tmp_path):
    hf, path = ARCHS["llama"](tmp_path)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, prompt_logprobs=0)
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=32, enable_prefix_caching=False) as roomy:
        ref = roomy.generate([{"prompt_token_ids": p} for p in LONG], params, use_tqdm=False)
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=32, enable_prefix_caching=False,
             num_gpu_blocks_override=12) as tight:
        outs = tight.generate([{"prompt_token_ids": p} for p in LONG], params, use_tqdm=False)
        assert tight.llm_engine.stats["preemptions"] > 0
    for o, r in zip(outs, ref):
        assert len(o.prompt_logprobs) == len(r.prompt_logprobs)
        for mine, theirs in zip(o.prompt_logprobs[1:], r.prompt_logprobs[1:]):
            assert mine.keys() == theirs.keys()
            assert all(abs(mine[t].logprob - theirs[t].logprob) < 1e-4 for t in mine)
