"""Tool-call parsers: a model's reply text -> (content, tool calls), one parser per chat-template family.

Every format here is "some content, then a tool-call region to the end of the reply". A parser says where its
region starts (`region_start`), how much of a reply's tail might still turn into the region's marker
(`undecided_tail`, held back when streaming), and which calls a region holds (`calls_in`): with `final=False`
only the calls already complete, with `final=True` (the reply has ended) also a last call cut short of its
closing marker. The complete calls of a prefix are always a prefix of the calls of the whole reply, so streaming
a reply call by call and parsing it at once give the same calls (ToolCallStream relies on it).

Formats (what the families' chat templates teach the model to write):
- hermes (Hermes 2 Pro, Qwen 2.5 / 3 / 3.5): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block per call.
- llama3_json (Llama 3.1 / 3.2 / 3.3): the reply is `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`, several separated by `;`.
- granite (Granite 3.x / 4): `<|tool_call|>` or `<tool_call>`, then a JSON list of {"name", "arguments"}.
- json_array: the reply is a JSON list of {"name", "parameters"}; what tool_choice "required" makes the model
  write (under a grammar), whatever its family.
"""
from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("stateserve.server")
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def _call_from(obj: Any, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """{"name": str, <argument key>: object} -> a call; anything else -> None (not a call)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in argument_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _prefix_tail(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a marker (it may yet become one)."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if marker.startswith(text[-k:]):
                best = k
                break
    return best


def _json_values(text: str, separators: str) -> tuple[list[Any], bool]:
    """The complete JSON values of `text`, separated by whitespace and `separators`; and whether all of `text`
    was consumed (False: something after the last complete value did not parse, perhaps not yet)."""
    values, pos = [], 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos == len(text):
            return values, True
        try:
            value, pos = _DECODER.raw_decode(text, pos)
        except ValueError:
            return values, False
        values.append(value)


def _calls(values: list[Any], argument_keys: tuple[str, ...], parser: str, warn: bool) -> list[ToolCall]:
    """The values that are calls; the others are dropped with a warning (a reply of JSON that holds no call at all
    is then content: `parse`)."""
    calls = []
    for value in values:
        call = _call_from(value, argument_keys)
        if call is None and warn:
            logger.warning("%s tool parser: a JSON value is not a call and was dropped: %.200r", parser, value)
        elif call is not None:
            calls.append(call)
    return calls


class ToolParser:
    """Base: subclasses give `region_start`, `undecided_tail` and `calls_in`."""

    name = ""

    def region_start(self, text: str) -> int | None:
        raise NotImplementedError

    def undecided_tail(self, text: str) -> int:
        raise NotImplementedError

    def calls_in(self, region: str, final: bool) -> list[ToolCall]:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole reply -> (content or None, calls). A region that holds no valid call is content after all."""
        start = self.region_start(text)
        calls = self.calls_in(text[start:], final=True) if start is not None else []
        if not calls:
            return text, []
        content = text[:start]
        return (content if content.strip() else None), calls


class _LeadingRegionParser(ToolParser):
    """Formats whose region, if any, starts the reply (after whitespace) with one of `markers`."""

    markers: tuple[str, ...] = ()

    def region_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped and any(stripped.startswith(m) for m in self.markers):
            return len(text) - len(stripped)
        return None

    def undecided_tail(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or any(m.startswith(stripped) for m in self.markers):
            return len(text)  # only whitespace, or a marker's beginning: nothing can be shown yet
        return 0


class HermesParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def region_start(self, text: str) -> int | None:
        start = text.find(self.OPEN)
        return None if start < 0 else start

    def undecided_tail(self, text: str) -> int:
        return _prefix_tail(text, (self.OPEN,))

    def calls_in(self, region: str, final: bool) -> list[ToolCall]:
        bodies, end = [], 0
        for match in self._BLOCK.finditer(region):
            bodies.append(match.group(1))
            end = match.end()
        if final:  # a last block the reply ended inside (max_tokens, or the model stopped without closing it)
            tail = region[end:]
            if tail.lstrip().startswith(self.OPEN):
                bodies.append(tail.lstrip()[len(self.OPEN):])
        values = []
        for body in bodies:
            try:
                values.append(json.loads(body))
            except ValueError:
                values.append(body)  # not JSON: dropped by _calls, as any value that is not a call
        return _calls(values, ("arguments", "parameters"), self.name, warn=final)


class Llama3JsonParser(_LeadingRegionParser):
    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"
    markers = (PYTHON_TAG, "{")

    def calls_in(self, region: str, final: bool) -> list[ToolCall]:
        values, _ = _json_values(region.lstrip().removeprefix(self.PYTHON_TAG), ";")
        return _calls(values, ("parameters", "arguments"), self.name, warn=final)


class _JsonListParser(_LeadingRegionParser):
    """A JSON list of calls after an optional marker; its items count as they complete."""

    argument_keys: tuple[str, ...] = ("arguments", "parameters")

    def calls_in(self, region: str, final: bool) -> list[ToolCall]:
        body = region.lstrip()
        for marker in self.markers:
            if marker != "[" and body.startswith(marker):
                body = body[len(marker):].lstrip()
                break
        if not body.startswith("["):
            return []
        items, _ = _json_values(body[1:], ",]")
        return _calls(items, self.argument_keys, self.name, warn=final)


class GraniteParser(_JsonListParser):
    name = "granite"
    markers = ("<|tool_call|>", "<tool_call>", "[")


class JsonArrayParser(_JsonListParser):
    name = "json_array"
    markers = ("[",)
    argument_keys = ("parameters", "arguments")


TOOL_CALL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesParser, Llama3JsonParser, GraniteParser)}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {', '.join(sorted(TOOL_CALL_PARSERS))}")
    return TOOL_CALL_PARSERS[name]()


class ToolCallStream:
    """One streamed choice: text deltas in, (content delta, newly complete calls) out. Content is held back while
    it may still be the start of a tool-call region; once the region starts, nothing more is content unless the
    reply ends without a valid call in it (then the held text is sent as content, as `parse` returns it)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.content_sent = 0  # characters of `text` sent as content
        self.region: int | None = None
        self.calls: list[ToolCall] = []

    def feed(self, delta: str, finished: bool) -> tuple[str, list[ToolCall]]:
        self.text += delta
        if self.region is None:
            self.region = self.parser.region_start(self.text)
        if self.region is None:
            safe = len(self.text) if finished else len(self.text) - self.parser.undecided_tail(self.text)
            return self._content_to(safe), []
        content = self._content_to(self.region)
        calls = self.parser.calls_in(self.text[self.region:], final=finished)
        new = calls[len(self.calls):]
        self.calls = calls if len(calls) >= len(self.calls) else self.calls
        if finished and not self.calls:  # the region held no call: it was content after all
            content += self._content_to(len(self.text))
        return content, new

    def _content_to(self, end: int) -> str:
        if end <= self.content_sent:
            return ""
        out, self.content_sent = self.text[self.content_sent:end], end
        return out
