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
from stateserve.engine.pooling import PoolingEngine, select_runner
from stateserve.outputs import EmbeddingRequestOutput, RequestOutput
from stateserve.sampling_params import SamplingParams

PromptType = str | dict[str, Any]


class LLM:
    def __init__(self, model: str, **kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        # embedding architectures run on the pooling engine (runner="auto" picks it for them)
        self.runner_type = select_runner(self.config)
        engine_cls = PoolingEngine if self.runner_type == "pooling" else LLMEngine
        self.llm_engine = engine_cls(self.config, show_progress=not envs.STATESERVE_DISABLE_TQDM)
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
        """(text, token ids, encoder input or None); encoder-decoder prompts are parsed by their model state."""
        state = self.llm_engine.model_state
        if getattr(state, "is_encoder_decoder", False):
            return state.parse_prompt(prompt, self._to_token_ids, self.llm_engine.tokenizer)
        return (*self._to_token_ids(prompt), None)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Every prompt is validated before any is added (a bad one raises
        and adds nothing). A sample whose engine step fails comes back with finish_reason "error" and `error` set
        while the others run to the end (vLLM's finish_reason for request-level failures); if the engine dies
        (EngineDeadError, after several failed steps in a row) the call aborts what is left and raises it."""
        if self.runner_type == "pooling":
            raise ValueError(f"{self.llm_engine.model_config.architecture} is an embedding model with no LM head: "
                             "it cannot generate text; use LLM.embed")
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
        ids_in_order = []
        try:
            for children in prepared:
                engine.add_prepared(children)
                ids_in_order.append(children[0].group_id)
        except BaseException:
            _discard(engine, ids_in_order)
            raise
        return self._run(ids_in_order, use_tqdm and not envs.STATESERVE_DISABLE_TQDM)

    def embed(self, prompts: PromptType | Sequence[PromptType], truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One pooled (and, as the model folder asks, normalised) vector per prompt. A prompt is text or a dict
        with 'prompt' / 'prompt_token_ids' and optional 'token_type_ids'; truncate_prompt_tokens=k keeps the
        last k tokens (-1: the model's limit)."""
        if self.runner_type != "pooling":
            raise ValueError(f"{self.llm_engine.model_config.architecture} has no pooling head: LLM.embed needs an "
                             "embedding model (BertModel, RobertaModel, XLMRobertaModel)")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        return self.llm_engine.embed(list(prompts), truncate_prompt_tokens,
                                     use_tqdm and not envs.STATESERVE_DISABLE_TQDM)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
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
                        num_out += sum(len(o.token_ids) for o in out.outputs)
                        elapsed = max(time.perf_counter() - start, 1e-9)
                        bar.set_postfix_str(f"input: {num_in / elapsed:.1f} toks/s, output: "
                                            f"{num_out / elapsed:.1f} toks/s")
                        bar.update(1)
        except BaseException:  # interrupted, or the engine died: leave no half-run request holding caches
            _discard(engine, [gid for gid in ids if gid not in results])
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


def _discard(engine: LLMEngine, group_ids: list[str]) -> None:
    """Abort these request groups and drop their records."""
    for gid in group_ids:
        if gid in engine.groups:
            engine.abort_request(gid)
            engine.pop_output(gid)


def _shutdown_ref(ref: "weakref.ref[LLM]") -> None:
    llm = ref()
    if llm is not None:
        llm.shutdown()
