"""Pydantic models of the OpenAI API subset the server speaks (field names and defaults as OpenAI's).

Requests forbid unknown fields, as OpenAI does ("Unrecognized request argument supplied"). Fields OpenAI
accepts but this engine cannot honour are declared so they can be rejected with a clear 400 when set
(see `unsupported_fields`); vLLM's sampling extras (top_k, min_p, ignore_eos, ...) are accepted too."""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator


def _List(item: Any) -> Any:
    """list[item] that stops at its first bad item: a hostile list of a million bad items costs one error, not a
    million (pydantic otherwise collects them all, seconds of the event loop)."""
    return Annotated[list[item], Field(fail_fast=True)]


class _Strict(BaseModel):
    # No NaN/Infinity in any float (the server's JSON parser refuses those literals already), no coercion of
    # booleans, strings or floats into numbers in the fields declared Strict*.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


# ---- errors ------------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- models ------------------------------------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "stateserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- shared request parts ----------------------------------------------------------------------
def _kind(value: Any) -> str:
    return {str: "a string", bool: "a boolean", int: "an int", float: "a number", list: "a list", dict: "an object",
            type(None): "null"}.get(type(value), type(value).__name__)


def check_text_or_ids(value: Any, name: str, allow_empty_string: bool) -> Any:
    """The whole validation of a prompt-like field (a "plain" validator: pydantic adds none of its own): a string,
    a list of strings, a list of token ids or a list of token-id lists, checked by hand so a bad one
    gets one message that names the bad item (pydantic's union errors list every member); strict: `true`, `1.0`
    or `"5"` are not token ids. Lists and token-id lists must not be empty."""
    def is_id(x: Any) -> bool:
        return type(x) is int  # not bool

    if isinstance(value, str):
        if not value and not allow_empty_string:
            raise ValueError(f"{name} must not be an empty string")
        return value
    if not isinstance(value, list):
        raise ValueError(f"{name} must be a string, a list of strings, a list of token ids or a list of "
                         f"token-id lists, got {_kind(value)}")
    if not value:
        raise ValueError(f"{name} must not be an empty list")
    first = value[0]
    shape = int if is_id(first) else str if isinstance(first, str) else list if isinstance(first, list) else None
    if shape is int and set(map(type, value)) == {int}:  # the common case of a long id list, without a Python loop
        return value
    for i, item in enumerate(value):
        if shape is int and is_id(item):
            continue
        if shape in (None, int) or not isinstance(item, shape):
            raise ValueError(f"a list {name} holds only strings, only token ids (ints) or only lists of token "
                             f"ids; {name}[{i}] is {_kind(item)}")
        if not item and not (shape is str and allow_empty_string):
            raise ValueError(f"{name}[{i}] must not be empty")
        if shape is list and set(map(type, item)) != {int}:
            bad = next(t for t in item if not is_id(t))
            raise ValueError(f"{name}[{i}] holds {_kind(bad)}, not a token id (an int)")
    return value


class StreamOptions(_Strict):
    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False  # vLLM's name; accepted, usage is sent at the end only


class _SamplingFields(_Strict):
    """What completions and chat share; names and defaults as OpenAI's, extras as vLLM's. Numbers, booleans and
    strings are strict (no `true` for 1, no `"1"` for 1, no 1.0 for an integer; an integer is a valid float), and
    `null` in any of these fields means its default. Ranges are SamplingParams' (docs/server.md)."""

    model: StrictStr | None = None
    n: StrictInt | None = None  # null: 1
    temperature: StrictFloat | None = None  # null: 1.0
    top_p: StrictFloat | None = None  # null: 1.0
    seed: StrictInt | None = None
    stop: StrictStr | _List(StrictStr) | None = None
    presence_penalty: StrictFloat | None = None  # null: 0.0
    frequency_penalty: StrictFloat | None = None  # null: 0.0
    stream: StrictBool | None = None  # null: false
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    logit_bias: dict[str, StrictFloat] | None = None  # token id (as a string, OpenAI's form) -> bias in [-100, 100]
    # vLLM extras
    top_k: StrictInt | None = None  # null: 0 (off)
    min_p: StrictFloat | None = None  # null: 0.0
    repetition_penalty: StrictFloat | None = None  # null: 1.0
    min_tokens: StrictInt | None = None  # null: 0
    ignore_eos: StrictBool | None = None  # null: false
    stop_token_ids: _List(StrictInt) | None = None
    skip_special_tokens: StrictBool | None = None  # null: true
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* names
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: _List(StrictStr) | None = None
    guided_grammar: StrictStr | None = None
    include_stop_str_in_output: StrictBool | None = None  # null: false
    truncate_prompt_tokens: StrictInt | None = None  # keep the prompt's last k tokens (-1: as many as fit)
    add_special_tokens: StrictBool | None = None  # null: true for completions, false for chat (the template has them)

    def unsupported_fields(self) -> list[str]:
        """Declared-but-unsupported fields that the client actually set to something non-trivial."""
        return []

    def structured_outputs_params(self) -> dict[str, Any] | None:
        """The one constraint the request sets, as SamplingParams.structured_outputs; ValueError for several, or for a
        response_format this server does not know."""
        found = {}
        fmt = self.response_format or {}
        kind = fmt.get("type", "text")
        if kind == "json_object":
            found["response_format"] = {"json_object": True}
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ValueError("response_format.json_schema.schema must be a JSON schema object")
            found["response_format"] = {"json": spec["schema"]}
        elif kind != "text":
            raise ValueError(f"response_format.type must be text, json_object or json_schema, got {kind!r}")
        if self.structured_outputs:
            found["structured_outputs"] = dict(self.structured_outputs)
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                found[name] = {key: getattr(self, name)}
        if len(found) > 1:
            raise ValueError(f"set one structured output at most, got {', '.join(found)}")
        return next(iter(found.values()), None)


# ---- completions -------------------------------------------------------------------------------
class CompletionRequest(_SamplingFields):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16  # an explicit null: as many as fit in the context (as vLLM)
    logprobs: StrictInt | None = None
    echo: StrictBool | None = None  # null: false
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    @field_validator("prompt", mode="plain")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        return check_text_or_ids(value, "prompt", allow_empty_string=True)

    def unsupported_fields(self) -> list[str]:
        bad = super().unsupported_fields()
        if self.suffix:
            bad.append("suffix")
        return bad


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ---- chat --------------------------------------------------------------------------------------
class ChatMessage(_Open):
    """system / developer / user / assistant / tool; `tool_calls` and `tool_call_id` (extra fields) are checked by
    entrypoints.serving_tools. `content` is
    a string or a list of content parts, objects with a string `type` (only "text" is served) and `text`."""

    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None
    name: StrictStr | None = None

    @field_validator("content", mode="plain")
    @classmethod
    def _check_content(cls, value: Any) -> Any:
        """By hand (a "plain" validator), so a long list of parts costs no model per part."""
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError(f"content must be a string or a list of content parts, got {_kind(value)}")
        for i, part in enumerate(value):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise ValueError(f"content[{i}] must be an object with a string `type`")
            if not isinstance(part.get("text", ""), (str, type(None))):
                raise ValueError(f"content[{i}].text must be a string, got {_kind(part['text'])}")
        return value


class ChatCompletionRequest(_SamplingFields):
    messages: _List(ChatMessage)
    max_tokens: StrictInt | None = None  # null (the default): as many as fit in the context
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None  # null: false
    top_logprobs: StrictInt | None = None
    # OpenAI fields that do not change sampling here
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # tool calling (entrypoints.serving_tools checks them)
    tools: _List(dict[str, Any]) | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None  # null: "auto" with tools, else "none"
    parallel_tool_calls: StrictBool | None = None  # null: true
    # OpenAI fields this engine cannot honour: a 400 when set
    functions: _List(dict[str, Any]) | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: _List(StrictStr) | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    # vLLM extras for the template
    add_generation_prompt: StrictBool | None = None  # null: true
    continue_final_message: StrictBool | None = None  # null: false; the last (assistant) message is continued
    chat_template_kwargs: dict[str, Any] | None = None

    def unsupported_fields(self) -> list[str]:
        bad = super().unsupported_fields()
        if self.functions:
            bad.append("functions")
        if self.function_call not in (None, "none", "auto"):
            bad.append("function_call")
        if self.modalities and self.modalities != ["text"]:
            bad.append("modalities")
        if self.audio:
            bad.append("audio")
        if self.prediction:
            bad.append("prediction")
        if self.reasoning_effort:
            bad.append("reasoning_effort")
        return bad


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object's text


class ToolCallItem(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallItem] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# ---- embeddings --------------------------------------------------------------------------------
class EmbeddingRequest(_Strict):
    """`input` is checked by hand, so a bad one gets one message that names the bad item (pydantic's union
    errors list every member); its types are strict: `true`, `1.0` or `"5"` are not token ids."""

    model: str | None = None
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: str | None = None
    # vLLM extra: keep only each input's last k tokens (-1: the encoder's limit) instead of refusing longer ones
    truncate_prompt_tokens: StrictInt | None = None

    @field_validator("input", mode="plain")
    @classmethod
    def _check_input(cls, value: Any) -> Any:
        return check_text_or_ids(value, "input", allow_empty_string=False)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
