"""Tool-call parsers (issue 35) on replies in each family's format: whole replies, every split of a reply into
stream deltas (the streamed calls and content must equal the whole reply's), cut-off replies and non-calls."""
from __future__ import annotations

import json

import pytest

from stateserve.entrypoints.serving_tools import ToolDeltas, ToolPlan, tool_reply
from stateserve.entrypoints.tool_parsers import (GraniteParser, HermesParser, JsonArrayParser, Llama3JsonParser,
                                                 ToolCallStream, get_tool_parser)

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
TIME = {"name": "get_time", "arguments": {"zone": "UTC+1"}}

REPLIES = {  # parser -> [(reply, expected content, expected calls as (name, arguments))]
    "hermes": [
        ("Let me check.\n<tool_call>\n" + json.dumps(WEATHER) + "\n</tool_call>\n<tool_call>\n" + json.dumps(TIME)
         + "\n</tool_call>", "Let me check.\n", [WEATHER, TIME]),
        ("<tool_call>\n" + json.dumps(WEATHER) + "\n</tool_call>", None, [WEATHER]),
        ("<tool_call>" + json.dumps(WEATHER), None, [WEATHER]),  # the model stopped before closing the block
        ("The answer is 4 < 5, no <tool_ call here.", "The answer is 4 < 5, no <tool_ call here.", []),
        ("<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
        ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', None, [{"name": "f", "arguments": {"x": 1}}]),
    ],
    "llama3_json": [
        (json.dumps({"name": "get_weather", "parameters": WEATHER["arguments"]}), None, [WEATHER]),
        ("<|python_tag|>" + json.dumps({"name": "get_weather", "parameters": WEATHER["arguments"]}) + "; "
         + json.dumps({"name": "get_time", "parameters": TIME["arguments"]}), None, [WEATHER, TIME]),
        ('  {"answer": 42}', '  {"answer": 42}', []),  # JSON that is not a call stays content
        ("Paris is sunny {today}.", "Paris is sunny {today}.", []),
    ],
    "granite": [
        ("<|tool_call|>" + json.dumps([WEATHER, TIME]), None, [WEATHER, TIME]),
        ("<tool_call>" + json.dumps([WEATHER]), None, [WEATHER]),
        (json.dumps([WEATHER]), None, [WEATHER]),
        ("I cannot call tools.", "I cannot call tools.", []),
    ],
}
CASES = [(name, *case) for name, cases in REPLIES.items() for case in cases]


def _as_dicts(calls) -> list[dict]:
    return [{"name": c.name, "arguments": json.loads(c.arguments)} for c in calls]


@pytest.mark.parametrize("parser_name,reply,content,calls", CASES)
def test_whole_reply(parser_name, reply, content, calls):
    got_content, got_calls = get_tool_parser(parser_name).parse(reply)
    assert got_content == content
    assert _as_dicts(got_calls) == calls


@pytest.mark.parametrize("parser_name,reply,content,calls", CASES)
def test_every_split_streams_what_the_whole_reply_parses_to(parser_name, reply, content, calls):
    """Two deltas split at every position, and one character per delta: the same content and calls, each call
    sent once, and content never includes the start of a call's marker."""
    splits = [[reply[:k], reply[k:]] for k in range(len(reply) + 1)] + [list(reply)]
    for deltas in splits:
        stream = ToolCallStream(get_tool_parser(parser_name))
        text, got = "", []
        for i, delta in enumerate(deltas):
            out, new = stream.feed(delta, finished=i == len(deltas) - 1)
            text += out
            got += new
        assert _as_dicts(got) == calls, deltas
        assert text == ((content or "") if calls else reply), deltas


def test_content_is_held_back_only_while_it_may_be_a_marker():
    stream = ToolCallStream(HermesParser())
    assert stream.feed("Hello <tool", False) == ("Hello ", [])  # "<tool" may become <tool_call>
    assert stream.feed("box> done", False) == ("<toolbox> done", [])
    stream = ToolCallStream(Llama3JsonParser())
    assert stream.feed("  ", False) == ("", [])  # a reply that starts with whitespace may still be a call
    assert stream.feed("Sure", False) == ("  Sure", [])


def test_json_array_parser_reads_required_replies():
    reply = json.dumps([{"name": "get_weather", "parameters": WEATHER["arguments"]}])
    assert _as_dicts(JsonArrayParser().parse(reply)[1]) == [WEATHER]
    cut = reply[:-1] + ', {"name": "get_ti'  # cut off by max_tokens inside the second call: the first still counts
    assert _as_dicts(JsonArrayParser().parse(cut)[1]) == [WEATHER]


def test_tool_reply_and_deltas_by_mode():
    auto = ToolPlan("auto", [], parser=HermesParser())
    reply = "<tool_call>" + json.dumps(WEATHER) + "</tool_call><tool_call>" + json.dumps(TIME) + "</tool_call>"
    content, items, finish = tool_reply(auto, reply, "stop")
    assert content is None and [i.function.name for i in items] == ["get_weather", "get_time"]
    assert finish == "tool_calls"
    assert tool_reply(auto, reply, "length")[2] == "length"
    one = ToolPlan("auto", [], parser=HermesParser(), parallel=False)
    assert [i.function.name for i in tool_reply(one, reply, "stop")[1]] == ["get_weather"]
    deltas = ToolDeltas(one)
    _, calls, finish = deltas.feed(reply, "stop")
    assert [c.function.name for c in calls] == ["get_weather"] and calls[0].index == 0 and finish == "tool_calls"
    assert tool_reply(auto, "plain text", "stop") == ("plain text", None, "stop")

    named = ToolPlan("named", [], {"json": {}}, function="get_weather")
    content, items, finish = tool_reply(named, '{"city": "Oslo"}', "stop")
    assert content is None and items[0].function.name == "get_weather"
    assert items[0].function.arguments == '{"city": "Oslo"}' and finish == "stop"
    deltas = ToolDeltas(named)
    first = deltas.feed('{"ci', None)[1][0]
    second = deltas.feed('ty": "Oslo"}', "stop")[1][0]
    assert (first.index, first.function.name, first.type) == (0, "get_weather", "function") and first.id
    assert second.id is None and second.function.name is None
    assert first.function.arguments + second.function.arguments == '{"city": "Oslo"}'


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="granite, hermes, llama3_json"):
        get_tool_parser("mistral")


def test_granite_and_llama_markers():
    assert GraniteParser().region_start("  <|tool_call|>[") == 2
    assert Llama3JsonParser().region_start("Sure {") is None
