"""Tool calling through a real server and the `openai` client (issue 35): tools rendered by the chat template
(history with earlier calls and tool results included), tool_choice none / auto / required / a named function,
parallel_tool_calls, calls streamed as deltas equal to the whole reply's, the three parsers (hermes,
llama3_json, granite) on replies the model writes, and the errors. The demo model is random, so "auto" replies
are steered with a `choice` constraint into the family's format: the parser then reads what the model wrote."""
from __future__ import annotations

import json
import os

import httpx2
import jsonschema
import openai
import pytest

from utils import demo_model, start_server

TEMPLATES = os.path.join(os.path.dirname(__file__), "chat_templates")
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast for a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
HISTORY = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
# what each family's model writes for a call (the parser under test reads it back)
REPLIES = {
    "hermes": 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}; '
                   '{"name": "get_time", "parameters": {"zone": "CET"}}',
    "granite": '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}, '
               '{"name": "get_time", "arguments": {"zone": "CET"}}]',
}
EXPECTED = [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"zone": "CET"})]
_servers: dict[str, tuple] = {}


@pytest.fixture(scope="module")
def servers():
    """One server per parser, started when a test first needs it."""
    def get(parser: str) -> tuple[openai.OpenAI, str, str]:
        if parser not in _servers:
            model = demo_model("llama-demo")
            extra = ("--enable-auto-tool-choice",) if parser == "hermes" else ()
            proc, url, _ = start_server(model, "--served-model-name", "demo", "--tool-call-parser", parser,
                                        "--chat-template", os.path.join(TEMPLATES, f"{parser}.jinja"), *extra)
            _servers[parser] = (proc, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                                    timeout=120), url)
        return _servers[parser][1], "demo", _servers[parser][2]
    yield get
    for proc, _, _ in _servers.values():
        proc.terminate()
        proc.wait(timeout=60)
    _servers.clear()


def _chat(client, messages=ASK, **kw):
    extra = kw.pop("extra_body", None)
    return client.chat.completions.create(model="demo", messages=messages, temperature=0, extra_body=extra, **kw)


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _streamed(client, **kw) -> tuple[str, list[tuple[str, dict]], str, list]:
    """content, calls (deltas joined by index as OpenAI's clients join them), finish_reason, the call deltas."""
    content, calls, finish, deltas = "", {}, None, []
    for chunk in _chat(client, stream=True, **kw):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            deltas.append(d)
            slot = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
            slot["name"] += d.function.name or ""
            slot["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    ids = [c["id"] for c in calls.values()]
    assert all(ids) and len(set(ids)) == len(ids)
    return content, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], finish, deltas


def test_tools_and_history_are_rendered_by_the_template(servers):
    _, _, url = servers("hermes")
    body = {"model": "demo", "messages": HISTORY + [{"role": "user", "content": "And Oslo?"}], "tools": TOOLS}
    ids = httpx2.post(url + "/tokenize", json=body, timeout=60).json()["tokens"]
    text = httpx2.post(url + "/detokenize", json={"model": "demo", "tokens": ids}, timeout=60).json()["prompt"]
    assert json.dumps(TOOLS[0]) in text  # the tool definitions, as the template writes them
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    plain = httpx2.post(url + "/tokenize", json={**body, "tools": None}, timeout=60).json()["tokens"]
    assert len(plain) < len(ids)
    client, _, _ = servers("hermes")
    reply = _chat(client, HISTORY, tools=TOOLS, max_tokens=8)  # a history with calls and results is served
    assert reply.usage.prompt_tokens > len(plain)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_always_returns_valid_calls(servers, parallel):
    client, _, _ = servers("hermes")
    reply = _chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel, max_tokens=160)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = _calls(choice.message)
    assert calls and (parallel or len(calls) == 1)
    for name, args in calls:
        jsonschema.validate(args, SCHEMAS[name])
    content, streamed, finish, _ = _streamed(client, tools=TOOLS, tool_choice="required",
                                             parallel_tool_calls=parallel, max_tokens=160)
    assert (streamed, finish, content) == (calls, "tool_calls", "")


def test_named_function(servers):
    client, _, _ = servers("hermes")
    for name in ("get_weather", "get_time"):
        choice = {"type": "function", "function": {"name": name}}
        reply = _chat(client, tools=TOOLS, tool_choice=choice, max_tokens=60).choices[0]
        calls = _calls(reply.message)
        assert [c[0] for c in calls] == [name] and reply.message.content is None
        jsonschema.validate(calls[0][1], SCHEMAS[name])
        content, streamed, finish, deltas = _streamed(client, tools=TOOLS, tool_choice=choice, max_tokens=60)
        assert streamed == calls and finish == reply.finish_reason == "stop" and content == ""
        assert len(deltas) > 1  # the arguments stream as they are written


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "granite"])
def test_auto_reads_the_models_calls(servers, parser):
    client, _, _ = servers(parser)
    steer = {"structured_outputs": {"choice": [REPLIES[parser]]}}
    reply = _chat(client, tools=TOOLS, max_tokens=120, extra_body=steer).choices[0]
    assert _calls(reply.message) == EXPECTED and reply.finish_reason == "tool_calls"
    assert reply.message.content == ("Checking.\n" if parser == "hermes" else None)
    content, streamed, finish, _ = _streamed(client, tools=TOOLS, tool_choice="auto", max_tokens=120,
                                             extra_body=steer)
    assert streamed == EXPECTED and finish == "tool_calls" and content == (reply.message.content or "")
    one = _chat(client, tools=TOOLS, parallel_tool_calls=False, max_tokens=120, extra_body=steer).choices[0]
    assert _calls(one.message) == EXPECTED[:1]
    assert _streamed(client, tools=TOOLS, parallel_tool_calls=False, max_tokens=120, extra_body=steer)[1] == \
        EXPECTED[:1]


def test_auto_without_a_call_and_none(servers):
    client, _, _ = servers("hermes")
    free = _chat(client, tools=TOOLS, max_tokens=12).choices[0]
    assert free.message.tool_calls is None and free.message.content and free.finish_reason in ("stop", "length")
    steer = {"structured_outputs": {"choice": [REPLIES["hermes"]]}}
    none = _chat(client, tools=TOOLS, tool_choice="none", max_tokens=120, extra_body=steer).choices[0]
    assert none.message.tool_calls is None and none.message.content == REPLIES["hermes"]
    assert none.finish_reason == "stop"


def test_tool_errors(servers):
    client, _, url = servers("hermes")
    named = {"type": "function", "function": {"name": "nope"}}
    bad = [
        ({"tools": TOOLS, "tool_choice": named}, "tool_choice", "not among the tools"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name", "letters"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0", "must be"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools.2.function.name", "two tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
         "cannot be combined"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
          "tool_choice": "required"}, "tools", "structured_outputs"),
        ({"messages": ASK + [{"role": "tool", "content": "x"}]}, "messages.1.tool_call_id", "tool_call_id"),
        ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "f", "arguments": "{oops"}}]}]}, "messages.1.tool_calls.0.function.arguments", "valid JSON"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "f", "arguments": "{}"}}]}]}, "messages.0.tool_calls", "only assistant"),
    ]
    for body, param, message in bad:
        r = httpx2.post(url + "/v1/chat/completions", json={"model": "demo", "messages": ASK, "max_tokens": 4,
                                                             **body}, timeout=60)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and message in err["message"], (body, err)
    assert _chat(client, max_tokens=4).choices[0].message.content is not None  # the server serves on
