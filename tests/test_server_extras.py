"""Past OpenAI's basic set, through a real server and the `openai` client or httpx (issue 35): logit_bias,
include_stop_str_in_output, truncate_prompt_tokens, add_special_tokens, continue_final_message and stop strings
before min_tokens; /tokenize, /detokenize, /tokenizer_info, /version and GET /v1/models/{id}. Each with its
success and its error."""
from __future__ import annotations

import openai
import pytest

from utils import demo_model, start_server

PROMPT = "The with statement is used to"


@pytest.fixture(scope="module")
def server():
    model = demo_model("llama-demo")
    proc, url, _ = start_server(model)
    try:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60), model, url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _complete(client, model, prompt=PROMPT, **kw):
    extra = {k: kw.pop(k) for k in list(kw) if k in ("include_stop_str_in_output", "truncate_prompt_tokens",
                                                     "add_special_tokens", "min_tokens")}
    extra.update(kw.pop("extra_body", {}))
    return client.completions.create(model=model, prompt=prompt, temperature=0, extra_body=extra, **kw)


def test_logit_bias(server):
    client, model, _ = server
    forced = _complete(client, model, max_tokens=4, logit_bias={"77": 100})
    tokens = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0,
                                       logit_bias={"77": 100}, logprobs=0).choices[0].logprobs.tokens
    assert len(tokens) == 4 and len(set(tokens)) == 1 and forced.choices[0].text == tokens[0] * 4
    for bias, message in (({"abc": 1}, "logit_bias keys must be token ids"),
                          ({"77": 101}, "logit_bias must map token ids"),
                          ({"999999": 1}, "outside the vocabulary")):
        with pytest.raises(openai.BadRequestError, match=message):
            _complete(client, model, max_tokens=2, logit_bias=bias)


def test_stop_string_options(server):
    client, model, _ = server
    text = _complete(client, model, max_tokens=30).choices[0].text
    stop = text[10:14]
    first = text.find(stop)
    cut = _complete(client, model, max_tokens=30, stop=[stop]).choices[0]
    kept = _complete(client, model, max_tokens=30, stop=[stop], include_stop_str_in_output=True).choices[0]
    assert cut.text == text[:first] and kept.text == text[:first + len(stop)]
    assert kept.finish_reason == "stop"
    early = _complete(client, model, max_tokens=30, stop=[text[:3]], min_tokens=12).choices[0]
    assert len(early.text) > 3  # the stop string's occurrence before min_tokens does not cut the text
    stream = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=30, stop=[stop],
                                       stream=True, extra_body={"include_stop_str_in_output": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == kept.text


def test_truncate_prompt_tokens(server):
    client, model, _ = server
    long_prompt = PROMPT * 6
    out = _complete(client, model, prompt=long_prompt, max_tokens=5, truncate_prompt_tokens=6)
    assert out.usage.prompt_tokens == 6
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens must be -1"):
        _complete(client, model, max_tokens=2, truncate_prompt_tokens=0)


def test_continue_final_message(server):
    client, model, _ = server
    messages = [{"role": "user", "content": "What does the with statement do?"},
                {"role": "assistant", "content": "The with statement"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                          extra_body={"continue_final_message": True,
                                                      "add_generation_prompt": False})
    raw = "<|user|>\nWhat does the with statement do?\n<|assistant|>\nThe with statement"
    assert chat.choices[0].message.content == _complete(client, model, prompt=raw, max_tokens=8).choices[0].text
    with pytest.raises(openai.BadRequestError, match="last message to be the assistant"):
        client.chat.completions.create(model=model, messages=messages[:1], max_tokens=2,
                                       extra_body={"continue_final_message": True})
    with pytest.raises(openai.BadRequestError, match="cannot both be true"):
        client.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": True})


def test_add_special_tokens(tmp_path):
    """A tokenizer that adds a BOS token: completions add it unless add_special_tokens is false; chat (whose
    template writes its own) adds it only when asked."""
    from tokenizers.processors import TemplateProcessing
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from utils import build_hf_model, make_tokenizer, save_model

    folder = str(tmp_path / "bos")
    make_tokenizer(folder)
    tok = PreTrainedTokenizerFast.from_pretrained(folder)
    tok._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)])
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    tok.save_pretrained(folder)
    hf = build_hf_model(LlamaConfig, LlamaForCausalLM, vocab_size=300, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    save_model(hf, folder)
    proc, url, _ = start_server(folder)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        with_bos = _complete(client, folder, prompt="hello world", max_tokens=1).usage.prompt_tokens
        without = _complete(client, folder, prompt="hello world", max_tokens=1,
                            add_special_tokens=False).usage.prompt_tokens
        assert with_bos == without + 1
        msgs = [{"role": "user", "content": "hello world"}]
        chat_plain = client.chat.completions.create(model=folder, messages=msgs, max_tokens=1).usage.prompt_tokens
        chat_bos = client.chat.completions.create(model=folder, messages=msgs, max_tokens=1,
                                                  extra_body={"add_special_tokens": True}).usage.prompt_tokens
        assert chat_bos == chat_plain + 1
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_tokenize_detokenize_and_tokenizer_info(server):
    import httpx2
    from transformers import AutoTokenizer

    client, model, url = server
    tok = AutoTokenizer.from_pretrained(model)
    out = httpx2.post(url + "/tokenize", json={"model": model, "prompt": PROMPT, "return_token_strs": True}).json()
    assert out["tokens"] == tok(PROMPT).input_ids and out["count"] == len(out["tokens"])
    assert out["token_strs"] == tok.convert_ids_to_tokens(out["tokens"]) and out["max_model_len"] > 0
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx2.post(url + "/tokenize", json={"messages": messages}).json()
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tok(rendered, add_special_tokens=False).input_ids and chat["token_strs"] is None
    back = httpx2.post(url + "/detokenize", json={"model": model, "tokens": out["tokens"]}).json()
    assert back == {"prompt": PROMPT}
    info = httpx2.get(url + "/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["vocab_size"] == len(tok) and info["chat_template"]
    for path, body, message in (("/tokenize", {"prompt": 5}, "prompt"),
                                ("/tokenize", {"prompt": "a", "model": "nope"}, "does not exist"),
                                ("/detokenize", {"tokens": [10 ** 7]}, "outside the vocabulary"),
                                ("/detokenize", {"tokens": ["a"]}, "tokens")):
        answer = httpx2.post(url + path, json=body)
        assert answer.status_code in (400, 404) and message in answer.json()["error"]["message"], answer.text


def test_version_and_model_card(server):
    import httpx2

    client, model, url = server
    assert httpx2.get(url + "/version").json()["version"]
    card = client.models.retrieve(model)
    assert card.id == model and card.object == "model"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("no-such-model")


@pytest.mark.parametrize("name", ["llama-demo", "mamba2-demo", "hybrid-demo"])
def test_echo_logprobs_as_lm_evaluation_harness_sends_them(name):
    """lm-evaluation-harness's loglikelihood request (local-completions): echo, logprobs=1, max_tokens 0 or 1,
    temperature 0. The prompt tokens' logprobs (None for the first) equal transformers' log-softmax in float32; with
    max_tokens 0 nothing else is shown, with 1 the generated token follows."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = demo_model(name)
    tok = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    context, continuation = "The with statement is used to", " wrap the execution of a block"
    ids = tok(context + continuation).input_ids
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    proc, url, _ = start_server(model)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        for max_tokens in (0, 1):
            out = client.completions.create(model=model, prompt=context + continuation, echo=True, logprobs=1,
                                            max_tokens=max_tokens, temperature=0)
            choice = out.choices[0]
            lp = choice.logprobs
            assert len(lp.token_logprobs) == len(ids) + max_tokens and lp.token_logprobs[0] is None
            for pos in range(1, len(ids)):
                assert abs(lp.token_logprobs[pos] - ref[pos - 1, ids[pos]].item()) < 1e-4, pos
                assert lp.top_logprobs[pos] is not None
            assert choice.text.startswith(context + continuation)
            assert out.usage.completion_tokens == max_tokens
            if max_tokens == 0:
                assert choice.text == context + continuation and choice.finish_reason == "length"
            else:
                assert lp.tokens[-1] == choice.text[len(context + continuation):]
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            client.completions.create(model=model, prompt=context, max_tokens=0)
        with pytest.raises(openai.BadRequestError, match="not supported when streaming"):
            client.completions.create(model=model, prompt=context, echo=True, logprobs=1, stream=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_openapi_document_405_and_empty_body(server):
    """The OpenAPI document lists 400 (OpenAI's error shape), not FastAPI's 422; /metrics is text; chat needs a
    message. A wrong method gets 405 with `Allow`; an empty body a message that says so."""
    import httpx2

    _, _, url = server
    doc = httpx2.get(url + "/openapi.json").json()
    text = str(doc)
    assert "'422'" not in text and "HTTPValidationError" not in text
    completions = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert completions["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert "error" in doc["components"]["schemas"]["ErrorResponse"]["properties"]
    assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1
    assert "/tokenize" in doc["paths"] and "/v1/models/{model_id}" in doc["paths"]
    wrong = httpx2.get(url + "/v1/completions")
    assert wrong.status_code == 405 and "POST" in wrong.headers["allow"]
    empty = httpx2.post(url + "/v1/completions", content=b"", headers={"content-type": "application/json"})
    assert empty.status_code == 400 and "None" not in empty.json()["error"]["message"], empty.text


def test_best_of(server):
    client, model, _ = server
    base = dict(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3)
    every = client.completions.create(n=5, logprobs=0, **base).choices
    best = client.completions.create(n=2, best_of=5, **base).choices
    ranked = sorted(every, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)[:2]
    assert [c.text for c in best] == [c.text for c in ranked] and [c.index for c in best] == [0, 1]
    assert best[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="best_of must be an integer >= n"):
        client.completions.create(n=3, best_of=2, **base)
    with pytest.raises(openai.BadRequestError, match="not supported when streaming"):
        client.completions.create(n=1, best_of=3, stream=True, **base)


def test_responses_api(server):
    """/v1/responses through the openai client: text input and instructions give the chat completion's reply for
    the same messages, streamed as the client's events too; what needs stored state or tools is a 400."""
    client, model, _ = server
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is a list?"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    expected = chat.choices[0].message.content
    resp = client.responses.create(model=model, instructions="Answer briefly.", input="What is a list?",
                                   max_output_tokens=12, temperature=0)
    assert resp.output_text == expected and resp.status in ("completed", "incomplete")
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    items = client.responses.create(model=model, max_output_tokens=12, temperature=0, input=[
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "input_text", "text": "What is a list?"}]}])
    assert items.output_text == expected
    events = list(client.responses.create(model=model, instructions="Answer briefly.", input="What is a list?",
                                          max_output_tokens=12, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected
    assert events[-1].response.output_text == expected
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=model, input="hi", previous_response_id="resp_123")
    with pytest.raises(openai.BadRequestError, match="input must not be empty"):
        client.responses.create(model=model, input=[])


def test_structured_outputs_through_the_server(server):
    """response_format (json_schema, json_object) on chat, vLLM's structured_outputs and guided_* on completions,
    streamed too: the text parses and validates; a bad schema or two constraints at once are 400s."""
    import json

    import jsonschema

    client, model, _ = server
    schema = {"type": "object", "properties": {"kind": {"enum": ["list", "dict"]},
                                               "size": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["kind", "size"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Describe a container."}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=64, temperature=0,
                                          response_format={"type": "json_schema",
                                                           "json_schema": {"name": "c", "schema": schema,
                                                                           "strict": True}})
    jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=64, temperature=0,
                                            stream=True, response_format={"type": "json_schema", "json_schema": {
                                                "name": "c", "schema": schema}})
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in stream if c.choices)), schema)
    done = _complete(client, model, max_tokens=64, extra_body={"structured_outputs": {"json": schema}})
    jsonschema.validate(json.loads(done.choices[0].text), schema)
    choice = _complete(client, model, max_tokens=8, extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")
    with pytest.raises(openai.BadRequestError, match="structured_outputs"):
        _complete(client, model, max_tokens=8, extra_body={"guided_json": {"type": "bogus"}})
    with pytest.raises(openai.BadRequestError, match="one structured output at most"):
        _complete(client, model, max_tokens=8, extra_body={"guided_regex": "a", "guided_choice": ["b"]})
