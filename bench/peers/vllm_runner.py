"""Runs the throughput workloads on vLLM's offline API (CPU build), under vLLM's own Python.

vLLM starts its engine core in a separate process, so everything happens under `if __name__ == "__main__":`.
The parent sets VLLM_CPU_OMP_THREADS_BIND (which cores vLLM's OpenMP threads are pinned to) and
VLLM_CPU_KVCACHE_SPACE (GiB of KV cache) before starting this script."""
from __future__ import annotations

import os
import time

from protocol import load_job, run_workloads


def main() -> None:
    job, result_path = load_job()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{job['threads'] - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import vllm
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=job["model"], dtype=job["dtype"], skip_tokenizer_init=True, max_model_len=job["max_model_len"],
              seed=0, **job.get("engine_kwargs", {}))
    load_s = time.perf_counter() - start

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        params = [SamplingParams(ignore_eos=True, temperature=0.0, max_tokens=m, detokenize=False)
                  for m in max_tokens]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    run_workloads(job, result_path, "vllm", vllm.__version__, load_s, generate)


if __name__ == "__main__":
    main()
