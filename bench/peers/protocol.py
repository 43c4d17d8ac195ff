"""The job/result protocol shared by every engine runner (standard library only: peers run it under their own
Pythons, which have none of stateserve's packages).

A runner is started as `PYTHON RUNNER job.json result.json`. The job names the model folder, dtype, thread count
and the workloads, each a list of prompts (token ids) with the exact number of tokens each must generate. The
runner rewrites result.json after every workload, so a run killed by its timeout still reports what it finished.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Callable

# generate(prompts, max_tokens) -> the generated token ids of each request, in order
GenerateFn = Callable[[list[list[int]], list[int]], list[list[int]]]

WARMUP_PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32]]
WARMUP_MAX_TOKENS = [4, 6]


def load_job() -> tuple[dict, str]:
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} JOB.json RESULT.json")
    with open(sys.argv[1]) as f:
        return json.load(f), sys.argv[2]


def write_result(path: str, result: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)  # never leave a half-written file for the parent to read after a kill


def useful_tokens(prompts: list[list[int]], max_tokens: list[int], outputs: list[list[int]]) -> tuple[int, int, int]:
    """(prompt tokens, output tokens, requests short of their max_tokens); tokens past max_tokens never count."""
    out = sum(min(len(o), m) for o, m in zip(outputs, max_tokens))
    short = sum(len(o) < m for o, m in zip(outputs, max_tokens)) + max(0, len(prompts) - len(outputs))
    return sum(len(p) for p in prompts), out, short


def run_workloads(job: dict, result_path: str, engine: str, version: str, load_s: float,
                  generate: GenerateFn, extra: dict | None = None,
                  prepare: Callable[[list[list[int]], list[int]], None] | None = None) -> dict:
    """Warm up once, then time each workload `job["repeats"]` times and keep the fastest run.
    `prepare`, if given, runs untimed before the warm-up and before each workload (e.g. to size a context)."""
    result = {"engine": engine, "version": version, "load_s": load_s, "workloads": {}, **(extra or {})}
    write_result(result_path, result)
    start = time.perf_counter()
    if prepare is not None:
        prepare(WARMUP_PROMPTS, WARMUP_MAX_TOKENS)
    generate(WARMUP_PROMPTS, WARMUP_MAX_TOKENS)  # first-call costs (kernel builds, allocator growth) stay out
    result["warmup_s"] = time.perf_counter() - start
    for name, work in job["workloads"].items():
        prompts, max_tokens = work["prompts"], work["max_tokens"]
        entry: dict = {"runs_s": []}
        try:
            if prepare is not None:
                prepare(prompts, max_tokens)
            for _ in range(max(1, job.get("repeats", 1))):
                start = time.perf_counter()
                outputs = generate(prompts, max_tokens)
                entry["runs_s"].append(time.perf_counter() - start)
            entry["elapsed_s"] = min(entry["runs_s"])
            entry["prompt_tokens"], entry["output_tokens"], entry["short_requests"] = \
                useful_tokens(prompts, max_tokens, outputs)
            entry["first_output"] = outputs[0][:max_tokens[0]] if outputs else []
            if job.get("keep_outputs"):  # every request's tokens, for checks on small jobs
                entry["outputs"] = [o[:m] for o, m in zip(outputs, max_tokens)]
        except Exception as e:  # one workload failing (unsupported shape, OOM) must not lose the others
            entry["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        result["workloads"][name] = entry
        write_result(result_path, result)
    return result


def set_threads_env(threads: int) -> None:
    """Before importing torch/ggml: every OpenMP pool in the process gets the same number of threads."""
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("MKL_NUM_THREADS", str(threads))
