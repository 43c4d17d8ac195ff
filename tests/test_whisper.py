"""Whisper: audio -> log-mel features (WhisperFeatureExtractor from the model folder) -> encoder; batched greedy
parity with transformers' generate for decoder prompts of different lengths (one long enough for chunked
prefill), logprobs, encoder cache freed, and clear errors for a wrong sample rate, too-long or missing audio."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

from stateserve import LLM, SamplingParams
from test_bart import GREEDY_LP, assert_idle, assert_logprobs_match
from utils import build_hf_model

RATE = 16000
START = 5  # the tiny vocabulary's <|startoftranscript|>
# one-second windows: 100 mel frames -> 50 encoder positions; an untied head makes greedy choices vary
BASE = dict(vocab_size=300, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=50,
            max_target_positions=64, num_mel_bins=16, decoder_start_token_id=START, pad_token_id=1,
            bos_token_id=1, eos_token_id=2, begin_suppress_tokens=None, suppress_tokens=None,
            tie_word_embeddings=False, initializer_range=0.02)

DEC = [None, [START, 7, 8, 9], [START] + list(range(20, 40)), [11, 12]]  # the last: no start token


def _audio(seed: int, seconds: float) -> np.ndarray:
    t = np.arange(int(RATE * seconds)) / RATE
    rng = np.random.RandomState(seed)
    return (np.sin(2 * np.pi * (200 + 150 * seed) * t) * 0.3 + rng.randn(t.size) * 0.05).astype(np.float32)


AUDIO = [_audio(i, s) for i, s in enumerate([1.0, 0.4, 0.75, 0.2])]


def _build(tmp_path, **extra):
    hf = build_hf_model(WhisperConfig, WhisperForConditionalGeneration, **{**BASE, **extra})
    fe = WhisperFeatureExtractor(feature_size=BASE["num_mel_bins"], sampling_rate=RATE, hop_length=160,
                                 chunk_length=1, n_fft=400)
    path = str(tmp_path / "whisper")
    hf.save_pretrained(path)
    fe.save_pretrained(path)
    return hf, fe, path


def _prompt(dec, audio, rate=RATE):
    p = {"multi_modal_data": {"audio": (audio, rate)}}
    if dec is not None:
        p["prompt_token_ids"] = dec
    return p


def hf_whisper_greedy(hf, features: torch.Tensor, dec: list[int], max_new: int) -> list[int]:
    gc = hf.generation_config
    gc.eos_token_id = None
    with torch.no_grad():  # Whisper's generate returns only the new tokens
        out = hf.generate(features, decoder_input_ids=torch.tensor([dec]), max_new_tokens=max_new, do_sample=False,
                          num_beams=1, generation_config=gc)
    return out[0].tolist()


@pytest.mark.parametrize("extra", [{}, {"tie_word_embeddings": True, "activation_function": "gelu_new"}],
                         ids=["untied", "tied_gelu_new"])
def test_greedy_parity_chunked(extra, tmp_path):
    hf, fe, path = _build(tmp_path, **extra)
    with LLM(path, skip_tokenizer_init=True, max_num_batched_tokens=8, block_size=4,
             enable_prefix_caching=False) as llm:
        outs = llm.generate([_prompt(d, a) for d, a in zip(DEC, AUDIO)], GREEDY_LP)
        for out, dec, audio in zip(outs, DEC, AUDIO):
            assert out.prompt_token_ids == (dec or [START])  # Whisper's decoder prompt is used as given
            features = fe(audio, sampling_rate=RATE, return_tensors="pt").input_features
            assert out.outputs[0].token_ids == hf_whisper_greedy(hf, features, out.prompt_token_ids, 10)
            assert_logprobs_match(hf, out, {"input_features": features})
        assert_idle(llm)


def test_bad_audio(tmp_path):
    hf, fe, path = _build(tmp_path)
    with LLM(path, skip_tokenizer_init=True) as llm:
        with pytest.raises(ValueError, match="sample rate 8000 Hz differs"):
            llm.generate([_prompt(None, AUDIO[0]), _prompt(None, AUDIO[1], rate=8000)], GREEDY_LP)
        with pytest.raises(ValueError, match="at most 1.00 s"):
            llm.generate(_prompt(None, _audio(0, 1.5)), GREEDY_LP)
        with pytest.raises(ValueError, match="takes audio"):
            llm.generate({"prompt_token_ids": [START, 7]}, GREEDY_LP)
        with pytest.raises(ValueError, match="mono"):
            llm.generate(_prompt(None, np.zeros((2, 100), dtype=np.float32)), GREEDY_LP)
        assert not llm.llm_engine.has_unfinished()
        assert_idle(llm)
        # the decoder's learned positions bound the decoder: max_model_len is max_target_positions
        assert llm.llm_engine.model_config.max_model_len == BASE["max_target_positions"]
        out = llm.generate(_prompt([START] * 60, AUDIO[0]), SamplingParams(max_tokens=10, ignore_eos=True))[0]
        assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"
        assert_idle(llm)
