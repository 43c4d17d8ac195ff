"""The offline API: LLM(model=...).generate(prompts, SamplingParams(...)), with vLLM's names."""
from __future__ import annotations

import atexit
import time
import uuid
import weakref
from typing import Any, Sequence

from tqdm import tqdm

from stateserve import envs
from stateserve.config import EngineConfig
from stateserve.engine.llm_engine import LLMEngine
from stateserve.entrypoints.submission import add_all, discard_group
from stateserve.outputs import EmbeddingRequestOutput, RequestOutput
from stateserve.sampling_params import SamplingParams

PromptType = str | dict[str, Any]


class LLM:
    def __init__(self, model: str, **kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        self.llm_engine = LLMEngine(self.config, show_progress=not envs.STATESERVE_DISABLE_TQDM)
        # what the model does: embedding architectures pool (LLM.embed), the others generate
        self.runner_type = "generate" if self.llm_engine.pooling is None else "pooling"
        # at interpreter exit, free caches and weights even if the user forgot shutdown()
        atexit.register(_shutdown_ref, weakref.ref(self))

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def _to_token_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.llm_engine.tokenize(prompt)
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown:
                raise ValueError(f"prompt dict has unsupported key(s): {sorted(unknown)}")
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)):
                    raise ValueError("prompt_token_ids must be a list of ints")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                return prompt["prompt"], self.llm_engine.tokenize(prompt["prompt"])
        raise ValueError(f"a prompt must be a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")

    def _to_inputs(self, prompt: PromptType) -> tuple[str | None, list[int], Any]:
        """(text, token ids, encoder input or None): the model kind parses the prompt forms it takes."""
        return self.llm_engine.runner.parse_prompt(prompt, self._to_token_ids, self.llm_engine.tokenizer)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Every prompt is validated before any is added (a bad one raises
        and adds nothing). A sample whose engine step fails comes back with finish_reason "error" and `error` set
        while the others run to the end (vLLM's finish_reason for request-level failures); if the engine dies
        (EngineDeadError, after several failed steps in a row) the call aborts what is left and raises it."""
        engine = self.llm_engine
        engine._check_open()
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) \
            else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        # Validate and build every request before adding any, so a bad prompt or SamplingParams leaves the engine
        # untouched; should adding still fail half-way, what was added is taken out again.
        key = uuid.uuid4().hex[:12]  # one fairness key for the whole call (engine/fair_queue.py)
        prepared = []
        for prompt, p in zip(prompts, params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params must be SamplingParams, got {type(p).__name__}")
            text, ids, encoder_input = self._to_inputs(prompt)
            prepared.append(engine.prepare_request(uuid.uuid4().hex[:12], ids, p, prompt=text,
                                                   encoder_input=encoder_input, fairness_key=key))
        ids_in_order = add_all(engine, prepared)
        return self._run(ids_in_order, use_tqdm and not envs.STATESERVE_DISABLE_TQDM)

    def embed(self, prompts: PromptType | Sequence[PromptType], truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One pooled (and, as the model folder asks, normalised) vector per prompt. A prompt is text or a dict
        with 'prompt' / 'prompt_token_ids' and optional 'token_type_ids'; truncate_prompt_tokens=k keeps the
        last k tokens (-1: the model's limit)."""
        engine = self.llm_engine
        engine._check_open()
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        keep_last = engine.resolve_truncation(truncate_prompt_tokens) if engine.pooling is not None else None
        key = uuid.uuid4().hex[:12]
        prepared = [engine.prepare_embed(uuid.uuid4().hex[:12], p, keep_last, fairness_key=key)
                    for p in prompts]  # every prompt validated before any is queued
        outputs = self._run(add_all(engine, prepared), use_tqdm and not envs.STATESERVE_DISABLE_TQDM)
        failed = next((o.outputs.error for o in outputs if o.outputs.error is not None), None)
        if failed is not None:  # a vector cannot be partly right: the call fails as a whole
            raise RuntimeError(failed)
        return outputs

    def _run(self, ids: list[str], use_tqdm: bool) -> list[Any]:
        engine = self.llm_engine
        wanted, results = set(ids), {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        start, num_in, num_out = time.perf_counter(), 0, 0
        try:
            while wanted - results.keys():
                for gid in engine.step():
                    if gid in wanted and gid not in results:
                        out = engine.pop_output(gid)
                        results[gid] = out
                        num_in += len(out.prompt_token_ids)
                        num_out += sum(len(o.token_ids) for o in out.outputs) \
                            if isinstance(out, RequestOutput) else 0
                        elapsed = max(time.perf_counter() - start, 1e-9)
                        bar.set_postfix_str(f"input: {num_in / elapsed:.1f} toks/s, output: "
                                            f"{num_out / elapsed:.1f} toks/s")
                        bar.update(1)
        except BaseException:  # interrupted, or the engine died: leave no half-run request holding caches
            for gid in ids:
                if gid not in results:
                    discard_group(engine, gid)
            raise
        finally:
            bar.close()
        return [results[i] for i in ids]

    def shutdown(self) -> None:
        """Free caches, model state and weights; idempotent. `generate` afterwards raises."""
        self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _shutdown_ref(ref: "weakref.ref[LLM]") -> None:
    llm = ref()
    if llm is not None:
        llm.shutdown()
