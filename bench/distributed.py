"""Tensor, pipeline and data parallelism beside one rank, on this machine (docs/distributed.md).

Offline, per model: one request's decode (latency, ms per token) and a batch of requests (throughput), for one
rank (all the cores), tensor_parallel_size=2, pipeline_parallel_size=2 and both (each rank gets its share of the
cores);
plus the time rank 0 spends per step in collectives (broadcast of the step, all-reduces, stage transfers) and how
many it runs. Served: bench/serve.py's streamed load against `stateserve serve` with --data-parallel-size 1 and 2.
Each configuration runs in its own process; ratios are against one rank in the same run.

    python bench/distributed.py --models llama,mamba2 --size 30m
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {"tp1": {}, "tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2},
           "tp2pp2": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}}  # a grid: 2 stages of 2 ranks


def _comm(runner) -> tuple[float, int]:
    """Rank 0's time in collectives and their count so far: its whole group's and, in a grid, its stage's
    tensor-parallel subgroup's."""
    groups = {id(g): g for g in (runner.group, runner.tensor_group) if g is not None}.values()
    return sum(g.comm_seconds for g in groups), sum(g.num_collectives for g in groups)


def run_one(model: str, config: str, dtype: str, new_tokens: int, batch: int) -> dict:
    """One configuration's numbers (this runs in a child process)."""
    import random

    from stateserve import LLM, SamplingParams

    rng = random.Random(0)
    with LLM(model, dtype=dtype, skip_tokenizer_init=True, enable_prefix_caching=False,
             kv_cache_memory_bytes=1 << 30, **CONFIGS[config]) as llm:
        runner = llm.llm_engine.runner
        steps = [0]
        execute = runner.execute

        def counted(sched):
            steps[0] += 1
            return execute(sched)

        runner.execute = counted
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=4, ignore_eos=True),
                     use_tqdm=False)  # warm-up
        out = {}
        for name, count in (("decode", 1), ("batch", batch)):
            prompts = [{"prompt_token_ids": [rng.randrange(3, 1000) for _ in range(32)]} for _ in range(count)]
            comm0, coll0 = _comm(runner)
            steps[0] = 0
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            comm1, coll1 = _comm(runner)
            comm = (comm1 - comm0, coll1 - coll0)
            out[name] = {"tokens_per_s": round(count * new_tokens / elapsed, 2),
                         "ms_per_step": round(1000 * elapsed / steps[0], 3), "steps": steps[0],
                         "comm_ms_per_step": round(1000 * comm[0] / steps[0], 3),
                         "collectives_per_step": round(comm[1] / steps[0], 1)}
    return out


def run_served(model: str, dp: int, dtype: str, log_dir: str) -> dict:
    log_dir = os.path.abspath(log_dir)
    os.makedirs(log_dir, exist_ok=True)
    report = os.path.join(log_dir, f"serve-dp{dp}.json")
    cmd = [sys.executable, os.path.join(REPO, "bench", "serve.py"), model, "--num-prompts", "32", "--concurrency",
           "8", "--input-len", "64", "--output-len", "32", "--dtype", dtype, "--output", report, "--log-dir", log_dir,
           "--server-args", f"--data-parallel-size {dp} --kv-cache-memory-bytes {1 << 30}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=1800)
    with open(report) as f:
        res = json.load(f)["results"]["stateserve"]
    return {k: res[k] for k in ("output_throughput", "ttft_p50_ms", "itl_p50_ms", "e2e_mean_ms")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama,mamba2", help="kinds of bench/common.py, comma-separated")
    p.add_argument("--size", default="30m", choices=["small", "30m", "base"])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {', '.join(CONFIGS)} (tp1 first: the "
                   "ratios' base)")
    p.add_argument("--no-serve", action="store_true", help="skip the data-parallel serving runs")
    p.add_argument("--output", default=os.path.join(REPO, "bench", "results", "distributed.json"))
    p.add_argument("--child", nargs=2, metavar=("MODEL", "CONFIG"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run_one(args.child[0], args.child[1], args.dtype, args.new_tokens, args.batch)))
        return 0
    import torch

    report = {"machine": common.machine(), "size": args.size, "dtype": args.dtype, "models": {}}
    print(f"CPU: {report['machine']['cpu']}, {os.cpu_count()} CPUs")
    for kind in args.models.split(","):
        folder = common.model_folder(kind, args.size, getattr(torch, args.dtype))
        rows = report["models"][kind] = {}
        for config in args.configs.split(","):
            cmd = [sys.executable, __file__, "--child", folder, config, "--dtype", args.dtype, "--new-tokens",
                   str(args.new_tokens), "--batch", str(args.batch)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600,
                                  env={**os.environ, "STATESERVE_DISABLE_TQDM": "1"})
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            rows[config] = json.loads(line[7:]) if line else {"error": done.stderr[-2000:]}
        for config, row in rows.items():
            if "error" in row:
                print(f"{kind} {config}: failed\n{row['error']}")
                continue
            for work, r in row.items():
                base = rows.get("tp1", {}).get(work, {}).get("tokens_per_s")
                ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
                print(f"{kind:8} {config:4} {work:6} {r['tokens_per_s']:9.1f} tok/s ({ratio} of tp1)  "
                      f"{r['ms_per_step']:8.2f} ms/step  comm {r['comm_ms_per_step']:7.2f} ms/step in "
                      f"{r['collectives_per_step']:.0f} collectives")
        if not args.no_serve:
            served = rows["serve"] = {f"dp{dp}": run_served(folder, dp, args.dtype, os.path.dirname(args.output))
                                      for dp in (1, 2)}
            for name, r in served.items():
                print(f"{kind:8} serve {name}: {r['output_throughput']:.1f} output tok/s "
                      f"({r['output_throughput'] / served['dp1']['output_throughput']:.2f}x of dp1), TTFT p50 "
                      f"{r['ttft_p50_ms']:.1f} ms, ITL p50 {r['itl_p50_ms']:.1f} ms")
    common.write_json(args.output, report)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
