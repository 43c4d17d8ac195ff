"""Throughput beside competing processes: what a user gets when the machine is not theirs alone.

For each load it starts the competing processes, then runs the same offline workload (--repeats generate calls of --prompts prompts) in fresh processes under
three thread settings, alternating them (--rounds): `adaptive` (the default: platform/cpu_threads.py fits the team
to the cores the other processes leave), `one-thread` (STATESERVE_NUM_THREADS=1: the floor the adaptive team
must never fall below) and `fixed` (STATESERVE_ADAPTIVE_THREADS=0: every core whatever the load, the behaviour
before the governor). Each figure is the faster round's generated tokens per second (load time apart).

Loads: quiet (nothing), loop (one busy Python loop), loops2 (two), nice-loops2 (two at nice 10), torch (a
PyTorch process on every core doing small matmuls), compile (two C++ compiles of a kernel source at nice 10,
over and over, as a developer's build beside the engine would be).

    python bench/contention.py [--model DIR|llama|mamba2|...] [--loads quiet,loop,compile] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import sysconfig
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)
from common import machine, write_json  # noqa: E402

SETTINGS = {"adaptive": {}, "one-thread": {"STATESERVE_NUM_THREADS": "1"},
            "fixed": {"STATESERVE_ADAPTIVE_THREADS": "0"}}
LOADS = ("quiet", "loop", "loops2", "nice-loops2", "torch", "compile")
_LOOP = "while True: pass"
_TORCH = ("import torch\nx = torch.randn(64, 64)\nwhile True:\n    for _ in range(200): x = torch.tanh(x @ x)\n"
          "    x = torch.randn(64, 64)")


def _compile_command() -> list[str]:
    import torch.utils.cpp_extension as ext

    includes = [f"-I{p}" for p in ext.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    source = os.path.join(REPO, "stateserve", "csrc", "small_ops.cpp")
    return ["c++", "-O3", "-march=native", "-fopenmp", "-std=c++20", *includes, "-c", source, "-o", os.devnull]


def start_load(name: str) -> list[subprocess.Popen]:
    def spawn(cmd: list[str], nice: int = 0) -> subprocess.Popen:
        # a session of its own, so that stopping the load ends what it started too (a compiler's cc1plus)
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=(lambda: os.nice(nice)) if nice else None)

    py = sys.executable
    if name == "quiet":
        return []
    if name in ("loop", "loops2", "nice-loops2"):
        count, nice = (1, 0) if name == "loop" else (2, 10 if name.startswith("nice") else 0)
        return [spawn([py, "-c", _LOOP], nice) for _ in range(count)]
    if name == "torch":
        return [spawn([py, "-c", _TORCH])]
    if name == "compile":
        loop = "while :; do " + " ".join(_compile_command()) + " >/dev/null 2>&1; done"
        return [spawn(["sh", "-c", loop], 10) for _ in range(2)]
    raise ValueError(f"unknown load {name!r}; choose from {', '.join(LOADS)}")


def stop_load(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def child(args: argparse.Namespace) -> None:
    """One measurement in this process: load the model, generate the workload, print a JSON line."""
    os.environ.setdefault("STATESERVE_DISABLE_TQDM", "1")
    sys.path.insert(0, REPO)
    from stateserve import LLM, SamplingParams
    from stateserve.platform import cpu_threads

    start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, skip_tokenizer_init=True, enable_prefix_caching=False)
    load_s = time.perf_counter() - start
    prompts = [{"prompt_token_ids": [(7 * i + 11 * j) % 200 + 10 for j in range(args.prompt_len)]}
               for i in range(args.prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm-up
    tokens, start = 0, time.perf_counter()
    for _ in range(args.repeats):
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    elapsed = time.perf_counter() - start
    gov = cpu_threads.governor()
    print(json.dumps({"tok_s": tokens / elapsed, "load_s": load_s, "threads": gov.threads,
                      "max_threads": gov.max_threads, "others": round(gov.others, 2)}), flush=True)
    llm.shutdown()


def measure(setting: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, **SETTINGS[setting])
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", args.model, "--dtype", args.dtype,
           "--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len), "--max-tokens",
           str(args.max_tokens), "--repeats", str(args.repeats)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {proc.stderr[-500:]}"}
    return json.loads(lines[-1])


def resolve_model(name: str) -> str:
    if os.path.isdir(name):
        return name
    if name == "demo":
        sys.path.insert(0, REPO)
        from stateserve.assets import default_model_path

        return default_model_path()
    from common import model_folder

    return model_folder(name, "base")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo", help="a model folder, 'demo' (the bundled default) or a "
                                                   "bench/common.py kind (base size)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--loads", default=",".join(LOADS), help="comma-separated: " + ", ".join(LOADS))
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated: " + ", ".join(SETTINGS))
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--repeats", type=int, default=10, help="generate calls timed together (a small model's one "
                                                            "call is over in tens of milliseconds)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each setting, alternating; the fastest counts")
    p.add_argument("--settle", type=float, default=2.0, help="seconds between starting a load and measuring")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per measurement")
    p.add_argument("--out", default=os.path.join(BENCH, "results"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    args.model = resolve_model(args.model)
    loads, settings = args.loads.split(","), args.settings.split(",")
    for name in settings:
        if name not in SETTINGS:
            p.error(f"unknown setting {name!r}")
    rows = []
    for load in loads:
        procs = start_load(load)
        try:
            time.sleep(args.settle if procs else 0)
            best: dict[str, dict] = {}
            for r in range(args.rounds):
                for setting in settings if r % 2 == 0 else settings[::-1]:
                    res = measure(setting, args)
                    print(f"  {load:12s} {setting:10s} round {r + 1}: {res}", flush=True)
                    if "tok_s" in res and res["tok_s"] > best.get(setting, {}).get("tok_s", -1):
                        best[setting] = res
                    best.setdefault(setting, res)
        finally:
            stop_load(procs)
        rows.append({"load": load, **{s: best.get(s, {}) for s in settings}})
    print(format_table(rows, settings))
    path = os.path.join(args.out, f"contention-{time.strftime('%Y%m%d-%H%M%S')}.json")
    write_json(path, {"machine": machine(), "model": args.model, "dtype": args.dtype, "prompts": args.prompts,
                      "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "repeats": args.repeats,
                      "rounds": args.rounds,
                      "rows": rows})
    print(f"wrote {path}")
    return 0


def format_table(rows: list[dict], settings: list[str]) -> str:
    def fig(entry: dict) -> str:
        return f"{entry['tok_s']:.1f} ({entry['threads']}t)" if "tok_s" in entry else "error"

    head = "| load | " + " | ".join(f"{s} tok/s" for s in settings) + " | adaptive / one-thread | adaptive / fixed |"
    lines = [head, "|" + "---|" * (len(settings) + 3)]
    for row in rows:
        a, o, f = (row.get(s, {}).get("tok_s") for s in ("adaptive", "one-thread", "fixed"))
        ratio = (lambda x, y: f"{x / y:.2f}x" if x and y else "-")
        lines.append(f"| {row['load']} | " + " | ".join(fig(row[s]) for s in settings) +
                     f" | {ratio(a, o)} | {ratio(a, f)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
