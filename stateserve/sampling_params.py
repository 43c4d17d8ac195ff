"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM's names and meaning)."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

# Limits on what one request may ask for (docs/server.md lists them; the server applies the same ones).
MAX_INT64 = 2**63 - 1  # integers that may end up in an int64 tensor (top_k, token ids)
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes a 64-bit unsigned seed
MAX_TEMPERATURE = 100.0  # far past any useful value (OpenAI takes 0-2); keeps logits / T finite in float32
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0  # logits are divided or multiplied by it
MAX_LOGPROBS = 20  # as OpenAI and vLLM's default max_logprobs
MAX_STOP_STRINGS = 64  # OpenAI takes 4, vLLM any number; each is searched for after every token
MAX_LOGIT_BIAS = 100.0  # OpenAI's range; -100 bans a token, +100 all but forces it
MAX_STOP_STRING_CHARS = 1024  # streaming holds back up to the longest one's length - 1 characters


class SamplingParamsError(ValueError):
    """A bad SamplingParams field; `param` is its name."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"SamplingParams: {message}")
        self.param = param


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # bool is an int subclass: refused


def _kind(value: object) -> str:
    return {bool: "a boolean", type(None): "null", str: "a string", float: "a float", int: "an integer",
            list: "a list", dict: "an object"}.get(type(value), type(value).__name__) + \
        (f" ({value!r})" if isinstance(value, (bool, float)) else "")


@dataclass(frozen=True, kw_only=True)
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's names): exactly one of a JSON schema (a dict or its JSON text), any JSON
    object, a regular expression, one of several strings, or a Lark grammar."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise SamplingParamsError("structured_outputs", "structured_outputs needs exactly one of json, "
                                                            f"json_object, regex, choice, grammar; got {given or 'none'}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise SamplingParamsError("structured_outputs", "structured_outputs.choice must be a non-empty list of "
                                                            "strings")


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Validated once, when built; an unknown keyword raises TypeError naming it."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, vLLM's spelling) = no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling (OpenAI: -100..100)
    include_stop_str_in_output: bool = False  # a stop string that ends the text stays in it
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (-1: as many as fit)
    prompt_logprobs: int | None = None  # per prompt token (None for the first): its logprob and the top k
    best_of: int | None = None  # sample this many and return the n with the highest cumulative logprob
    structured_outputs: StructuredOutputsParams | dict | None = None  # a dict is read as StructuredOutputsParams
    # Filled by the engine from the model (eos, generation_config) and not part of the user API.
    _all_stop_token_ids: frozenset[int] = field(default=frozenset(), repr=False, compare=False)
    # best_of without logprobs: the engine tracks them to rank the samples, and shows none
    _hide_logprobs: bool = field(default=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        if self.stop is None:
            object.__setattr__(self, "stop", [])
        if isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", list(self.stop))
        if self.stop_token_ids is None:
            object.__setattr__(self, "stop_token_ids", [])
        if isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if isinstance(self.structured_outputs, dict):
            try:
                object.__setattr__(self, "structured_outputs", StructuredOutputsParams(**self.structured_outputs))
            except TypeError as e:
                raise SamplingParamsError("structured_outputs", f"structured_outputs: {e}") from None
        self._validate()

    def _validate(self) -> None:
        """Every field gets a type and a range; the error names the field (`.param`) so the server can say which.
        Integers must be ints (not bools, not floats) and floats finite numbers (not bools, NaN or infinity)."""
        def bad(param: str, msg: str) -> None:
            raise SamplingParamsError(param, f"{param} {msg}")

        def integer(param: str, lo: int, hi: int = MAX_INT64, what: str = "") -> int:
            value = getattr(self, param)
            if not _is_int(value):
                bad(param, f"must be an integer, got {_kind(value)}")
            if value < lo:
                bad(param, what or f"must be >= {lo}, got {value}")
            if value > hi:
                bad(param, what or f"must be at most {hi}, got {value}")
            return value

        def number(param: str, lo: float, hi: float, lo_open: bool = False) -> float:
            value = getattr(self, param)
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                bad(param, f"must be a number, got {_kind(value)}")
            try:
                finite = math.isfinite(value)
            except OverflowError:  # an int too large for a float
                finite = False
            if not finite:
                bad(param, f"must be a finite number, got {value!r:.40}")
            if value < lo or value > hi or (lo_open and value == lo):
                bad(param, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value:g}")
            return value

        n = integer("n", 1)
        number("temperature", 0.0, MAX_TEMPERATURE)
        number("top_p", 0.0, 1.0, lo_open=True)
        if not _is_int(self.top_k) or not (self.top_k == 0 or 1 <= self.top_k <= MAX_INT64):
            bad("top_k", f"must be 0 or -1 (off) or a positive integer below 2^63 (values at or above the vocabulary "
                         f"size keep every token), got {self.top_k!r}")
        number("min_p", 0.0, 1.0)
        if self.max_tokens is not None:
            integer("max_tokens", 1)
        integer("min_tokens", 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            integer("logprobs", 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            integer("prompt_logprobs", 0, MAX_LOGPROBS)
        if self.best_of is not None:
            integer("best_of", n, what=f"must be an integer >= n ({n}), got {self.best_of!r}")
        number("presence_penalty", -2.0, 2.0)
        number("frequency_penalty", -2.0, 2.0)
        number("repetition_penalty", MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or s == "" for s in self.stop):
            bad("stop", f"must be a non-empty string or a list of them, got {self.stop!r:.200}")
        longest = max(map(len, self.stop), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            bad("stop", f"strings may be at most {MAX_STOP_STRING_CHARS} characters long, got one of {longest}")
        if not isinstance(self.stop_token_ids, list) or any(not _is_int(t) or not 0 <= t <= MAX_INT64
                                                            for t in self.stop_token_ids):
            bad("stop_token_ids", f"must be non-negative integers, got {self.stop_token_ids!r:.200}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or any(
                    not _is_int(t) or not 0 <= t <= MAX_INT64 or not isinstance(b, numbers.Real) or isinstance(b, bool)
                    or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for t, b in self.logit_bias.items()):
                bad("logit_bias", f"must map token ids (non-negative integers) to numbers in [-{MAX_LOGIT_BIAS:g}, "
                                  f"{MAX_LOGIT_BIAS:g}], got {self.logit_bias!r:.200}")
        if not isinstance(self.include_stop_str_in_output, bool):
            bad("include_stop_str_in_output", f"must be a boolean, got {_kind(self.include_stop_str_in_output)}")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens != -1:
            integer("truncate_prompt_tokens", 1, what=f"must be -1 (as many as fit) or a positive integer, got "
                                                      f"{self.truncate_prompt_tokens!r}")
        if self.seed is not None:
            # child i of n is seeded with seed + i: every one of them must be a valid 64-bit seed
            integer("seed", 0, MAX_SEED - (n - 1),
                    what=f"must be an integer in [0, 2^64 - n] (sample i is seeded with seed + i), got {self.seed!r}"
                         f" with n={n}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def num_samples(self) -> int:
        """Sequences the engine runs for one prompt: best_of, else n."""
        return self.best_of or self.n

    def with_stop_ids(self, ids: frozenset[int]) -> "SamplingParams":
        import dataclasses

        extra = {}
        if self.num_samples > self.n and self.logprobs is None:  # ranking the samples needs their logprobs
            extra = dict(logprobs=0, _hide_logprobs=True)
        return dataclasses.replace(self, _all_stop_token_ids=ids, **extra)
