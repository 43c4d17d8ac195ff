"""The prompt forms LLM.embed and /v1/embeddings take, turned into token ids (and optional token type ids)."""
from __future__ import annotations

from typing import Any, Callable


def parse_embed_prompt(prompt: str | dict[str, Any], tokenize: Callable[[str], list[int]]
                       ) -> tuple[str | None, list[int], list[int] | None]:
    """Text, or a dict with 'prompt' (text) or 'prompt_token_ids' and optional 'token_type_ids' ->
    (text or None, token ids, token type ids or None). ValueError names what is wrong."""
    if isinstance(prompt, str):
        return prompt, tokenize(prompt), None
    if not isinstance(prompt, dict):
        raise ValueError(f"a prompt must be a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")
    unknown = set(prompt) - {"prompt", "prompt_token_ids", "token_type_ids"}
    if unknown:
        raise ValueError(f"prompt dict has unsupported key(s): {sorted(unknown)}")
    text = prompt.get("prompt")
    if "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)):
            raise ValueError("prompt_token_ids must be a list of ints")
        ids = list(ids)
    elif isinstance(text, str):
        ids = tokenize(text)
    else:
        raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
    types = prompt.get("token_type_ids")
    return text, ids, list(types) if types is not None else None
