"""The 2026 state-carrying families along the paths a user takes, not only through LLM: `stateserve generate` on a
Qwen3.5 folder (gated delta net + gated attention) and `stateserve serve` answering the openai client on a Kimi
Linear folder (KDA + MLA's latent cache) and a RecurrentGemma folder (RG-LRU + a windowed KV cache), each giving
the greedy text that LLM gives in-process."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from transformers import (KimiLinearConfig, KimiLinearForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig,
                          RecurrentGemmaConfig, RecurrentGemmaForCausalLM)

from stateserve import LLM, SamplingParams
from utils import build_hf_model, make_tokenizer, save_model, start_server

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENS = dict(vocab_size=300, pad_token_id=2, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
FAMILIES = {
    "qwen3_5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM, dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
        linear_conv_kernel_dim=4, full_attention_interval=2, max_position_embeddings=256, initializer_range=0.15)),
    "kimi_linear": (KimiLinearConfig, KimiLinearForCausalLM, dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=12, num_local_experts=4, num_experts_per_tok=2, linear_head_dim=8, linear_num_heads=4,
        linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"], initializer_range=0.15)),
    "recurrent_gemma": (RecurrentGemmaConfig, RecurrentGemmaForCausalLM, dict(
        hidden_size=32, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        lru_width=32, attention_window_size=6, conv1d_width=4, block_types=["recurrent", "attention"])),
}
PROMPT = "The state of the art, and the art of the state"
MAX_TOKENS = 12  # past RecurrentGemma's 6-token window


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tok = make_tokenizer(str(tmp_path_factory.mktemp("tok")))
    made = {}
    for name, (config_cls, model_cls, cfg) in FAMILIES.items():
        hf = build_hf_model(config_cls, model_cls, **{**TOKENS, **cfg})
        made[name] = save_model(hf, str(tmp_path_factory.mktemp(name)), tok)
    return made


def _in_process(path: str, ignore_eos: bool = True) -> tuple[str, int]:
    """LLM's greedy text of PROMPT and its number of tokens."""
    with LLM(path, kv_cache_memory_bytes=32 << 20, block_size=4) as llm:
        out = llm.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=ignore_eos),
                           use_tqdm=False)
    return out[0].outputs[0].text, len(out[0].outputs[0].token_ids)


def test_cli_generate_on_qwen3_5(folders):
    path = folders["qwen3_5"]
    env = {**os.environ, "STATESERVE_DISABLE_TQDM": "1", "STATESERVE_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "stateserve.entrypoints.cli", "generate", "--model", path, "--prompt", PROMPT,
           "--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--block-size", "4",
           "--kv-cache-memory-bytes", str(32 << 20)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text, num_tokens = _in_process(path, ignore_eos=False)
    assert text and num_tokens > 1 and re.search(rf"^{num_tokens} tokens in ", proc.stdout, re.M), proc.stdout
    assert f"Output: {text!r}" in proc.stdout, proc.stdout


@pytest.mark.parametrize("family", ["kimi_linear", "recurrent_gemma"])
def test_server_with_the_openai_client(folders, family):
    import openai

    path = folders[family]
    expected, num_tokens = _in_process(path)
    assert num_tokens == MAX_TOKENS and expected
    proc, url, lines = start_server(path, "--kv-cache-memory-bytes", str(32 << 20), "--block-size", "4")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        got = client.completions.create(model=path, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert got.choices[0].text == expected
        assert got.usage.completion_tokens == MAX_TOKENS
        streamed = client.completions.create(model=path, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
        assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == expected
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_recurrent_gemma_takes_sequences_past_2048_tokens(folders):
    """RecurrentGemma positions any length (no max_position_embeddings; its KV cache keeps only the window): the
    default max_model_len is the recurrent models' and a longer one is accepted, where a model with a limit is held
    to it."""
    from stateserve.models import folder as model_folder

    path = folders["recurrent_gemma"]
    kw = dict(skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)
    with LLM(path, **kw) as llm:
        assert llm.llm_engine.model_config.max_model_len == model_folder._DEFAULT_RECURRENT_MAX_LEN
    with LLM(path, max_model_len=3000, max_num_batched_tokens=1024, **kw) as llm:
        out = llm.generate([{"prompt_token_ids": [(7 * i) % 290 + 5 for i in range(2600)]}],
                           SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings=256"):
        LLM(folders["qwen3_5"], max_model_len=3000, **kw)
