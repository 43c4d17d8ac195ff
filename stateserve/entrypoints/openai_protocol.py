"""Pydantic models of the OpenAI API subset the server speaks (field names and defaults as OpenAI's).

Requests forbid unknown fields, as OpenAI does ("Unrecognized request argument supplied"). Fields OpenAI
accepts but this engine cannot honour are declared so they can be rejected with a clear 400 when set
(see `unsupported_fields`); vLLM's sampling extras (top_k, min_p, ignore_eos, ...) are accepted too."""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


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
class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's name; accepted, usage is sent at the end only


class _SamplingFields(_Strict):
    """What completions and chat share; names and defaults as OpenAI's, extras as vLLM's."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True

    def unsupported_fields(self) -> list[str]:
        """Declared-but-unsupported fields that the client actually set to something non-trivial."""
        bad = ["logit_bias"] if self.logit_bias else []
        return bad


# ---- completions -------------------------------------------------------------------------------
class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported_fields(self) -> list[str]:
        bad = super().unsupported_fields()
        if self.suffix:
            bad.append("suffix")
        if self.best_of is not None and self.best_of != self.n:
            bad.append("best_of")
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
class ContentPart(_Open):
    type: str
    text: str | None = None


class ChatMessage(_Open):
    """system / developer / user / assistant; tool messages and function calls are rejected later."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    # OpenAI fields that do not change sampling here
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # OpenAI fields this engine cannot honour: a 400 when set
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    # vLLM extras for the template
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def unsupported_fields(self) -> list[str]:
        bad = super().unsupported_fields()
        if self.tools:
            bad.append("tools")
        if self.tool_choice not in (None, "none", "auto"):
            bad.append("tool_choice")
        if self.functions:
            bad.append("functions")
        if self.function_call not in (None, "none", "auto"):
            bad.append("function_call")
        if self.response_format and self.response_format.get("type", "text") != "text":
            bad.append("response_format")
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


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


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
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
