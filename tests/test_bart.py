"""BART: batched greedy parity with transformers' generate (different encoder lengths, decoder prompts long
enough for chunked prefill), encoder cache lifetime, preemption, prefix caching per encoder input, bad input."""
from __future__ import annotations

import pytest
import torch
from transformers import BartConfig, BartForConditionalGeneration

from stateserve import LLM, SamplingParams
from utils import build_hf_model, make_tokenizer, save_model

BASE = dict(vocab_size=300, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
            pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
            initializer_range=0.06)
# with its own LM head the tiny model's greedy choices vary from step to step (tied, it repeats a token)
UNTIED = dict(scale_embedding=True, tie_word_embeddings=False, activation_function="relu")

ENC = [[0, 5, 9, 2], list(range(10, 40)), [7, 3, 8, 250, 251, 11], list(range(100, 157))]
DEC = [None, [2, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 66],
       [30, 31], None]  # [30, 31] gets the decoder start token prepended, as in transformers
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
GREEDY_LP = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1)


def _build(tmp_path, **extra):
    hf = build_hf_model(BartConfig, BartForConditionalGeneration, **{**BASE, **extra})
    return hf, save_model(hf, str(tmp_path / "bart"))


def hf_seq2seq_greedy(hf, enc: list[int], dec: list[int] | None, max_new: int, **gen_kwargs) -> list[int]:
    gc = hf.generation_config
    gc.eos_token_id = gc.forced_eos_token_id = gc.forced_bos_token_id = None
    kwargs = {} if dec is None else {"decoder_input_ids": torch.tensor([dec])}
    with torch.no_grad():
        ids = torch.tensor([enc])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                          num_beams=1, generation_config=gc, **kwargs, **gen_kwargs)
    return out[0].tolist()


def _prompt(enc, dec):
    return {"encoder_prompt": {"prompt_token_ids": enc},
            "decoder_prompt": None if dec is None else {"prompt_token_ids": dec}}


def assert_matches_hf(hf, outs, encs, decs, max_new, **gen_kwargs):
    for out, enc, dec in zip(outs, encs, decs):
        ref = hf_seq2seq_greedy(hf, enc, dec, max_new, **gen_kwargs)
        assert out.prompt_token_ids + out.outputs[0].token_ids == ref, (enc, dec)


def assert_logprobs_match(hf, out, enc: list[int] | dict) -> None:
    """The engine's logprob of each generated token equals transformers' (log_softmax of its logits).
    enc: encoder token ids, or the encoder's keyword inputs (e.g. {"input_features": ...})."""
    full = out.prompt_token_ids + out.outputs[0].token_ids
    encoder_kwargs = enc if isinstance(enc, dict) else {"input_ids": torch.tensor([enc])}
    with torch.no_grad():
        logits = hf(**encoder_kwargs, decoder_input_ids=torch.tensor([full[:-1]])).logits[0]
    n = len(out.outputs[0].token_ids)
    ref = logits[-n:].log_softmax(-1).gather(1, torch.tensor(full[-n:])[:, None]).squeeze(1)
    ours = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)])
    # decode rows go through other float32 summation orders than transformers' full forward (CPU kernels);
    # with decisive weights the logits are large, so 5e-4 absolute; a wrong cache gives O(1) differences
    torch.testing.assert_close(ours, ref.float(), atol=5e-4, rtol=1e-4)


def assert_idle(llm):
    engine = llm.llm_engine
    engine.check_integrity()
    assert engine.cache.is_idle_and_full()
    assert engine.runner.model_state.encoder_cache_size() == 0


@pytest.mark.parametrize("extra", [{}, UNTIED], ids=["tied", "untied_scaled_relu"])
def test_greedy_parity_chunked(extra, tmp_path):
    hf, path = _build(tmp_path, **extra)
    with torch.no_grad():  # a non-zero final_logits_bias, so the test sees whether it is applied
        hf.final_logits_bias.normal_(0, 1.0, generator=torch.Generator().manual_seed(3))
    hf.save_pretrained(path)
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=16, block_size=4,
             enable_prefix_caching=False) as llm:
        outs = llm.generate([_prompt(e, d) for e, d in zip(ENC, DEC)], GREEDY_LP)
        assert_matches_hf(hf, outs, ENC, DEC, GREEDY.max_tokens)
        for out, enc in zip(outs, ENC):
            assert_logprobs_match(hf, out, enc)
        assert_idle(llm)
        # plain token ids are the encoder input; decoding starts from decoder_start_token_id
        plain = llm.generate([{"prompt_token_ids": ENC[1]}], GREEDY)[0]
        assert plain.prompt_token_ids == [2]
        assert plain.prompt_token_ids + plain.outputs[0].token_ids == hf_seq2seq_greedy(hf, ENC[1], None, 10)
        assert_idle(llm)


def test_preemption_and_abort_free_the_encoder_cache(tmp_path):
    hf, path = _build(tmp_path, **UNTIED)
    # room for about two sequences' decoder KV: requests get preempted and re-encoded when they resume
    kv_bytes = 2 * 2 * 64 * 4 * 4 * 20  # layers * (k, v) * d_model * fp32 * blocks of 4 tokens
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=32, block_size=4,
             kv_cache_memory_bytes=kv_bytes, enable_prefix_caching=False) as llm:
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        decs = [[2, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]] * 4
        outs = llm.generate([_prompt(e, d) for e, d in zip(ENC, decs)], params)
        assert llm.llm_engine.stats["preemptions"] > 0
        assert_matches_hf(hf, outs, ENC, decs, 20)
        assert_idle(llm)
        engine = llm.llm_engine
        engine.add_request("x", ENC[1], GREEDY)
        engine.step()
        assert engine.runner.model_state.encoder_cache_size() == 1
        engine.abort_request("x")
        engine.pop_output("x")
        assert_idle(llm)


def test_prefix_cache_keys_depend_on_the_encoder_input(tmp_path):
    hf, path = _build(tmp_path, **UNTIED)
    dec = [2] + list(range(40, 60))  # 21 tokens: five full blocks of 4 can be reused
    encs = [ENC[0], ENC[2], ENC[0]]
    with LLM(path, skip_tokenizer_init=True, block_size=4, enable_prefix_caching=True) as llm:
        for enc in encs:  # one at a time, so every later request could hit the earlier ones' blocks
            out = llm.generate([_prompt(enc, dec)], GREEDY)[0]
            assert_matches_hf(hf, [out], [enc], [dec], GREEDY.max_tokens)
        # only the repeated (encoder, decoder) pair hit the cache
        assert llm.llm_engine.stats["prefix_cache_hits"] == 20
        assert_idle(llm)


def test_bad_encoder_input(tmp_path):
    hf, path = _build(tmp_path)
    with LLM(path, skip_tokenizer_init=True) as llm:
        with pytest.raises(ValueError, match="max_position_embeddings=64"):
            llm.generate([_prompt(ENC[0], None), _prompt(list(range(3, 70)), None)], GREEDY)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate(_prompt([1, 300], None), GREEDY)
        with pytest.raises(ValueError, match="empty"):
            llm.generate(_prompt([], None), GREEDY)
        with pytest.raises(ValueError, match="unsupported key"):
            llm.generate({"encoder_prompt": {"prompt_token_ids": [3]}, "decoder": [2]}, GREEDY)
        with pytest.raises(ValueError, match="takes text"):
            llm.generate({"prompt_token_ids": [2], "multi_modal_data": {"audio": ([0.0] * 10, 16000)}}, GREEDY)
        assert not llm.llm_engine.has_unfinished()
        assert_idle(llm)


def test_text_prompts(tmp_path):
    tok = make_tokenizer(str(tmp_path / "tok"))
    hf = build_hf_model(BartConfig, BartForConditionalGeneration, **BASE)
    path = save_model(hf, str(tmp_path / "bart"), tok)
    with LLM(path, max_num_batched_tokens=16) as llm:
        text = "The quick brown fox jumps over the lazy dog."
        enc_ids = llm.get_tokenizer()(text).input_ids
        out = llm.generate(text, GREEDY)[0]
        assert out.prompt == text and out.prompt_token_ids == [2]
        assert out.prompt_token_ids + out.outputs[0].token_ids == hf_seq2seq_greedy(hf, enc_ids, None, 10)
        # decoder text is tokenized without special tokens, then gets the decoder start token
        out = llm.generate({"encoder_prompt": text, "decoder_prompt": "A state"}, GREEDY)[0]
        dec_ids = llm.get_tokenizer()("A state", add_special_tokens=False).input_ids
        assert out.prompt_token_ids == [2] + dec_ids
        assert out.prompt_token_ids + out.outputs[0].token_ids == hf_seq2seq_greedy(hf, enc_ids, dec_ids, 10)
