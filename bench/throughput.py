"""Offline throughput: stateserve against transformers (and vLLM, llama.cpp when their Pythons are given) on the
same random-weight models, same prompts, same exact output lengths, greedy, eos ignored.

Workloads (fixed seeds): decode = one request, 32-token prompt, 128 new tokens (single-stream decode speed);
serve = 64 requests, prompts 32-512 and outputs 16-256 tokens (serving throughput); prefill = one 4096-token
prompt, 1 new token. --size small shrinks the models and the workloads for a quick end-to-end smoke run.
Each engine runs in its own process (bench/peers/*_runner.py) under a timeout; only useful tokens count
(no padding, nothing past a request's max_tokens).

    python bench/throughput.py [--models llama,mamba2,mamba] [--dtypes float32,bfloat16]
        [--workloads decode,serve,prefill] [--size base|1b|small] [--vllm-python /opt/peers/vllm/bin/python]
        [--llamacpp-python /opt/peers/llamacpp/bin/python --llamacpp-convert .../convert_hf_to_gguf.py]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)
import machine_limits  # noqa: E402
from common import KINDS, machine, model_folder, write_json  # noqa: E402
from plot import plot  # noqa: E402

PEERS = os.path.join(BENCH, "peers")
ENGINES = ("stateserve", "transformers", "vllm", "llamacpp")
RUNNERS = {"stateserve": "stateserve_runner.py", "transformers": "hf_runner.py", "vllm": "vllm_runner.py",
           "llamacpp": "llamacpp_runner.py"}
SHORT = {"stateserve": "ss", "transformers": "tf", "vllm": "vllm", "llamacpp": "lcpp"}
UNSUPPORTED = {("vllm", "mamba"): "vLLM's CPU backend has no Mamba1"}
# GGUF types (--dtypes q8_0): stateserve and llama.cpp load the same file, converted once by llama.cpp's converter;
# stateserve computes in bfloat16 around its int8 products
# GGUF types: the converter writes Q8_0 itself; the 4-bit files are its float32 file quantized by llama.cpp
QUANT_TYPES = {"q8_0": "q8_0", "q4_0": "q4_0", "q4_k_m": "q4_k_m"}
LOAD_TIME_AS_GGUF = {"int8": "q8_0", "q4_0": "q4_0", "q4_k": "q4_k_m"}  # quantization= methods -> bytes per weight
GGUF_OUTTYPES = {"float32": "f32", "bfloat16": "bf16", "q8_0": "q8_0"}
# Prefix caching off: a repeated timed run must recompute, not hit the cache the first run filled.
ENGINE_KWARGS = {"stateserve": {"enable_prefix_caching": False}, "vllm": {"enable_prefix_caching": False}}
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
# workload -> (seed, requests, prompt length range, output length range, what its tok/s counts)
WORKLOADS = {
    "base": {"decode": (1, 1, (32, 32), (128, 128), "output"), "serve": (2, 64, (32, 512), (16, 256), "output"),
             "prefill": (3, 1, (4096, 4096), (1, 1), "prompt")},
    "1b": {"decode": (1, 1, (32, 32), (128, 128), "output"), "serve": (2, 64, (32, 512), (16, 256), "output"),
           "prefill": (3, 1, (4096, 4096), (1, 1), "prompt")},
    "small": {"decode": (1, 1, (32, 32), (32, 32), "output"), "serve": (2, 16, (32, 128), (8, 48), "output"),
              "prefill": (3, 1, (1024, 1024), (1, 1), "prompt")},
}


def make_workload(size: str, name: str, vocab_size: int) -> dict:
    seed, count, (p_lo, p_hi), (o_lo, o_hi), _ = WORKLOADS[size][name]
    rng = random.Random(seed)
    lo, hi = 10, vocab_size - 10  # clear of special ids at either end of the vocabulary
    prompts = [[rng.randrange(lo, hi) for _ in range(rng.randint(p_lo, p_hi))] for _ in range(count)]
    return {"prompts": prompts, "max_tokens": [rng.randint(o_lo, o_hi) for _ in range(count)]}


def convert_gguf(folder: str, dtype: str, args: argparse.Namespace) -> str:
    """GGUF next to the HF folder, made once per type by llama.cpp's own tools: convert_hf_to_gguf.py for float
    and Q8_0 files, then llama_model_quantize (bench/peers/llamacpp_quantize.py) on the float32 file for 4-bit."""
    out = f"{folder}-{dtype}.gguf"
    if os.path.isfile(out) and os.path.getmtime(out) >= os.path.getmtime(os.path.join(folder, "config.json")):
        return out
    if dtype not in GGUF_OUTTYPES:
        source = convert_gguf(folder, "float32", args)
        cmd = [args.llamacpp_python, os.path.join(PEERS, "llamacpp_quantize.py"), source, out + ".part", dtype]
    elif not args.llamacpp_convert:
        raise RuntimeError("--llamacpp-convert PATH/convert_hf_to_gguf.py is needed to make the GGUF")
    else:
        cmd = [args.convert_python, os.path.join(PEERS, "gguf_convert.py"), args.llamacpp_convert, folder,
               out + ".part", GGUF_OUTTYPES[dtype]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"GGUF conversion failed:\n{proc.stderr[-3000:]}")
    os.replace(out + ".part", out)
    return out


def vllm_preload(python: str, mode: str) -> str:
    """What vLLM's CPU guide preloads for its best speed (tcmalloc, Intel OpenMP), where present."""
    if mode == "none":
        return ""
    venv_lib = os.path.join(os.path.dirname(os.path.dirname(python)), "lib", "libiomp5.so")
    return ":".join(p for p in (TCMALLOC, venv_lib) if os.path.isfile(p))


def run_engine(engine: str, job: dict, python: str, log_path: str, timeout: float, preload: str = "") -> dict:
    """One engine's process over every workload; a timeout or crash keeps what it wrote so far."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS=str(job["threads"]), PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    if engine == "vllm":
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{job['threads'] - 1}", VLLM_CPU_KVCACHE_SPACE="2")
        if preload:
            env["LD_PRELOAD"] = preload
    with tempfile.TemporaryDirectory() as tmp:
        job_path, result_path = os.path.join(tmp, "job.json"), os.path.join(tmp, "result.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        error = None
        with open(log_path, "w") as log:
            # a session of its own, so a timeout also ends the processes the engine started (vLLM's core)
            proc = subprocess.Popen([python, os.path.join(PEERS, RUNNERS[engine]), job_path, result_path],
                                    cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
                if rc != 0:
                    error = f"exited with {rc} (see {log_path})"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                error = f"timed out after {timeout:.0f} s (see {log_path})"
        result = {"engine": engine, "workloads": {}}
        if os.path.isfile(result_path):
            with open(result_path) as f:
                result = json.load(f)
    if error:
        result["error"] = error
        for name in job["workloads"]:
            result["workloads"].setdefault(name, {"error": error})
    return result


def tok_per_s(entry: dict, counts: str) -> float | None:
    if "elapsed_s" not in entry:
        return None
    return entry[f"{counts}_tokens"] / entry["elapsed_s"]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def engine_kwargs(engine: str, args: argparse.Namespace) -> dict:
    """LLM(...) keyword arguments of an engine's runner: the defaults above, plus --stateserve-arg for ours."""
    kwargs = dict(ENGINE_KWARGS.get(engine, {}))
    if engine == "stateserve":
        kwargs.update(args.stateserve_kwargs)
    return kwargs


def run_one(engine: str, kind: str, dtype: str, job: dict, args: argparse.Namespace, pythons: dict,
            log_dir: str, round_index: int) -> tuple[dict, str | None]:
    """One engine process over every workload -> (its result, why it could not run or None)."""
    try:
        engine_job = dict(job, engine_kwargs=engine_kwargs(engine, args))
        if engine == "llamacpp":
            engine_job["gguf"] = convert_gguf(job["model"], dtype, args)
        elif dtype in QUANT_TYPES:  # stateserve reads the very file llama.cpp runs
            engine_job.update(model=convert_gguf(job["model"], dtype, args), dtype="bfloat16")
            engine_job["llamacpp_kv_unified"] = args.llamacpp_kv_unified == "on"
        suffix = f"-round{round_index + 1}" if round_index else ""
        log_path = os.path.join(log_dir, f"{kind}-{dtype}-{engine}{suffix}.log")
        preload = vllm_preload(args.vllm_python, args.vllm_preload) if engine == "vllm" else ""
        result = run_engine(engine, engine_job, pythons[engine], log_path, args.timeout, preload)
        if preload:
            result["ld_preload"] = preload
    except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
        return {"workloads": {}}, f"{type(e).__name__}: {e}"
    if result.get("error"):
        print(f"    {engine}: {result['error']}", flush=True)
    return result, None


def merge_fastest(old: dict, new: dict, workloads: list[str]) -> dict:
    """Per workload, the faster of two rounds' entries (an entry with an error or short requests never wins)."""
    def speed(entry: dict | None) -> float:
        if not entry or entry.get("error") or entry.get("short_requests") or not entry.get("elapsed_s"):
            return 0.0
        return 1.0 / entry["elapsed_s"]  # the same workload in both: less time is more tokens/s
    merged = dict(old, workloads=dict(old.get("workloads", {})))
    for name in workloads:
        before, entry = old.get("workloads", {}).get(name), new.get("workloads", {}).get(name)
        # every round's time stays on record (None: that round did not run the workload), not only the winner's
        history = (before or {}).get("round_elapsed_s") or [(before or {}).get("elapsed_s")]
        if entry is not None and speed(entry) > speed(merged["workloads"].get(name)):
            merged["workloads"][name] = entry
        if name in merged["workloads"]:
            merged["workloads"][name] = dict(merged["workloads"][name], rounds=len(history) + 1,
                                             round_elapsed_s=history + [(entry or {}).get("elapsed_s")])
    return merged


def bench_one(kind: str, dtype: str, engines: list[str], args: argparse.Namespace, limits: dict,
              log_dir: str) -> list[dict]:
    folder = model_folder(kind, args.size)
    with open(os.path.join(folder, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    workloads = {w: make_workload(args.size, w, vocab_size) for w in args.workloads}
    longest = max(len(p) + m for w in workloads.values() for p, m in zip(w["prompts"], w["max_tokens"]))
    job = {"model": folder, "dtype": dtype, "threads": args.threads, "repeats": args.repeats, "repo": REPO,
           "max_model_len": (longest // 256 + 1) * 256, "workloads": workloads}
    pythons = {"stateserve": sys.executable, "transformers": sys.executable, "vllm": args.vllm_python,
               "llamacpp": args.llamacpp_python}
    # load-time quantization (--stateserve-arg quantization=...) reads about the bytes of the same GGUF type
    loaded_as = LOAD_TIME_AS_GGUF.get(args.stateserve_kwargs.get("quantization"), dtype)
    roof = machine_limits.decode_roofline(folder, loaded_as, limits)
    unsupported = {e: UNSUPPORTED[(e, kind)] for e in engines if (e, kind) in UNSUPPORTED}
    if dtype in QUANT_TYPES:
        unsupported.update({e: f"{dtype}: only stateserve and llama.cpp read GGUF files here" for e in engines
                            if e not in ("stateserve", "llamacpp")})
    results: dict[str, dict] = {}
    reasons: dict[str, str | None] = dict(unsupported)
    for round_index in range(args.rounds):
        # Later rounds run the engines in reverse order (and only --round-engines): each engine is timed at other
        # moments of the run, so a slow spell of the machine does not land on one engine alone.
        order = engines if round_index % 2 == 0 else engines[::-1]
        for engine in order:
            if engine in unsupported or (round_index and engine not in args.round_engines):
                continue
            label = f" (round {round_index + 1} of {args.rounds})" if args.rounds > 1 else ""
            print(f"  {kind} {dtype}: {engine}{label} ...", flush=True)
            result, reason = run_one(engine, kind, dtype, job, args, pythons, log_dir, round_index)
            if engine not in results:
                results[engine], reasons[engine] = result, reason
            elif reason is None:  # each workload keeps its fastest round; a round that could not run changes nothing
                results[engine], reasons[engine] = merge_fastest(results[engine], result, args.workloads), None
    rows, outputs = [], {}
    for engine in engines:
        result, reason = results.get(engine, {"workloads": {}}), reasons.get(engine)
        for name in args.workloads:
            entry = result["workloads"].get(name, {"error": reason or "not run"})
            counts = WORKLOADS[args.size][name][4]
            row = {"model": kind, "dtype": dtype, "workload": name, "engine": engine, "counts": counts,
                   "tok_s": tok_per_s(entry, counts), "version": result.get("version"),
                   "load_s": result.get("load_s"), "ld_preload": result.get("ld_preload"),
                   "engine_kwargs": engine_kwargs(engine, args),
                   **{k: v for k, v in entry.items() if k != "first_output"}}
            if entry.get("short_requests"):  # counted honestly, but the engine did not do the whole job
                row["error"] = f"{entry['short_requests']} request(s) stopped short of max_tokens"
            if name == "decode" and row["tok_s"]:
                row["roofline_tok_s"], row["of_roofline"] = roof["max_tok_s"], row["tok_s"] / roof["max_tok_s"]
            outputs[(engine, name)] = entry.get("first_output")
            rows.append(row)
    for row in rows:  # greedy agreement of the first request with transformers: same weights, same math
        mine, ref = outputs.get((row["engine"], row["workload"])), outputs.get(("transformers", row["workload"]))
        if mine and ref and row["engine"] != "transformers":
            row["agree_with_transformers"] = f"{common_prefix(mine, ref)}/{len(ref)}"
    return rows


def format_table(rows: list[dict], engines: list[str]) -> str:
    peers = [e for e in engines if e != "stateserve"]
    head = f"{'model':<7} {'dtype':<9} {'workload':<8} " + " ".join(f"{e:>12}" for e in engines) + \
        "".join(f" {'ss/' + p[:8]:>12}" for p in peers) + f" {'of roofline':>11}  agree with transformers"
    lines = ["tok/s (decode, serve: generated tokens/s; prefill: prompt tokens/s); roofline: stateserve decode vs "
             "weight bytes / copy bandwidth; agreement: greedy tokens of the first request equal to transformers'",
             head, "-" * len(head)]
    keys = list(dict.fromkeys((r["model"], r["dtype"], r["workload"]) for r in rows))  # run order
    for key in keys:
        by_engine = {r["engine"]: r for r in rows if (r["model"], r["dtype"], r["workload"]) == key}
        speeds = {e: by_engine.get(e, {}).get("tok_s") for e in engines}
        cells = [f"{speeds[e]:>12.1f}" if speeds[e] else f"{'n/a' if e in by_engine else '-':>12}" for e in engines]
        ratios = [f"{speeds['stateserve'] / speeds[p]:>11.2f}x" if speeds.get("stateserve") and speeds[p]
                  else f"{'-':>12}" for p in peers]
        ss = by_engine.get("stateserve", {})
        roof = f"{ss['of_roofline'] * 100:>10.0f}%" if ss.get("of_roofline") else f"{'':>11}"
        lines.append(f"{key[0]:<7} {key[1]:<9} {key[2]:<8} " + " ".join(cells) + " " + " ".join(ratios) +
                     f" {roof}  " + " ".join(f"{SHORT[e]} {by_engine[e]['agree_with_transformers']}" for e in engines
                                             if by_engine.get(e, {}).get("agree_with_transformers")))
    errors = [f"  {r['model']} {r['dtype']} {r['workload']} {r['engine']}: {r['error']}" for r in rows
              if r.get("error")]
    unique = list(dict.fromkeys(errors))
    return "\n".join(lines + (["not measured or incomplete:"] + unique if unique else []))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama,mamba2,mamba", help="comma-separated (bench/common.py kinds)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16, q8_0 (a GGUF "
                   "file both stateserve and llama.cpp load)")
    p.add_argument("--workloads", default="decode,serve,prefill", help="comma-separated")
    p.add_argument("--size", default="base", choices=["base", "1b", "small"],
                   help="base: ~125M-parameter shapes; 1b: ~0.95B (base's workloads); small: tiny models and "
                   "workloads for a smoke run")
    p.add_argument("--engines", default=None, help="subset of stateserve,transformers,vllm,llamacpp "
                   "(default: stateserve, transformers, and each peer whose Python is given)")
    p.add_argument("--out", default=os.path.join(BENCH, "results"), help="folder for JSON, PNG and engine logs")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads every engine gets")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per workload; the fastest is kept")
    p.add_argument("--rounds", type=int, default=1, help="times each engine's process runs, alternating with the "
                   "other engines (even rounds in reverse order); per workload the fastest round is kept")
    p.add_argument("--round-engines", default=None, help="engines that run again in rounds after the first "
                   "(default: all)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per engine per model and dtype "
                   "(default 2400 for base, 600 for small)")
    p.add_argument("--stateserve-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra LLM(...) argument for stateserve, e.g. mamba_ssm_cache_dtype=auto (repeatable; "
                   "VALUE is read as JSON when it parses, else as a string)")
    p.add_argument("--vllm-python", default=None, help="Python of a venv with vllm-cpu installed")
    p.add_argument("--vllm-preload", default="auto", choices=["auto", "none"], help="auto: LD_PRELOAD "
                   "tcmalloc and the venv's libiomp5 for vLLM where they exist, as vLLM's CPU guide advises")
    p.add_argument("--llamacpp-python", default=None, help="Python of a venv with llama-cpp-python installed")
    p.add_argument("--llamacpp-convert", default=None, help="convert_hf_to_gguf.py of the llama-cpp-python sdist")
    p.add_argument("--llamacpp-kv-unified", default="on", choices=["on", "off"],
                   help="llama.cpp: one KV buffer for all sequences (on) or one stream per sequence (off)")
    p.add_argument("--convert-python", default=sys.executable, help="Python that runs the GGUF converter "
                   "(needs torch, numpy, pyyaml; default: this one)")
    args = p.parse_args(argv)
    args.models, args.dtypes = args.models.split(","), args.dtypes.split(",")
    args.workloads = args.workloads.split(",")
    args.stateserve_kwargs = {}
    for item in args.stateserve_arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            p.error(f"--stateserve-arg wants KEY=VALUE, got {item!r}")
        try:
            args.stateserve_kwargs[key] = json.loads(value)
        except ValueError:
            args.stateserve_kwargs[key] = value
    for kind in args.models:
        if kind not in KINDS:
            p.error(f"unknown model {kind!r}; choose from {', '.join(KINDS)}")
    for name in args.workloads:
        if name not in WORKLOADS["base"]:
            p.error(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS['base'])}")
    for dtype in args.dtypes:
        if dtype not in machine_limits.DTYPES and dtype not in QUANT_TYPES:
            p.error(f"unknown dtype {dtype!r}; choose from {', '.join([*machine_limits.DTYPES, *QUANT_TYPES])}")
    if args.engines is None:
        args.engines = ["stateserve", "transformers"] + (["vllm"] if args.vllm_python else []) + \
            (["llamacpp"] if args.llamacpp_python else [])
    else:
        args.engines = args.engines.split(",")
    for engine in args.engines:
        if engine not in ENGINES:
            p.error(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")
        if engine in ("vllm", "llamacpp") and not getattr(args, f"{engine}_python"):
            p.error(f"--engines {engine} needs --{engine}-python PATH")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    args.round_engines = args.engines if args.round_engines is None else args.round_engines.split(",")
    for engine in args.round_engines:
        if engine not in args.engines:
            p.error(f"--round-engines {engine!r} is not among --engines ({','.join(args.engines)})")
    if args.timeout is None:
        args.timeout = {"base": 2400.0, "1b": 3600.0}.get(args.size, 600.0)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"measuring machine limits ({args.threads} threads) ...", flush=True)
    limits = machine_limits.measure(args.threads)
    print(machine_limits.format_limits(limits) + "\n", flush=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_dir = os.path.join(args.out, f"throughput-{stamp}-logs")
    os.makedirs(log_dir, exist_ok=True)
    rows = []
    for kind in args.models:
        for dtype in args.dtypes:
            rows += bench_one(kind, dtype, args.engines, args, limits, log_dir)
    print("\n" + format_table(rows, args.engines))
    base = os.path.join(args.out, f"throughput-{args.size}-{stamp}")
    workloads = {n: dict(zip(("seed", "requests", "prompt_len", "output_len", "counts"), WORKLOADS[args.size][n]))
                 for n in args.workloads}
    write_json(base + ".json", {"machine": machine(), "limits": limits, "size": args.size, "workloads": workloads,
                                "threads": args.threads, "repeats": args.repeats, "rounds": args.rounds,
                                "round_engines": args.round_engines, "rows": rows})
    print(f"\nwrote {base}.json" + (f" and {base}.png" if plot(rows, args.engines, args.workloads,
                                                                 base + ".png") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
