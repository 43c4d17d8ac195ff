"""EncoderDecoderModelState: models with cross-attention (BART, T5, Whisper).

The decoder's self-attention uses paged KV blocks like any decoder. The encoder runs once per request, on the
first step that schedules it: the model computes the encoder output and, from it, the cross-attention K/V of
every decoder layer. Those K/V (the "encoder cache") are kept here per request until remove_request (finish,
abort, preemption; a preempted request is re-encoded when it runs again) and handed to the layers each step
as ForwardMeta.extra["cross"] (a CrossAttnMetadata). Single-token queries of all sequences are attended in one
batched call over zero-padded K/V; that stack is rebuilt only when the set of decoding sequences changes.

What an encoder-decoder model class provides (see models/bart.py):
  decoder_start_token_id, prepends_decoder_start (False: the decoder prompt is used as given, e.g. Whisper),
  prepare_encoder_input(raw, model_path, max_len) -> (data, length): validated, model-ready encoder input,
  encode(list of data) -> list of [L_i, hidden], cross_kv([L, hidden]) -> per decoder layer (k, v) [KH, L, D]."""
from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from stateserve.layers.cross_attention import KV, CrossAttnMetadata, stack_padded
from stateserve.layers.metadata import ForwardMeta
from stateserve.model_states.default import DefaultModelState, build_paged_attn_metadata
from stateserve.models.base import ModelBase
from stateserve.core.batch import InputBatch


@dataclass(eq=False)
class EncoderInput:
    """A request's encoder input, validated and ready for model.encode."""

    data: dict[str, Any]  # e.g. {"input_ids": [...]} or {"input_features": tensor [mels, frames]}
    length: int  # encoder output positions
    cache_key: bytes  # hash of the input: folded into the decoder's prefix-cache keys
    prompt_token_ids: list[int] | None = None  # text encoders: the encoder prompt


@dataclass(eq=False)
class _Entry:
    kv: list[KV]  # per decoder layer
    length: int
    serial: int  # distinguishes a re-encoded request from its earlier entry


def _decoder_ids(prompt: Any, to_token_ids: Callable, tokenizer: Any) -> tuple[str | None, list[int]]:
    text = prompt if isinstance(prompt, str) else None
    if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and "prompt" in prompt:
        if set(prompt) - {"prompt"}:
            raise ValueError(f"decoder prompt dict has unsupported key(s): {sorted(set(prompt) - {'prompt'})}")
        text = prompt["prompt"]
    if text is None:
        return to_token_ids(prompt)
    if tokenizer is None:
        raise ValueError("a text decoder prompt needs a tokenizer; with skip_tokenizer_init=True pass "
                         "{'prompt_token_ids': [...]}")
    return text, tokenizer(text, add_special_tokens=False).input_ids


def hash_encoder_data(data: dict[str, Any]) -> bytes:
    h = hashlib.blake2b(b"encoder-input", digest_size=16)
    for name in sorted(data):
        value = data[name]
        h.update(name.encode())
        if isinstance(value, torch.Tensor):
            t = value.detach().to("cpu").contiguous()
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(repr(value).encode())
    return h.digest()


class EncoderDecoderModelState(DefaultModelState):
    uses_kv_cache = True
    uses_state_cache = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for name in ("encode", "cross_kv", "prepare_encoder_input"):
            if getattr(type(self.model), name) is getattr(ModelBase, name):
                raise TypeError(f"{type(self.model).__name__} has cross-attention but no {name}() method")
        self.encoder_cache: dict[str, _Entry] = {}  # request id -> cross K/V of every decoder layer
        self._serials = itertools.count()
        self._stack_key: tuple[int, ...] | None = None
        self._stack: tuple[list[KV], torch.Tensor | None] | None = None

    # ---- prompts -------------------------------------------------------------------------------
    def parse_prompt(self, prompt: Any, to_token_ids: Callable[[Any], tuple[str | None, list[int]]],
                     tokenizer: Any) -> tuple[str | None, list[int], EncoderInput]:
        """LLM.generate's prompt forms for encoder-decoder models -> (text, decoder ids, EncoderInput):
          "text" or {"prompt" | "prompt_token_ids"}: the encoder input; decoding starts from the start token;
          {"encoder_prompt": p, "decoder_prompt": p or None}: each side a string or such a dict;
          {"prompt" | "prompt_token_ids": decoder prompt, "multi_modal_data": {"audio": (array, sample_rate)}}.
        Encoder text is tokenized with the tokenizer's special tokens, decoder text without them."""
        dec_text, dec_ids = None, None
        if isinstance(prompt, dict) and ("encoder_prompt" in prompt or "decoder_prompt" in prompt):
            unknown = set(prompt) - {"encoder_prompt", "decoder_prompt"}
            if unknown:
                raise ValueError(f"encoder/decoder prompt dict has unsupported key(s): {sorted(unknown)}")
            if prompt.get("encoder_prompt") is None:
                raise ValueError("an encoder/decoder prompt dict needs an 'encoder_prompt'")
            enc_text, enc_ids = to_token_ids(prompt["encoder_prompt"])
            raw: dict[str, Any] = {"input_ids": enc_ids}
            if prompt.get("decoder_prompt") is not None:
                dec_text, dec_ids = _decoder_ids(prompt["decoder_prompt"], to_token_ids, tokenizer)
        elif isinstance(prompt, dict) and "multi_modal_data" in prompt:
            if not isinstance(prompt["multi_modal_data"], dict):
                raise ValueError("multi_modal_data must be a dict such as {'audio': (array, sample_rate)}")
            raw, enc_text = dict(prompt["multi_modal_data"]), None
            rest = {k: v for k, v in prompt.items() if k != "multi_modal_data"}
            if rest:
                dec_text, dec_ids = _decoder_ids(rest, to_token_ids, tokenizer)
        else:
            enc_text, enc_ids = to_token_ids(prompt)
            raw = {"input_ids": enc_ids}
        dec_ids, encoder_input = self.prepare_prompt(dec_ids, raw)
        return (dec_text if dec_text is not None else enc_text), dec_ids, encoder_input

    def prepare_inputs(self, prompt_token_ids: list[int], encoder_input: Any) -> tuple[list[int], Any]:
        """Without an encoder input the prompt ids are the encoder input and decoding starts from the start token."""
        if encoder_input is None:
            return self.prepare_prompt(None, {"input_ids": list(prompt_token_ids)})
        return prompt_token_ids, encoder_input

    def dummy_seq_len(self) -> int | None:
        # a decoder step needs the cross K/V that only a real encoder input gives: the logits-based estimate
        return None

    def prepare_prompt(self, decoder_ids: list[int] | None, encoder_raw: dict[str, Any]) -> tuple[list[int],
                                                                                                 EncoderInput]:
        """(decoder prompt ids, EncoderInput) from what the user gave. Raises ValueError on bad input.
        encoder_raw: {"input_ids": [...]} for text encoders, {"audio": (array, sample_rate)} for audio ones."""
        if not isinstance(encoder_raw, dict):
            raise ValueError(f"encoder input must be a dict, got {type(encoder_raw).__name__}")
        data, length = self.model.prepare_encoder_input(encoder_raw, self.model_config.path,
                                                        self.model_config.max_model_len)
        start = self.model.decoder_start_token_id
        if decoder_ids is None or len(decoder_ids) == 0:
            if start is None:
                raise ValueError("the model config has no decoder_start_token_id: give a decoder prompt")
            decoder_ids = [start]
        elif self.model.prepends_decoder_start and start is not None and decoder_ids[0] != start:
            decoder_ids = [start, *decoder_ids]  # as transformers' generate does
        prompt_ids = list(data["input_ids"]) if "input_ids" in data else None
        return list(decoder_ids), EncoderInput(data, length, hash_encoder_data(data), prompt_ids)

    # ---- per-request encoder cache -------------------------------------------------------------
    def remove_request(self, req) -> None:
        entry = self.encoder_cache.pop(req.request_id, None)
        if entry is not None and self._stack_key is not None and entry.serial in self._stack_key:
            self._stack_key = self._stack = None

    def _encode(self, reqs: list) -> None:
        for req in reqs:
            if req.encoder_input is None:
                raise RuntimeError(f"request {req.request_id} of an encoder-decoder model has no encoder input")
        # bound the encoder's batch by the step token budget (its activations are not kept)
        budget = self.engine_config.max_num_batched_tokens
        groups, group, size = [], [], 0
        for req in reqs:
            if group and size + req.encoder_input.length > budget:
                groups.append(group)
                group, size = [], 0
            group.append(req)
            size += req.encoder_input.length
        groups.append(group)
        for group in groups:
            hidden = self.model.encode([r.encoder_input.data for r in group])  # each [L_i, hidden]
            for req, h in zip(group, hidden):
                self.encoder_cache[req.request_id] = _Entry(self.model.cross_kv(h), h.shape[0], next(self._serials))

    def encoder_cache_size(self) -> int:
        return len(self.encoder_cache)

    # ---- the step ------------------------------------------------------------------------------
    def prepare_meta(self, batch: InputBatch) -> ForwardMeta:
        missing = [r for r in batch.requests if r.request_id not in self.encoder_cache]
        if missing:
            self._encode(missing)
        entries = [self.encoder_cache[r.request_id] for r in batch.requests]
        decode = [i for i, q in enumerate(batch.query_lens) if q == 1]
        cross = CrossAttnMetadata(seq_kv=[e.kv for e in entries], encoder_lens=[e.length for e in entries],
                                  query_start_loc=batch.query_start_loc,
                                  prefill_seqs=[i for i, q in enumerate(batch.query_lens) if q != 1])
        if decode:
            key = tuple(entries[i].serial for i in decode)
            if key != self._stack_key:
                num_layers = len(entries[0].kv)
                per_layer = [stack_padded([entries[i].kv[layer] for i in decode]) for layer in range(num_layers)]
                mask = per_layer[0][1]
                self._stack_key, self._stack = key, ([kv for kv, _ in per_layer], mask)
            cross.decode_seqs = decode
            cross.decode_kv, cross.decode_mask = self._stack
            cross.decode_rows = torch.tensor([batch.query_start_loc[i] for i in decode],
                                             dtype=torch.long).to(self.device, non_blocking=True)
        attn = build_paged_attn_metadata(batch, self.block_size, self.device)
        return ForwardMeta(batch.num_tokens, attn=attn, extra={"cross": cross})

    def release(self) -> None:
        self.encoder_cache.clear()
        self._stack_key = self._stack = None
