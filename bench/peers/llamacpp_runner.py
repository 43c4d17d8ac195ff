"""Runs the throughput workloads on llama.cpp through llama-cpp-python's low-level bindings, under that venv's
Python. The high-level `Llama` class serves one sequence at a time, so this runner batches the way llama.cpp's
own server does: up to `n_seq_max` sequences share every llama_decode call, each decoding sequence adds its
one new token and prompts fill the rest of the n_batch token budget (chunked prefill); a finished sequence's
slot is cleared and given to the next waiting request. Sampling is greedy (argmax of the returned logits).

A context is sized per workload, outside the timed region: n_seq_max = concurrent requests, room for each
of them to reach that workload's longest request, and by default one KV buffer shared by all sequences
(kv_unified; job["llamacpp_kv_unified"] = False gives each sequence its own stream instead, which measured
about 2x slower on the small serve workload).
"""
from __future__ import annotations

import ctypes
import time
from collections import deque

from protocol import load_job, run_workloads, set_threads_env

MAX_PARALLEL = 64  # as many sequences at once as stateserve's default max_num_seqs
N_BATCH = 2048  # tokens per llama_decode call, stateserve's default max_num_batched_tokens


def main() -> None:
    job, result_path = load_job()
    set_threads_env(job["threads"])
    import llama_cpp as lc
    import numpy as np

    lc.llama_backend_init()
    start = time.perf_counter()
    mparams = lc.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model = lc.llama_model_load_from_file(job["gguf"].encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {job['gguf']}")
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    load_s = time.perf_counter() - start
    state: dict = {"ctx": None, "batch": None}

    def prepare(prompts: list[list[int]], max_tokens: list[int]) -> None:
        """A fresh context whose per-sequence KV stream holds this workload's longest request."""
        if state["ctx"] is not None:
            lc.llama_batch_free(state["batch"])
            lc.llama_free(state["ctx"])
        n_seq = min(len(prompts), MAX_PARALLEL)
        per_seq = (max(len(p) + m for p, m in zip(prompts, max_tokens)) // 256 + 1) * 256
        cparams = lc.llama_context_default_params()
        cparams.n_ctx, cparams.n_seq_max = n_seq * per_seq, n_seq
        cparams.kv_unified = job.get("llamacpp_kv_unified", True)
        cparams.n_batch, cparams.n_ubatch = N_BATCH, min(N_BATCH, 512)
        cparams.n_threads = cparams.n_threads_batch = job["threads"]
        ctx = lc.llama_init_from_model(model, cparams)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context")
        state.update(ctx=ctx, batch=lc.llama_batch_init(N_BATCH, 0, 1), n_seq=n_seq, mem=lc.llama_get_memory(ctx))

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        ctx, batch, mem = state["ctx"], state["batch"], state["mem"]
        waiting = deque(range(len(prompts)))
        free_slots = list(range(state["n_seq"]))
        running: dict[int, dict] = {}  # slot -> {req, fed (prompt tokens in the cache), out}
        outputs: list[list[int]] = [[] for _ in prompts]
        while waiting or running:
            while waiting and free_slots:
                running[free_slots.pop()] = {"req": waiting.popleft(), "fed": 0, "out": []}
            n, wants_logits = 0, []  # wants_logits: (batch index, slot)

            def add(token: int, pos: int, slot: int, logits: bool) -> None:
                nonlocal n
                batch.token[n], batch.pos[n], batch.n_seq_id[n] = token, pos, 1
                batch.seq_id[n][0], batch.logits[n] = slot, logits
                if logits:
                    wants_logits.append((n, slot))
                n += 1

            for slot, seq in running.items():  # decoding sequences first: one token each
                prompt = prompts[seq["req"]]
                if seq["fed"] == len(prompt):
                    add(seq["out"][-1], len(prompt) + len(seq["out"]) - 1, slot, True)
            for slot, seq in running.items():  # then prompt chunks, as far as the budget goes
                prompt = prompts[seq["req"]]
                take = min(len(prompt) - seq["fed"], N_BATCH - n)
                for k in range(seq["fed"], seq["fed"] + take):
                    add(prompt[k], k, slot, k == len(prompt) - 1)
                seq["fed"] += take
            batch.n_tokens = n
            if lc.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed (context full?)")
            for index, slot in wants_logits:
                seq = running[slot]
                logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, index), shape=(n_vocab,))
                seq["out"].append(int(logits.argmax()))
                if len(seq["out"]) == max_tokens[seq["req"]]:  # done: its slot goes to the next request
                    outputs[seq["req"]] = seq["out"]
                    lc.llama_memory_seq_rm(mem, slot, -1, -1)
                    del running[slot]
                    free_slots.append(slot)
        return outputs

    run_workloads(job, result_path, "llama.cpp", lc.__version__, load_s, generate, prepare=prepare,
                  extra={"max_parallel": MAX_PARALLEL, "n_batch": N_BATCH,
                         "kv_unified": job.get("llamacpp_kv_unified", True)})


if __name__ == "__main__":
    main()
