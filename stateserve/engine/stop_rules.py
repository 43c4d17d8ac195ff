"""When a sequence stops, applied after each of its new tokens: a structured output's completed grammar, stop ids and
stop strings (only once min_tokens tokens exist; a stop string is looked for in the text the token added, with the
string's length before it), max_tokens and max_model_len."""
from __future__ import annotations

from stateserve.core.request import Request
from stateserve.engine.detokenizer import find_stop_string


def apply_stop_rules(req: Request, token: int, max_model_len: int) -> bool:
    """Set the request's finish and stop reasons (and its text cut at a stop string) if `token` ends it; True then."""
    p = req.params
    if req.constraint is not None and req.constraint.consume(token):  # a structured output's grammar is complete
        req.finish_reason = "stop"
    if req.num_output_tokens < p.min_tokens:
        if p.stop and req.detok is not None:
            req.output_text = req.detok.text  # text before min_tokens is never searched for stop strings
    elif token in p._all_stop_token_ids:
        req.finish_reason = "stop"
        req.stop_reason = token if token in p.stop_token_ids else None
    elif p.stop:
        text = req.detok.text if req.detok is not None else ""
        hit = find_stop_string(text, p.stop, len(req.output_text))
        req.output_text = text
        if hit is not None:
            req.output_text = text[:hit[0] + (len(hit[1]) if p.include_stop_str_in_output else 0)]
            req.finish_reason, req.stop_reason = "stop", hit[1]
    if req.finish_reason is None and p.max_tokens is not None and req.num_output_tokens >= p.max_tokens:
        req.finish_reason = "length"
    if req.finish_reason is None and req.num_tokens >= max_model_len:
        req.finish_reason = "length"
    return req.finish_reason is not None
