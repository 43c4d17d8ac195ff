"""Serving benchmark: a bounded, seeded load against an OpenAI-compatible /v1/completions endpoint.

Starts `stateserve serve MODEL` (or uses --base-url), sends --num-prompts streamed requests either at a
Poisson --request-rate or with a fixed --concurrency, and reports throughput, TTFT and ITL percentiles as a
table and as JSON. Prompts are random token ids and every request sets ignore_eos, so prompt and output
lengths are exactly the seeded draws on any server. With --vllm-python PATH it also starts vLLM's own
server on the same model, runs the same load, and prints stateserve/vLLM ratios.

    python bench/serve.py MODEL --num-prompts 64 --concurrency 8 --input-len 128 --output-len 64
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

try:
    import httpx2 as httpx  # what the pinned openai client depends on
except ImportError:  # pragma: no cover - other environments
    import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Result:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""


def draw_lengths(rng: random.Random, mean: int, spread: float) -> int:
    """Uniform in mean * [1 - spread, 1 + spread], at least 1."""
    return max(1, round(rng.uniform(mean * (1 - spread), mean * (1 + spread))))


def make_workload(args: argparse.Namespace, vocab_size: int, seed: int | None = None) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed if seed is None else seed)
    lo, hi = min(10, vocab_size - 1), max(11, vocab_size - 10)  # keep clear of special ids at either end
    work = []
    for _ in range(args.num_prompts):
        n_in = draw_lengths(rng, args.input_len, args.length_spread)
        work.append(([rng.randrange(lo, hi) for _ in range(n_in)], draw_lengths(rng, args.output_len,
                                                                                 args.length_spread)))
    return work


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int,
                      timeout: float) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    res = Result(ok=False, prompt_len=len(prompt))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data.strip() == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if res.ttft is None:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
        res.latency = time.perf_counter() - start
        res.ok = res.ttft is not None
    except (httpx.HTTPError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        res.error = repr(e)
    return res


async def run_load(base_url: str, model: str, work: list[tuple[list[int], int]], args: argparse.Namespace
                   ) -> tuple[list[Result], float]:
    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=max(64, args.concurrency or 0), max_keepalive_connections=64)
    rng = random.Random(args.seed + 1)
    async with httpx.AsyncClient(limits=limits) as client:
        for prompt, _ in args.warmup_work:  # not measured; prompts of their own, so no prefix-cache hits later
            await one_request(client, url, model, prompt, 4, args.request_timeout)
        sem = asyncio.Semaphore(args.concurrency) if args.concurrency else None

        async def limited(prompt: list[int], max_tokens: int) -> Result:
            if sem is None:
                return await one_request(client, url, model, prompt, max_tokens, args.request_timeout)
            async with sem:
                return await one_request(client, url, model, prompt, max_tokens, args.request_timeout)

        start = time.perf_counter()
        tasks = []
        for prompt, max_tokens in work:
            tasks.append(asyncio.ensure_future(limited(prompt, max_tokens)))
            if args.request_rate and args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))  # Poisson arrivals
        results = await asyncio.wait_for(asyncio.gather(*tasks), args.max_duration)
        return list(results), time.perf_counter() - start


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens or (len(r.itl) + 1) for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    ttft = [r.ttft for r in ok]
    itl = [x for r in ok for x in r.itl]

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1000, 3)

    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": round(duration, 3),
        "request_throughput": round(len(ok) / duration, 3), "output_throughput": round(out_tokens / duration, 2),
        "total_token_throughput": round((in_tokens + out_tokens) / duration, 2),
        "ttft_p50_ms": ms(percentile(ttft, 50)), "ttft_p99_ms": ms(percentile(ttft, 99)),
        "itl_p50_ms": ms(percentile(itl, 50)), "itl_p99_ms": ms(percentile(itl, 99)),
        "e2e_mean_ms": ms(statistics.fmean(r.latency for r in ok) if ok else None),
        "first_error": next((r.error for r in results if not r.ok), None),
    }


def has_tokenizer(folder: str) -> bool:
    return any(os.path.exists(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer.model",
                                                                   "tokenizer_config.json"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cmd: list[str], base_url: str, timeout: float, log_path: str,
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"server not healthy after {timeout:.0f} s; see {log_path}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def bench_server(name: str, cmd: list[str] | None, base_url: str, works, args,
                 env: dict[str, str] | None = None) -> dict:
    """Runs each workload of `works` in turn against one server; returns the medians of every metric, with each
    run's own summary under "runs"."""
    log_path = f"{args.log_dir}/{name}_server.log"
    proc = start_server(cmd, base_url, args.startup_timeout, log_path, env) if cmd else None
    runs = []
    try:
        for work in works:
            results, duration = asyncio.run(run_load(base_url, args.served_model_name, work, args))
            runs.append(summarize(results, duration))
    finally:
        if proc is not None:
            stop_server(proc)
    if len(runs) == 1:
        return runs[0]
    merged: dict = {}
    for k in runs[0]:
        values = [r[k] for r in runs]
        if k in ("completed", "failed"):
            merged[k] = sum(values)
        elif all(isinstance(v, (int, float)) for v in values):
            merged[k] = round(statistics.median(values), 3)
        else:
            merged[k] = next((v for v in values if v is not None), None)
    merged["runs"] = runs
    return merged


ROWS = [("completed", "requests completed"), ("failed", "requests failed"), ("duration_s", "duration (s)"),
        ("request_throughput", "requests/s"), ("output_throughput", "output tokens/s"),
        ("total_token_throughput", "total tokens/s"), ("ttft_p50_ms", "TTFT p50 (ms)"),
        ("ttft_p99_ms", "TTFT p99 (ms)"), ("itl_p50_ms", "ITL p50 (ms)"), ("itl_p99_ms", "ITL p99 (ms)"),
        ("e2e_mean_ms", "latency mean (ms)")]


def print_table(reports: dict[str, dict]) -> None:
    names = list(reports)
    cols = names + (["stateserve/vllm"] if len(names) == 2 else [])
    print(f"{'metric':<22}" + "".join(f"{c:>18}" for c in cols))
    for key, label in ROWS:
        vals = [reports[n].get(key) for n in names]
        cells = [f"{'-' if v is None else v:>18}" for v in vals]
        if len(names) == 2:
            a, b = vals
            cells.append(f"{(a / b if a is not None and b else float('nan')):>18.3f}")
        print(f"{label:<22}" + "".join(cells))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="Hugging Face model folder (used to start the servers and read vocab_size)")
    p.add_argument("--base-url", default=None, help="benchmark an already running server instead")
    p.add_argument("--served-model-name", default="bench-model")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second")
    p.add_argument("--concurrency", type=int, default=None, help="requests in flight at once")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--length-spread", type=float, default=0.25, help="lengths drawn uniformly in mean*(1±s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per server (each with prompts of its own seed); the report holds the medians")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--max-duration", type=float, default=1800.0, help="hard bound on one load run (s)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights and compute dtype for every server: vLLM's own 'auto' silently downcasts float32 "
                        "folders to bfloat16, so the dtype is always passed explicitly")
    p.add_argument("--server-args", default="", help="extra `stateserve serve` flags, one shell string")
    p.add_argument("--vllm-python", default=None, help="python with vLLM installed: also bench vLLM's server")
    p.add_argument("--vllm-args", default="", help="extra vLLM server flags, one shell string")
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--output", default=None, help="also write the JSON report here")
    args = p.parse_args(argv)
    if not args.request_rate and not args.concurrency:
        args.concurrency = 8
    if args.num_prompts < 1 or args.num_prompts > 100_000:
        p.error("--num-prompts must be in [1, 100000]")
    with open(os.path.join(args.model, "config.json")) as f:
        cfg = json.load(f)
    vocab = int(cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size"))
    if not 1 <= args.repeats <= 20:
        p.error("--repeats must be in [1, 20]")
    # Repeats draw new prompts, so no run is served from the prefix cache of an earlier one.
    works = [make_workload(args, vocab, args.seed + 1000 * r) for r in range(args.repeats)]
    warmup = random.Random(args.seed - 1)
    args.warmup_work = [([warmup.randrange(10, max(11, vocab - 10)) for _ in range(16)], 4) for _ in range(2)]

    reports: dict[str, dict] = {}
    if args.base_url:
        reports["server"] = bench_server("server", None, args.base_url, works, args)
    else:
        port = free_port()
        cmd = [sys.executable, "-m", "stateserve.entrypoints.cli", "serve", args.model, "--port", str(port),
               "--served-model-name", args.served_model_name, "--uvicorn-log-level", "warning",
               "--skip-tokenizer-init", "--dtype", args.dtype, *shlex.split(args.server_args)]
        reports["stateserve"] = bench_server("stateserve", cmd, f"http://127.0.0.1:{port}", works, args)
    if args.vllm_python:
        port = free_port()
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
               "--host", "127.0.0.1", "--port", str(port), "--served-model-name", args.served_model_name,
               "--dtype", args.dtype, *shlex.split(args.vllm_args)]
        if not has_tokenizer(args.model):  # the benchmark sends token ids; vLLM cannot load a missing tokenizer
            cmd.append("--skip-tokenizer-init")
        # vLLM's CPU backend sizes its KV cache from VLLM_CPU_KVCACHE_SPACE; without it, it asks for 92% of the
        # NUMA node's memory and refuses to start on a machine where anything else runs
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
        try:
            reports["vllm"] = bench_server("vllm", cmd, f"http://127.0.0.1:{port}", works, args, env)
        except RuntimeError as e:  # keep stateserve's numbers even when the peer does not start
            print(f"vLLM server failed: {e}", file=sys.stderr)
    print_table(reports)
    report = {"config": {k: v for k, v in vars(args).items() if k not in ("output", "warmup_work")},
              "results": reports}
    if "stateserve" in reports and "vllm" in reports:
        report["ratios"] = {k: (reports["stateserve"][k] / reports["vllm"][k]
                                if reports["stateserve"][k] is not None and reports["vllm"][k] else None)
                            for k, _ in ROWS[3:]}
    print(json.dumps(report, indent=2))
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if all(r["failed"] == 0 for r in reports.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
