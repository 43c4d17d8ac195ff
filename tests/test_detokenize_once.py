"""The text of an output is decoded once, incrementally, by the engine: stop strings are looked for in the text
each token adds (not in a re-decode of the whole output every token), and a streamed response's deltas come
from the engine, so the server decodes nothing while a request runs."""
from __future__ import annotations

import threading
import time

import openai
import pytest
import uvicorn
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from stateserve import LLM, SamplingParams
from stateserve.config import EngineConfig
from stateserve.engine.llm_engine import LLMEngine
from stateserve.entrypoints.async_engine import AsyncEngine
from stateserve.entrypoints.server import GracefulServer, bind_socket, build_app
from utils import build_hf_model, save_model

CFG = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0, eos_token_id=1)
NUM_TOKENS = 60
WINDOW = 16  # the incremental decoder's window: a few tokens, more only while bytes of one character trail


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, tokenizer_dir):
    hf = build_hf_model(LlamaConfig, LlamaForCausalLM, **CFG)
    return save_model(hf, str(tmp_path_factory.mktemp("llama_detok")), tokenizer_dir)


class CountingDecode:
    """Wraps a tokenizer's decode and records how many ids each call decodes."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.inner, self.lengths = tokenizer, tokenizer.decode, []
        tokenizer.decode = self

    def __call__(self, ids, *args, **kwargs):
        self.lengths.append(len(ids))
        return self.inner(ids, *args, **kwargs)


def test_stop_strings_are_checked_on_the_new_text_only(model_path):
    prompts = [{"prompt_token_ids": [5 + i, 17, 42 + i]} for i in range(3)]
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, stop=["\x00never"])
    with LLM(model_path) as llm:
        counter = CountingDecode(llm.get_tokenizer())
        outs = llm.generate(prompts, params, use_tqdm=False)
        counter.tokenizer.decode = counter.inner
        tok = AutoTokenizer.from_pretrained(model_path)
        for out in outs:
            seq = out.outputs[0]
            assert len(seq.token_ids) == NUM_TOKENS and seq.finish_reason == "length"
            assert seq.text == tok.decode(seq.token_ids, skip_special_tokens=True)
        # whole-output decodes: one per request when it ends (its final text); every other call decodes a window
        whole = [n for n in counter.lengths if n > WINDOW]
        assert len(whole) == len(prompts), sorted(counter.lengths)[-8:]

        # a stop string inside the output: cut where a whole-output decode finds it
        ref = outs[0].outputs[0]
        stop = ref.text[len(ref.text) // 2:len(ref.text) // 2 + 2]
        cut = llm.generate(prompts[0], SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True,
                                                      stop=[stop]), use_tqdm=False)[0].outputs[0]
        assert cut.finish_reason == "stop" and cut.stop_reason == stop
        assert cut.text == ref.text[:ref.text.index(stop)]


@pytest.fixture(scope="module")
def server(model_path):
    engine = AsyncEngine(LLMEngine(EngineConfig.from_kwargs(model=model_path), show_progress=False))
    server_tokenizer = AutoTokenizer.from_pretrained(model_path)
    app = build_app(engine, server_tokenizer, ["tiny"])
    sock = bind_socket("127.0.0.1", 0)
    srv = GracefulServer(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5), app, grace_s=1.0)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key="none", max_retries=0,
                           timeout=60)
    yield client, server_tokenizer
    srv.should_exit = True
    thread.join(30)
    sock.close()


@pytest.mark.parametrize("stop", [None, ["\x00never"]], ids=["no-stop", "stop"])
def test_streamed_text_comes_from_the_engine(server, stop):
    client, server_tokenizer = server
    kwargs = dict(model="tiny", prompt="Attention reads every", max_tokens=24, temperature=0, stop=stop,
                  extra_body={"ignore_eos": True})
    plain = client.completions.create(**kwargs).choices[0].text
    counter = CountingDecode(server_tokenizer)
    try:
        chunks = list(client.completions.create(stream=True, **kwargs))
    finally:
        server_tokenizer.decode = counter.inner
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == plain and len([c for c in chunks if c.choices]) == 24
    assert counter.lengths == []  # the server decoded nothing: every delta came from the engine
