"""Prefix-cache benchmark: time to first token cold vs warm for a 2048-token prompt whose first 1920 tokens
are shared, and the hit rate of a multi-turn chat workload, for each model kind and mamba_cache_mode.

    python bench/prefix_cache.py [--size small|base] [--kinds llama,mamba,mamba2,jamba] [--out bench/results]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, model_folder, write_json  # noqa: E402

from stateserve import LLM, ModelRegistry, SamplingParams  # noqa: E402

ARCH = {"llama": "LlamaForCausalLM", "mamba": "MambaForCausalLM", "mamba2": "Mamba2ForCausalLM",
        "jamba": "JambaForCausalLM", "bamba": "BambaForCausalLM"}


def toks(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, ignore_eos=True),
                       use_tqdm=False)[0]
    return time.perf_counter() - start, out.num_cached_tokens


def chat_hit_rate(llm: LLM, rng: random.Random, vocab: int, turns: int = 6, users: int = 3) -> float:
    eng = llm.llm_engine
    q0, h0 = eng.cache.num_queried_tokens, eng.cache.num_hit_tokens
    histories = [toks(rng, 200, vocab) for _ in range(users)]
    for _ in range(turns):
        for u in range(users):
            out = llm.generate([{"prompt_token_ids": histories[u]}],
                               SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)[0]
            histories[u] = histories[u] + out.outputs[0].token_ids + toks(rng, 40, vocab)
    return (eng.cache.num_hit_tokens - h0) / max(1, eng.cache.num_queried_tokens - q0)


def bench_kind(kind: str, size: str, mode: str | None) -> dict:
    path = model_folder(kind, size)
    kw = dict(skip_tokenizer_init=True, max_num_batched_tokens=2048, max_model_len=4096)
    if mode:
        kw["mamba_cache_mode"] = mode
    with LLM(path, **kw) as llm:
        vocab = llm.llm_engine.model_config.vocab_size
        rng = random.Random(0)
        shared = toks(rng, 1920, vocab)
        ttft(llm, toks(rng, 64, vocab))  # warm-up
        cold_t, _ = ttft(llm, shared + toks(rng, 128, vocab))
        warm_t, hit = ttft(llm, shared + toks(rng, 128, vocab))
        llm.llm_engine.cache.reset_prefix_cache()
        rate = chat_hit_rate(llm, rng, vocab)
    return {"kind": kind, "mode": mode or "-", "cold_ttft_s": cold_t, "warm_ttft_s": warm_t,
            "warm_over_cold": warm_t / cold_t, "warm_cached_tokens": hit, "chat_hit_rate": rate}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="small", choices=["small", "base"])
    ap.add_argument("--kinds", default="llama,mamba,mamba2,jamba,bamba")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    rows = []
    for kind in args.kinds.split(","):
        if not ModelRegistry.is_registered(ARCH[kind]):
            print(f"skip {kind}: not supported in this build")
            continue
        for mode in ([None] if kind == "llama" else ["all", "align"]):
            rows.append(bench_kind(kind, args.size, mode))
            r = rows[-1]
            print(f"{r['kind']:7s} {r['mode']:5s} cold {r['cold_ttft_s'] * 1e3:8.1f} ms  warm "
                  f"{r['warm_ttft_s'] * 1e3:7.1f} ms  ratio {r['warm_over_cold']:.3f}  cached "
                  f"{r['warm_cached_tokens']:5d}  chat hit rate {r['chat_hit_rate']:.3f}", flush=True)
    write_json(os.path.join(args.out, "prefix_cache.json"), {"machine": machine(), "size": args.size, "rows": rows})


if __name__ == "__main__":
    main()
