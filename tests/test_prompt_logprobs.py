"""SamplingParams(prompt_logprobs=k) (vLLM's semantics: None for the first prompt token, then per prompt token its
logprob, rank and the top k), against transformers' log-softmax in float32, for a decoder, an attention-free model
and a hybrid; chunked prefill, prefix caching (a cached prefix must not skip them) and preemption included."""
from __future__ import annotations

import pytest
import torch

from stateserve import LLM, SamplingParams
from test_spec_decode import ARCHS, PROMPTS

LONG = [p * 3 for p in PROMPTS[:4]]  # 27-123 tokens: several chunks of 32 and full 16-token blocks


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
                    assert abs(entry[token].logprob - row[token].item()) < 1e-4
                    assert entry[token].rank == int((row > row[token]).sum()) + 1
                    top = row.topk(3).indices.tolist()
                    assert set(top) <= set(entry), (pos, top, entry.keys())
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
