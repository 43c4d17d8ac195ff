"""Structured outputs (SamplingParams.structured_outputs) on llguidance: each request's constraint is compiled to a
grammar once (kept per constraint across requests) and followed by a matcher of its own; each step the sampler masks
every constrained row to the tokens its matcher allows, so constrained and free requests share one batch."""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from stateserve.sampling_params import StructuredOutputsParams

MAX_CACHED_GRAMMARS = 256
# JSON as json.dumps writes it (", " and ": ", no other whitespace): with free whitespace, small models fill their
# budget with newlines inside a valid but never-ending object. A schema's own "x-guidance" options override this.
JSON_DEFAULTS = {"whitespace_flexible": False}


class GrammarCompiler:
    def __init__(self, tokenizer: Any) -> None:
        self._hf_tokenizer = tokenizer
        self._ll: Any = None  # llguidance and its view of the vocabulary, made on first use (it takes a while)
        self.tokenizer: Any = None
        self._grammars: OrderedDict[str, str] = OrderedDict()

    def _load(self) -> None:
        if self._ll is None:
            import llguidance
            import llguidance.hf

            self._ll = llguidance
            self.tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer)

    def _grammar(self, so: StructuredOutputsParams) -> str:
        matcher = self._ll.LLMatcher
        if so.json is not None:
            schema = json.loads(so.json) if isinstance(so.json, str) else so.json
            return matcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        if so.json_object:
            return matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
        if so.regex is not None:
            return matcher.grammar_from_regex(so.regex)
        if so.choice is not None:
            return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
        return matcher.grammar_from_lark(so.grammar)

    def constraint(self, so: StructuredOutputsParams) -> "Constraint":
        """A fresh matcher for one sequence; ValueError naming what is wrong with the constraint."""
        if self._hf_tokenizer is None:
            raise ValueError("structured_outputs needs the model's tokenizer (the engine runs without one)")
        self._load()
        key = json.dumps([so.json, so.json_object, so.regex, so.choice, so.grammar], sort_keys=True, default=str)
        grammar = self._grammars.get(key)
        if grammar is None:
            try:
                grammar = self._grammar(so)
            except (ValueError, TypeError) as e:  # e.g. a schema that is not JSON
                raise ValueError(f"structured_outputs: {e}") from e
            problem = self._ll.LLMatcher.validate_grammar(grammar)
            if problem:
                raise ValueError(f"structured_outputs: {problem}")
            self._grammars[key] = grammar
            if len(self._grammars) > MAX_CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        self._grammars.move_to_end(key)
        return Constraint(self._ll.LLMatcher(self.tokenizer, grammar), self.tokenizer.vocab_size)


@dataclass(eq=False)
class Constraint:
    """One sequence's matcher (it has consumed the sequence's output so far) and the tokenizer's vocabulary size."""

    matcher: Any
    vocab_size: int

    def consume(self, token: int) -> bool:
        """Advance past a sampled token; True when the grammar is complete and nothing more may follow."""
        self.matcher.consume_token(token)
        return self.matcher.is_stopped()


_executor: Any = None  # llguidance's thread pool for filling several rows' masks at once, made on first use


def _fill(llt: Any, constraints: list[Constraint], bitmask: torch.Tensor) -> None:
    """One bitmask row per constraint. Several rows are filled in parallel by llguidance's own threads (the GIL is
    released, and the cores are idle between the forward and the sampler), as many as torch's compute threads."""
    global _executor
    if len(constraints) == 1:
        llt.fill_next_token_bitmask(constraints[0].matcher, bitmask, 0)
        return
    if _executor is None:
        _executor = llt.LLExecutor(num_threads=max(1, torch.get_num_threads()))
    llt.fill_next_token_bitmask_par(_executor, [(c.matcher, j) for j, c in enumerate(constraints)], bitmask)


def mask_rows(logits: torch.Tensor, constraints: list[Constraint | None]) -> None:
    """Rows with a constraint keep only the tokens its matcher allows (in place; columns past the tokenizer's
    vocabulary are never allowed); other rows are untouched."""
    rows = [i for i, c in enumerate(constraints) if c is not None]
    if not rows:
        return
    import llguidance.torch as llt

    vocab = constraints[rows[0]].vocab_size
    bitmask = llt.allocate_token_bitmask(len(rows), vocab)
    _fill(llt, [constraints[i] for i in rows], bitmask)
    sub = logits[rows, :vocab].contiguous()
    llt.apply_token_bitmask_inplace(sub, bitmask.to(logits.device))
    logits[rows, :vocab] = sub
    logits[rows, vocab:] = float("-inf")
