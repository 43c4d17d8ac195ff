"""Runs the throughput workloads on stateserve's offline API (started by bench/throughput.py with the project's
own Python, in a process of its own so that every engine gets the same threads and a fresh heap)."""
from __future__ import annotations

import os
import sys
import time

from protocol import load_job, run_workloads, set_threads_env


def main() -> None:
    job, result_path = load_job()
    set_threads_env(job["threads"])
    os.environ.setdefault("STATESERVE_DISABLE_TQDM", "1")
    import torch

    torch.set_num_threads(job["threads"])
    sys.path.insert(0, job["repo"])
    import stateserve
    from stateserve import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(job["model"], dtype=job["dtype"], skip_tokenizer_init=True, max_model_len=job["max_model_len"],
              seed=0, **job.get("engine_kwargs", {}))
    load_s = time.perf_counter() - start

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        params = [SamplingParams(ignore_eos=True, temperature=0.0, max_tokens=m) for m in max_tokens]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    run_workloads(job, result_path, "stateserve", getattr(stateserve, "__version__", "dev"), load_s, generate)
    llm.shutdown()


if __name__ == "__main__":
    main()
