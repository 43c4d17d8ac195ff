"""T5: batched greedy parity with transformers' generate for original T5 (relu, tied + scaled output) and the
v1.1/Flan style (gated-gelu, own lm_head, no scaling); decoder prompts longer than the bias's max_distance
under chunked prefill (the decoder's relative bias must use absolute query positions); encoder cache freed."""
from __future__ import annotations

import pytest
import torch
from transformers import T5Config, T5ForConditionalGeneration

from stateserve import LLM, SamplingParams
from utils import build_hf_model
from test_bart import GREEDY, GREEDY_LP, _prompt, assert_idle, assert_logprobs_match, assert_matches_hf

# few buckets and a short max_distance, so short test sequences reach the log-spaced and the last bucket
BASE = dict(vocab_size=300, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=3, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=12, decoder_start_token_id=0,
            pad_token_id=0, eos_token_id=1, initializer_factor=4.0)  # strong layers: greedy choices vary

ENC = [[5, 9, 1], list(range(10, 40)), [7, 3, 8, 250, 251, 11], list(range(100, 141))]
DEC = [None, [0] + list(range(45, 70)), [30, 31], [0, 77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90]]


def _build(tmp_path, untie: bool, **extra):
    hf = build_hf_model(T5Config, T5ForConditionalGeneration, **{**BASE, **extra})
    path = str(tmp_path / "t5")
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():  # a strong position bias, so greedy choices depend on it
        for stack in (hf.encoder, hf.decoder):
            table = stack.block[0].layer[0].SelfAttention.relative_attention_bias.weight
            table.copy_(torch.randn(table.shape, generator=gen) * 2)
    if untie:  # a v1.1-style checkpoint: lm_head.weight of its own next to shared.weight
        gen = torch.Generator().manual_seed(5)
        hf.lm_head.weight = torch.nn.Parameter(torch.randn(hf.lm_head.weight.shape, generator=gen) * 0.5)
    hf.save_pretrained(path)
    # the oracle is what transformers loads from that folder (it keeps a distinct lm_head untied)
    return T5ForConditionalGeneration.from_pretrained(path).eval(), path


CASES = [(False, {"feed_forward_proj": "relu"}),
         (True, {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False})]


@pytest.mark.parametrize("untie,extra", CASES, ids=["t5_relu_tied", "v1_1_gated_gelu_untied"])
def test_greedy_parity_chunked(untie, extra, tmp_path):
    hf, path = _build(tmp_path, untie, **extra)
    assert (hf.lm_head.weight.data_ptr() == hf.shared.weight.data_ptr()) is not untie
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=8, block_size=4,
             enable_prefix_caching=False) as llm:
        outs = llm.generate([_prompt(e, d) for e, d in zip(ENC, DEC)], GREEDY_LP)
        # transformers' own cache sizes itself by num_layers, not num_decoder_layers: run it without one
        assert_matches_hf(hf, outs, ENC, DEC, GREEDY.max_tokens, use_cache=False)
        for out, enc in zip(outs, ENC):  # logprobs also see the d_model**-0.5 output scale
            assert_logprobs_match(hf, out, enc)
        assert_idle(llm)


def test_long_decode_prefix_cache_and_bad_input(tmp_path):
    hf, path = _build(tmp_path, False, feed_forward_proj="gated-gelu")
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    dec = [0] + list(range(200, 213))
    with LLM(path, skip_tokenizer_init=True, block_size=4, max_model_len=64) as llm:
        for enc in (ENC[1], ENC[1]):  # the second run reuses decoder KV blocks (same encoder input)
            out = llm.generate(_prompt(enc, dec), params)[0]
            assert_matches_hf(hf, [out], [enc], [dec], 24, use_cache=False)
        assert llm.llm_engine.stats["prefix_cache_hits"] > 0
        assert_idle(llm)
        # no position table: the engine's max_model_len bounds the encoder prompt
        with pytest.raises(ValueError, match="max_model_len=64"):
            llm.generate(_prompt(list(range(2, 70)), None), params)
        assert not llm.llm_engine.has_unfinished()


def test_unsupported_feed_forward(tmp_path):
    hf, path = _build(tmp_path, False)
    with pytest.raises(ValueError, match="feed_forward_proj"):
        LLM(path, skip_tokenizer_init=True, hf_overrides={"feed_forward_proj": "gated-gelu-x"})
