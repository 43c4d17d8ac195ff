"""/v1/completions and /v1/chat/completions: request -> SamplingParams + token ids -> engine -> OpenAI JSON/SSE."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from stateserve.entrypoints.async_engine import AsyncEngine
from stateserve.entrypoints.streams import EngineDead, EngineOverloaded, GroupUpdate, RequestStream
from stateserve.entrypoints.detok_stream import (ChoiceState, best_of_choices, chat_logprobs, completion_logprobs,
                                                 echo_logprobs)
from stateserve.entrypoints.metrics import RequestTimer, ServerMetrics
from stateserve.entrypoints.errors import APIError
from stateserve.entrypoints.openai_protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                                    ChatCompletionRequest, ChatCompletionResponse,
                                                    ChatResponseMessage, CompletionChoice, CompletionRequest,
                                                    CompletionResponse, DeltaMessage, PromptTokensDetails, Usage)
from stateserve.entrypoints.prompt_input import Prompts, PromptInput, count_prompts, truncated
from stateserve.entrypoints.serving_tools import ToolDeltas, chat_messages, plan_tools, tool_reply
from stateserve.entrypoints.tool_parsers import get_tool_parser
from stateserve.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingParamsError

_MAX_N = 128  # OpenAI's limit
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 256  # prompts x n of one request (--max-sequences-per-request)


def _default(value: Any, default: Any) -> Any:
    """`null` in a request means the field's default."""
    return default if value is None else value


def _sse(obj: BaseModel | dict) -> str:
    data = obj.model_dump_json() if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {data}\n\n"


class _AbortingStreamingResponse(StreamingResponse):
    """Aborts the engine request however the response ends, even if its body was never started."""

    def __init__(self, body: AsyncIterator[str], stream: RequestStream) -> None:
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._engine_stream = stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._engine_stream.abort()


async def _wait_disconnect(raw: Request) -> None:
    """Returns when the client has gone (uvicorn answers receive() with http.disconnect)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return
        await asyncio.sleep(0.05)  # a stray body message; do not spin


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, tokenizer: Any | None, model_names: list[str],
                 metrics: ServerMetrics | None = None, chat_template: str | None = None,
                 max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST,
                 tool_call_parser: str | None = None) -> None:
        if max_sequences_per_request < 1:
            raise ValueError(f"max_sequences_per_request must be >= 1, got {max_sequences_per_request}")
        if tool_call_parser is not None:
            get_tool_parser(tool_call_parser)  # an unknown name fails at start-up, not on the first request
        self.tool_call_parser = tool_call_parser
        self.engine, self.tokenizer, self.model_names = engine, tokenizer, model_names
        self.metrics, self.chat_template = metrics, chat_template
        self.max_model_len = engine.max_model_len
        self.max_sequences_per_request = max_sequences_per_request
        self.vocab_size = engine.engine.model_config.vocab_size
        self.inputs = PromptInput(tokenizer, self.max_model_len, self.vocab_size, chat_template)
        self.draining = False  # set on shutdown: new work gets 503

    # ---- validation ------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> str:
        if name is None or name in self.model_names:
            return self.model_names[0]
        raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def check_generates(self, model: str, api: str) -> None:
        """An embedding model has no LM head: text endpoints answer 400 rather than reach the engine."""
        if self.engine.engine.pooling is not None:
            raise APIError(400, f"The model `{model}` is an embedding model and does not support the {api} API; "
                                "use /v1/embeddings.", param="model", code="model_not_supported")

    async def _chat_prompt(self, req: Any, tools: list[dict[str, Any]] | None = None) -> Prompts:
        messages = chat_messages(req)
        continue_final = _default(req.continue_final_message, False)
        if continue_final and req.add_generation_prompt is True:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true",
                           param="continue_final_message")
        if continue_final and messages[-1]["role"] != "assistant":
            raise APIError(400, "continue_final_message needs the last message to be the assistant's",
                           param="continue_final_message")
        return await self.inputs.chat(messages, _default(req.add_generation_prompt, not continue_final),
                                      req.chat_template_kwargs, continue_final,
                                      _default(req.add_special_tokens, False), tools)

    def _check_context(self, prompts: Prompts, max_tokens: int | None, explicit: bool, what: str) -> None:
        limit = self.max_model_len
        for _, ids in prompts:
            if len(ids) >= limit:
                raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your "
                                    f"{what} has {len(ids)} tokens, leaving no room for the completion. Please "
                                    f"reduce the length of the {what}.", param=what, code="context_length_exceeded")
            if explicit and max_tokens is not None and len(ids) + max_tokens > limit:
                raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you "
                                    f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the {what}, "
                                    f"{max_tokens} for the completion). Please reduce the length of the {what} "
                                    f"or completion.", param="max_tokens", code="context_length_exceeded")

    def _sampling_params(self, req: Any, max_tokens: int | None, logprobs: int | None, num_prompts: int,
                         names: dict[str, str] | None = None) -> SamplingParams:
        """Every field checked (types by the request model, ranges by SamplingParams) before anything is queued;
        `names` maps a SamplingParams field to the request field that set it, for the error's `param`."""
        names = names or {}
        bad = req.unsupported_fields()
        if bad:
            raise APIError(400, f"`{bad[0]}` is not supported by this server", param=bad[0])
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        n = _default(req.n, 1)
        if not 1 <= n <= _MAX_N:
            raise APIError(400, f"n must be in [1, {_MAX_N}], got {n}", param="n")
        best_of = getattr(req, "best_of", None)  # completions only
        samples = best_of if isinstance(best_of, int) and best_of > n else n
        if num_prompts * samples > self.max_sequences_per_request:
            raise APIError(400, f"this request asks for {num_prompts} prompt(s) x n={samples} = "
                                f"{num_prompts * samples} sequences, more than this server's limit of {self.max_sequences_per_request} per "
                                "request (--max-sequences-per-request)", param="n" if n > 1 else "prompt")
        if logprobs is not None and logprobs > MAX_LOGPROBS:
            param = names.get("logprobs", "logprobs")
            raise APIError(400, f"{param} must be at most {MAX_LOGPROBS}, got {logprobs}", param=param)
        top_k = _default(req.top_k, 0)
        if self.vocab_size is not None and isinstance(top_k, int) and top_k > self.vocab_size:
            top_k = self.vocab_size  # the same as no top-k; keeps absurd values away from the sampler
        if req.stop_token_ids:
            self.inputs.check_ids(req.stop_token_ids, "stop_token_ids")
        try:
            structured = req.structured_outputs_params()
        except ValueError as e:
            raise APIError(400, str(e), param="response_format") from e
        logit_bias = None
        if req.logit_bias:
            if not all(k.isdigit() for k in req.logit_bias):
                raise APIError(400, "logit_bias keys must be token ids (decimal strings)", param="logit_bias")
            logit_bias = {int(k): float(v) for k, v in req.logit_bias.items()}
            self.inputs.check_ids(list(logit_bias), "logit_bias")
        try:
            return SamplingParams(
                n=n, temperature=_default(req.temperature, 1.0), top_p=_default(req.top_p, 1.0), top_k=top_k,
                min_p=_default(req.min_p, 0.0), seed=req.seed, max_tokens=max_tokens,
                min_tokens=_default(req.min_tokens, 0), stop=req.stop, stop_token_ids=req.stop_token_ids,
                ignore_eos=_default(req.ignore_eos, False), logprobs=logprobs,
                presence_penalty=_default(req.presence_penalty, 0.0),
                frequency_penalty=_default(req.frequency_penalty, 0.0),
                repetition_penalty=_default(req.repetition_penalty, 1.0),
                skip_special_tokens=_default(req.skip_special_tokens, True), logit_bias=logit_bias,
                include_stop_str_in_output=_default(req.include_stop_str_in_output, False),
                truncate_prompt_tokens=req.truncate_prompt_tokens, best_of=best_of, structured_outputs=structured)
        except SamplingParamsError as e:
            param = names.get(e.param, e.param)
            msg = str(e).removeprefix("SamplingParams: ")
            raise APIError(400, param + msg.removeprefix(e.param) if msg.startswith(e.param) else msg,
                           param=param) from e
        except (ValueError, TypeError) as e:
            msg = str(e).removeprefix("SamplingParams: ")
            raise APIError(400, msg, param=msg.split(" ", 1)[0]) from e

    async def _submit(self, prompts: Prompts, params: SamplingParams, stream_text: bool,
                      grammar_param: str = "response_format") -> RequestStream:
        if self.draining:
            raise APIError(503, "the server is shutting down", "server_error", code="shutting_down",
                           headers={"Retry-After": "5"})
        try:
            return await self.engine.submit(prompts, params, stream_text=bool(stream_text))
        except EngineOverloaded as e:
            raise APIError(503, str(e), "server_error", code="overloaded", headers={"Retry-After": "1"}) from e
        except EngineDead as e:
            raise APIError(503, str(e), "server_error", code="engine_dead") from e
        except (ValueError, TypeError) as e:  # the engine's own checks (vocabulary, cache size, a bad grammar)
            raise APIError(400, str(e), param=grammar_param if str(e).startswith("structured_outputs")
                           else "prompt") from e

    # ---- endpoints -------------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        arrival = time.perf_counter()
        model = self.check_model(req.model)
        self.check_generates(model, "Completions")
        # echo with logprobs: the prompt's logprobs lead the choice's (lm-evaluation-harness scores prompts so);
        # max_tokens 0 then generates one token for the engine's sake and shows none
        prompt_only = bool(req.echo) and req.max_tokens == 0
        if req.echo and req.logprobs is not None and req.stream:
            raise APIError(400, "echo with logprobs is not supported when streaming", param="echo")
        if req.stream and req.best_of is not None and req.best_of > _default(req.n, 1):
            raise APIError(400, "best_of greater than n is not supported when streaming", param="best_of")
        params = self._sampling_params(req, 1 if prompt_only else req.max_tokens, req.logprobs,
                                       count_prompts(req.prompt))
        if req.echo and req.logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=req.logprobs)
        prompts = truncated(await self.inputs.completion(req.prompt, _default(req.add_special_tokens, True)),
                             params.truncate_prompt_tokens, self.max_model_len)
        self._check_context(prompts, req.max_tokens, "max_tokens" in req.model_fields_set, "prompt")
        echo = [self._echo_text(t, ids) if req.echo else "" for t, ids in prompts]
        width = params.num_samples  # best_of: every sample runs, the n best are returned
        choices = [ChoiceState(echo[p]) for p in range(len(prompts)) for _ in range(width)]
        stream = await self._submit(prompts, params, req.stream)
        ctx = _Context(f"cmpl-{uuid.uuid4().hex}", int(time.time()), model, params, prompts, choices,
                       RequestTimer(self.metrics, arrival), req.stream_options)
        if req.stream:
            return _AbortingStreamingResponse(self._stream(stream, ctx, chat=False), stream)
        ctx.hide_output = prompt_only
        gone = await self._collect(stream, ctx, raw)
        if gone:
            return Response(status_code=499)
        out = []
        for i, (p, ch) in enumerate(best_of_choices(choices, width, params.n)):
            lp = None
            if params.logprobs is not None:
                shown = 0 if prompt_only else len(ch.token_ids)
                lp, _ = completion_logprobs(ch.token_ids[:shown], ch.logprobs[:shown], len(ch.echo_text))
                if req.echo:
                    lp = echo_logprobs(prompts[p][1], ctx.prompt_logprobs[p], lp, lambda t: self.inputs.decode([t]))
            out.append(CompletionChoice(index=i, text=ch.echo_text if prompt_only else ch.full_text, logprobs=lp,
                                        finish_reason="length" if prompt_only else ch.finish_reason,
                                        stop_reason=None if prompt_only else ch.stop_reason))
        return JSONResponse(CompletionResponse(id=ctx.id, created=ctx.created, model=model, choices=out,
                                               usage=ctx.usage()).model_dump())

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.perf_counter()
        model = self.check_model(req.model)
        self.check_generates(model, "Chat Completions")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        names = {"logprobs": "top_logprobs",
                 "max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"}
        params = self._sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None, 1, names)
        plan = plan_tools(req, self.tool_call_parser)
        if plan.structured is not None:
            params = dataclasses.replace(params, structured_outputs=plan.structured)
        if plan.mode == "auto" and req.skip_special_tokens is None:  # tool-call markers are often special tokens
            params = dataclasses.replace(params, skip_special_tokens=False)
        prompts = truncated(await self._chat_prompt(req, plan.template_tools), params.truncate_prompt_tokens,
                            self.max_model_len)
        self._check_context(prompts, max_tokens, True, "messages")
        choices = [ChoiceState() for _ in range(params.n)]
        stream = await self._submit(prompts, params, req.stream, "tools" if plan.structured else "response_format")
        ctx = _Context(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model, params, prompts, choices,
                       RequestTimer(self.metrics, arrival), req.stream_options, req.top_logprobs or 0)
        if req.stream:
            ctx.tool_deltas = [ToolDeltas(plan) for _ in choices] if plan.parses else None
            return _AbortingStreamingResponse(self._stream(stream, ctx, chat=True), stream)
        if await self._collect(stream, ctx, raw):
            return Response(status_code=499)
        out = []
        for i, ch in enumerate(choices):
            content, calls, finish = (tool_reply(plan, ch.full_text, ch.finish_reason) if plan.parses
                                      else (ch.full_text, None, ch.finish_reason))
            out.append(ChatChoice(index=i, message=ChatResponseMessage(content=content, tool_calls=calls),
                                  logprobs=chat_logprobs(ch.token_ids, ch.logprobs, ctx.top_n)
                                  if params.logprobs is not None else None,
                                  finish_reason=finish, stop_reason=ch.stop_reason))
        return JSONResponse(ChatCompletionResponse(id=ctx.id, created=ctx.created, model=model, choices=out,
                                                   usage=ctx.usage()).model_dump())

    def _echo_text(self, text: str | None, ids: list[int]) -> str:
        return text if text is not None else self.inputs.decode(ids)

    # ---- driving a request -----------------------------------------------------------------------
    async def _collect(self, stream: RequestStream, ctx: "_Context", raw: Request) -> bool:
        """Gather a non-streamed request; True if the client left first (its request is then aborted)."""
        async def consume() -> None:
            async for update in stream:
                _raise_if_failed(update)
                ctx.apply(update, streaming=False)

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(_wait_disconnect(raw))
        try:
            await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not consumer.done():
                return True
            consumer.result()  # re-raise an engine failure
            return False
        except EngineDead as e:
            raise APIError(503, str(e), "server_error", code="engine_dead") from e
        finally:
            consumer.cancel()
            watcher.cancel()
            stream.abort()

    async def _stream(self, stream: RequestStream, ctx: "_Context", chat: bool) -> AsyncIterator[str]:
        """SSE: one chunk per engine step and updated choice, then usage (if asked) and [DONE]. The
        `finally` runs when the client disconnects too (Starlette cancels us), aborting the request."""
        try:
            if chat:  # OpenAI opens every chat choice with the role
                for i in range(len(ctx.choices)):
                    yield _sse(ctx.chat_chunk(ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                                          content=""))))
            async for update in stream:
                try:
                    _raise_if_failed(update)
                except APIError as e:
                    yield _sse(e.body())
                    return
                for index, delta, seq in ctx.apply(update, streaming=True):
                    ch = ctx.choices[index]
                    k = len(seq.new_token_ids)
                    if chat:
                        lp = chat_logprobs(ch.token_ids[-k:] if k else [], ch.logprobs[-k:] if k else [],
                                           ctx.top_n) if ctx.params.logprobs is not None else None
                        content, calls, finish = (ctx.tool_deltas[index].feed(delta, seq.finish_reason)
                                                  if ctx.tool_deltas else (delta, None, seq.finish_reason))
                        yield _sse(ctx.chat_chunk(ChatChunkChoice(
                            index=index, delta=DeltaMessage(content=content, tool_calls=calls), logprobs=lp,
                            finish_reason=finish)))
                    else:
                        lp = None
                        if ctx.params.logprobs is not None:
                            lp, ch.text_offset = completion_logprobs(ch.token_ids[len(ch.token_ids) - k:],
                                                                     ch.logprobs[len(ch.logprobs) - k:],
                                                                     ch.text_offset)
                        yield _sse(CompletionResponse(id=ctx.id, created=ctx.created, model=ctx.model, choices=[
                            CompletionChoice(index=index, text=delta, logprobs=lp, finish_reason=seq.finish_reason,
                                             stop_reason=seq.stop_reason)]))
            if ctx.include_usage:
                obj = "chat.completion.chunk" if chat else "text_completion"
                yield _sse({"id": ctx.id, "object": obj, "created": ctx.created, "model": ctx.model,
                            "choices": [], "usage": ctx.usage().model_dump()})
            yield "data: [DONE]\n\n"
        except EngineDead as e:
            yield _sse(APIError(503, str(e), "server_error", code="engine_dead").body())
        finally:
            stream.abort()


def _raise_if_failed(update: GroupUpdate) -> None:
    """A sample that the engine ended with finish_reason "error" (the step running it raised; the engine failed
    only that step's requests and serves on) fails its HTTP request with a 500 that says so."""
    for seq in update.seqs:
        if seq.finish_reason == "error":
            raise APIError(500, seq.error or "the engine step running this request failed", "server_error",
                           code="engine_step_failed")


class _Context:
    """One HTTP request's bookkeeping: ids, choices, usage, latency metrics."""

    def __init__(self, id_: str, created: int, model: str, params: SamplingParams, prompts: Prompts,
                 choices: list[ChoiceState], timer: RequestTimer, stream_options: Any, top_n: int = 0) -> None:
        self.id, self.created, self.model, self.params = id_, created, model, params
        self.prompts, self.choices, self.timer, self.top_n = prompts, choices, timer, top_n
        self.include_usage = bool(stream_options and stream_options.include_usage)
        self.cached_tokens = [0] * len(prompts)
        self.prompt_logprobs: list[list | None] = [None] * len(prompts)
        self.hide_output = False  # echo with max_tokens 0: one token is generated for the logprobs, none shown
        self.tool_deltas: list[ToolDeltas] | None = None  # a streamed chat request with tools: per choice

    def apply(self, update: GroupUpdate, streaming: bool) -> list[tuple[int, str, Any]]:
        self.cached_tokens[update.prompt_index] = update.num_cached_tokens
        if update.prompt_logprobs is not None:
            self.prompt_logprobs[update.prompt_index] = update.prompt_logprobs
        out = []
        for seq in update.seqs:
            index = update.prompt_index * self.params.num_samples + seq.index
            delta = self.choices[index].apply(seq, streaming)
            self.timer.on_tokens(index, len(seq.new_token_ids), update.time)
            if seq.finish_reason is not None:
                self.timer.on_finish(seq.finish_reason, update.time)
            out.append((index, delta, seq))
        return out

    def usage(self) -> Usage:
        prompt = sum(len(ids) for _, ids in self.prompts)
        completion = 0 if self.hide_output else sum(len(ch.token_ids) for ch in self.choices)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self.cached_tokens)))

    def chat_chunk(self, choice: ChatChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])
