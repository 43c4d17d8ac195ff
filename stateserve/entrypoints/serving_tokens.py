"""vLLM's tokenizer endpoints and the server's identity: POST /tokenize (a prompt, or chat messages rendered
through the template), POST /detokenize, GET /tokenizer_info, GET /version, GET /v1/models/{id}. Clients such as
lm-evaluation-harness ask these before they send work."""
from __future__ import annotations

from importlib import metadata
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, StrictBool, StrictInt, StrictStr, ValidationError

from stateserve.entrypoints.errors import APIError
from stateserve.entrypoints.openai_protocol import ChatMessage, ModelCard, _List, _Strict


class TokenizeCompletionRequest(_Strict):
    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool | None = None  # null: true, as completions
    return_token_strs: StrictBool | None = None


class TokenizeChatRequest(_Strict):
    model: StrictStr | None = None
    messages: _List(ChatMessage)
    add_generation_prompt: StrictBool | None = None  # null: true
    continue_final_message: StrictBool | None = None
    add_special_tokens: StrictBool | None = None  # null: false, as chat
    chat_template_kwargs: dict[str, Any] | None = None
    tools: _List(dict[str, Any]) | None = None  # rendered by the template, as chat completions render them
    return_token_strs: StrictBool | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: StrictStr | None = None
    tokens: _List(StrictInt)


def version() -> str:
    try:
        return metadata.version("stateserve")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


class TokenServing:
    def __init__(self, serving: Any) -> None:
        self.serving = serving  # entrypoints.serving.OpenAIServing: model names, prompt input, chat rendering
        self.tokenizer = serving.inputs.tokenizer

    def _need_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise APIError(400, "this server has no tokenizer (started with --skip-tokenizer-init)")

    async def tokenize(self, body: dict[str, Any]) -> TokenizeResponse:
        """A completion-style prompt or chat messages (vLLM takes both shapes on one route: `messages` tells)."""
        cls = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
        try:
            req = cls.model_validate(body)
        except ValidationError as e:  # answered like any body the route validates (a 400 naming the field)
            raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from e
        self._need_tokenizer()
        self.serving.check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            _, ids = (await self.serving._chat_prompt(req, req.tools))[0]
        else:
            add = req.add_special_tokens if req.add_special_tokens is not None else True
            _, ids = (await self.serving.inputs.completion(req.prompt, add))[0]
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.serving.max_model_len, tokens=ids,
                                token_strs=strs)

    def detokenize(self, req: DetokenizeRequest) -> dict[str, str]:
        self._need_tokenizer()
        self.serving.check_model(req.model)
        self.serving.inputs.check_ids(req.tokens, "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    def tokenizer_info(self) -> dict[str, Any]:
        self._need_tokenizer()
        tok = self.tokenizer
        return {"tokenizer_class": type(tok).__name__, "vocab_size": len(tok), "model_max_length":
                self.serving.max_model_len, "bos_token": tok.bos_token, "eos_token": tok.eos_token,
                "pad_token": tok.pad_token, "unk_token": tok.unk_token,
                "chat_template": self.serving.inputs.chat_template or getattr(tok, "chat_template", None)}

    def model(self, model_id: str, root: str) -> ModelCard:
        if model_id not in self.serving.model_names:
            raise APIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
        return ModelCard(id=model_id, root=root, max_model_len=self.serving.max_model_len)
