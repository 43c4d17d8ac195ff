"""Prompts and chat messages -> token ids for the text endpoints: checked early, tokenized off the event loop.

Tokenizing a prompt and rendering a chat template run on a worker thread of their own (one, so the tokenizer is
never used by two threads at once), so a long prompt never stalls the event loop and the other clients on it.

A prompt that cannot fit is refused before it is tokenized: a token never stands for more characters than its
vocabulary string has (byte-level BPE writes each byte of the text as one character, SentencePiece one character
per character, byte-fallback tokens `<0x0A>` six per byte, WordPiece adds `##`), so a text of more than
`max_model_len * L` characters, L the longest vocabulary string (special tokens included), has more than
`max_model_len` tokens: the character check never refuses a prompt the token check would accept. (A tokenizer
whose normalizer deletes or merges characters, such as T5's collapsing runs of spaces, could in theory map such a
long text to fewer tokens; it is refused all the same.) Token-id prompts are checked against the vocabulary
before anything decodes them."""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from stateserve.entrypoints.errors import APIError

Prompts = list[tuple[str | None, list[int]]]
logger = logging.getLogger("stateserve.server")


def max_token_chars(tokenizer: Any) -> int | None:
    """The longest string in the tokenizer's vocabulary (added and special tokens included); None if unknown."""
    try:
        strings = list(tokenizer.get_vocab())
    except Exception:  # a tokenizer without a readable vocabulary: no character check
        return None
    strings += list(getattr(tokenizer, "all_special_tokens", None) or [])
    longest = max((len(s) for s in strings if isinstance(s, str)), default=0)
    return longest or None


def count_prompts(prompt: Any) -> int:
    """How many prompts a completions `prompt` holds (its shape was checked by CompletionRequest)."""
    if isinstance(prompt, str) or (prompt and type(prompt[0]) is int):
        return 1
    return len(prompt)


class PromptInput:
    def __init__(self, tokenizer: Any | None, max_model_len: int, vocab_size: int | None,
                 chat_template: str | None = None) -> None:
        self.tokenizer, self.max_model_len, self.vocab_size = tokenizer, max_model_len, vocab_size
        self.chat_template = chat_template
        self.token_chars = max_token_chars(tokenizer) if tokenizer is not None else None
        self.max_chars = max_model_len * self.token_chars if self.token_chars else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stateserve-tokenize")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- checks ----------------------------------------------------------------------------------
    def check_ids(self, ids: list[int], what: str) -> None:
        """Token ids (already known to be ints) inside the vocabulary, before anything decodes them."""
        if self.vocab_size is None:
            return
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            shown = ", ".join(str(t) if len(str(t)) <= 24 else f"{str(t)[:12]}...({len(str(t))} digits)"
                              for t in bad[:5])
            raise APIError(400, f"{what} has token id(s) outside the vocabulary [0, {self.vocab_size}): [{shown}]",
                           param=what)

    def check_chars(self, text: str, what: str) -> None:
        if self.max_chars is not None and len(text) > self.max_chars:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens, and one of "
                                f"its tokens stands for at most {self.token_chars} characters, so a {what} of "
                                f"{len(text)} characters cannot fit (at most {self.max_chars}). Please reduce the "
                                f"length of the {what}.", param=what, code="context_length_exceeded")

    # ---- tokenizing --------------------------------------------------------------------------------
    def _need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise APIError(400, f"this server has no tokenizer: send the {what} as token ids", param=what)

    def _encode(self, text: str, add_special_tokens: bool, what: str) -> list[int]:
        self.check_chars(text, what)
        try:
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
        except Exception as e:  # the text is the client's: whatever the tokenizer refuses is a 400
            logger.warning("tokenizer failed on a %s: %r", what, e)
            raise APIError(400, f"the {what} could not be tokenized: {e}", param=what) from e

    async def _off_loop(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def completion(self, prompt: Any, add_special_tokens: bool = True) -> Prompts:
        """A completions `prompt` (a string, strings, token ids or token-id lists) -> (text, ids) per prompt."""
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str):
            id_lists = [prompt] if type(prompt[0]) is int else prompt
            for ids in id_lists:
                if len(ids) < self.max_model_len:  # a longer one is refused by its length (the context check)
                    self.check_ids(ids, "prompt")
            return [(None, list(ids)) for ids in id_lists]
        texts = [prompt] if isinstance(prompt, str) else list(prompt)
        self._need_tokenizer("prompt")
        for text in texts:  # on the loop: cheap, and nothing too long is ever queued for the tokenizer
            self.check_chars(text, "prompt")
        ids = await self._off_loop(lambda: [self._encode(t, add_special_tokens, "prompt") for t in texts])
        return list(zip(texts, ids))

    async def chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                   template_kwargs: dict[str, Any] | None, continue_final_message: bool = False,
                   add_special_tokens: bool = False, tools: list[dict[str, Any]] | None = None) -> Prompts:
        """Render the chat template (with the request's tool definitions) and tokenize the result, both on the
        worker thread."""
        self._need_tokenizer("messages")
        if self.chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template; start the server with "
                                "--chat-template FILE, or use /v1/completions", param="messages")

        def render() -> tuple[str, list[int]]:
            try:
                text = self.tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message, chat_template=self.chat_template, tools=tools,
                    **(template_kwargs or {}))
            except Exception as e:  # a template error is the request's doing (roles, kwargs), not the server's
                raise APIError(400, f"the chat template failed on these messages: {e}", param="messages") from e
            if not isinstance(text, str):
                raise APIError(400, "the chat template did not render to text (check chat_template_kwargs)",
                               param="chat_template_kwargs")
            return text, self._encode(text, add_special_tokens, "messages")

        return [await self._off_loop(render)]

    def decode(self, ids: list[int]) -> str:
        """Text of prompt ids (already checked against the vocabulary) for `echo`."""
        if self.tokenizer is None:
            return ""
        try:
            return self.tokenizer.decode(ids)
        except Exception as e:
            raise APIError(400, f"the prompt's token ids could not be decoded: {e}", param="prompt") from e


def truncated(prompts: Prompts, keep: int | None, max_model_len: int) -> Prompts:
    """truncate_prompt_tokens: each prompt's last `keep` tokens (-1: as many as leave room for one new token),
    before the context check, as the engine keeps them."""
    if keep is None:
        return prompts
    keep = max_model_len - 1 if keep == -1 else keep
    return [(text if len(ids) <= keep else None, ids[-keep:]) for text, ids in prompts]
