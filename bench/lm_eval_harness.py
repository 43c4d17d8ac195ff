"""lm-evaluation-harness against `stateserve serve`, checked against the same tasks scored with transformers.

Starts `stateserve serve` on a model folder, runs lm-eval's `local-completions` model against it (token-id
prompts; loglikelihoods through echo + logprobs with max_tokens 1, generations through greedy completions), then
lm-eval's own `hf` model on the same folder and tasks, and compares: every metric must be equal, and the per-sample
loglikelihoods and generated texts (from --log_samples) show how close the two engines are.

lm-eval lives in its own venv (bench/README.md, "Installing the peers"); this script is standard library only and
calls it by path. The tasks are local (bench/lm_eval_tasks/, JSONL data), and everything runs offline.

    .venv/bin/python bench/lm_eval_harness.py [--model FOLDER] [--lmeval-python /opt/peers/lmeval/bin/python]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TASKS_DIR = REPO / "bench" / "lm_eval_tasks"
RESULTS = REPO / "bench" / "results"
DEMO = REPO / "stateserve" / "assets" / "models" / "llama-demo"
# Nothing may reach the hub: the tokenizer and model are local folders, the data sets local JSON files.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(folder: str, name: str, dtype: str, port: int, log: Path, timeout: float) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "stateserve.entrypoints.cli", "serve", folder, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", dtype, "--served-model-name", name]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=REPO)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server not healthy after {timeout:.0f} s; see {log}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()  # SIGTERM: the server drains and exits
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_lmeval(python: str, model: str, model_args: str, tasks: list[str], out: Path, log: Path,
               extra: list[str], limit: int | None, timeout: float) -> None:
    cmd = [python, "-m", "lm_eval", "run", "--model", model, "--model_args", model_args,
           "--include_path", str(TASKS_DIR), "--tasks", *tasks, "--output_path", str(out), "--log_samples", *extra]
    if limit:
        cmd += ["--limit", str(limit)]
    print("$", " ".join(cmd), flush=True)
    # cwd = the tasks folder: the YAMLs' data_files are relative to it (lm-eval does not resolve them itself)
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=TASKS_DIR, env={**os.environ, **OFFLINE}, stdout=f, stderr=subprocess.STDOUT,
                            timeout=timeout).returncode
    if rc != 0:
        raise RuntimeError(f"lm_eval --model {model} exited with {rc}; see {log}")


def load_run(out: Path) -> tuple[dict, dict[str, dict[int, dict]]]:
    """The newest results JSON under `out` and its samples: task -> doc_id -> sample."""
    results = sorted(glob.glob(str(out / "**" / "results_*.json"), recursive=True))[-1]
    with open(results) as f:
        res = json.load(f)
    samples: dict[str, dict[int, dict]] = {}
    for task in res["results"]:
        files = sorted(glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True))
        if files:
            with open(files[-1]) as f:
                samples[task] = {(s := json.loads(line))["doc_id"]: s for line in f if line.strip()}
    return res, samples


def compare_samples(a: dict[int, dict], b: dict[int, dict]) -> dict:
    """Loglikelihood tasks: max |ll_a - ll_b| and how many argmax choices agree; generation tasks: identical texts."""
    lls, same_choice, same_text, n = [], 0, 0, 0
    for doc_id in sorted(a.keys() & b.keys()):
        ra, rb = a[doc_id]["resps"], b[doc_id]["resps"]
        n += 1
        if isinstance(ra[0][0], list):  # loglikelihood: resps = [[[ll, is_greedy]], ...] one per choice
            la, lb = [float(r[0][0]) for r in ra], [float(r[0][0]) for r in rb]
            lls += [abs(x - y) for x, y in zip(la, lb)]
            same_choice += la.index(max(la)) == lb.index(max(lb))
        else:  # generate_until: resps = [[text]]
            same_text += ra[0][0] == rb[0][0]
    if lls:
        return {"docs": n, "max_abs_ll_diff": max(lls), "same_argmax": same_choice}
    return {"docs": n, "identical_generations": same_text}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEMO), help="Hugging Face model folder (default: the bundled llama-demo)")
    p.add_argument("--dtype", default="float32", help="for both engines; float32 so they can agree exactly")
    p.add_argument("--lmeval-python", default="/opt/peers/lmeval/bin/python", help="Python of the lm-eval venv")
    p.add_argument("--tasks", default="pyfacts_mc,pyfacts_gen", help="comma-separated tasks of bench/lm_eval_tasks")
    p.add_argument("--tokenizer-backend", default="huggingface", choices=["huggingface", "remote"],
                   help="local-completions' tokenizer: the model folder, or the server's /tokenize")
    p.add_argument("--limit", type=int, default=None, help="docs per task (smoke runs)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per lm_eval run")
    p.add_argument("--output", default=None, help="results JSON (default: bench/results/lm-eval-<time>.json)")
    args = p.parse_args(argv)

    folder = str(Path(args.model).resolve())
    tasks = args.tasks.split(",")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    work = RESULTS / f"lm-eval-{stamp}"
    work.mkdir(parents=True, exist_ok=True)
    name = Path(folder).name

    port = free_port()
    base_url = f"http://127.0.0.1:{port}/v1/completions"
    # max_retries=1: a failed request must fail the run, not be retried into a different answer;
    # tokenized_requests=True (lm-eval's default, explicit here): both engines see the same token ids.
    # remote: no tokenizer= (lm-eval loads a given tokenizer with transformers whatever the backend says).
    tok = f"tokenizer={folder}," if args.tokenizer_backend == "huggingface" else ""
    ss_args = (f"model={name},base_url={base_url},{tok}tokenizer_backend={args.tokenizer_backend},"
               f"tokenized_requests=True,num_concurrent=1,max_retries=1")
    server = start_server(folder, name, args.dtype, port, work / "server.log", timeout=300)
    try:
        t0 = time.monotonic()
        run_lmeval(args.lmeval_python, "local-completions", ss_args, tasks, work / "stateserve",
                   work / "lm_eval-stateserve.log", [], args.limit, args.timeout)
        ss_time = time.monotonic() - t0
    finally:
        stop_server(server)
    t0 = time.monotonic()
    # device is lm-eval's own flag: passing it in --model_args too is refused ("multiple values for 'device'")
    run_lmeval(args.lmeval_python, "hf", f"pretrained={folder},dtype={args.dtype}", tasks, work / "transformers",
               work / "lm_eval-transformers.log", ["--device", "cpu"], args.limit, args.timeout)
    tf_time = time.monotonic() - t0

    ss_res, ss_samples = load_run(work / "stateserve")
    tf_res, tf_samples = load_run(work / "transformers")
    rows, ok = [], True
    for task in tasks:
        for key, value in sorted(ss_res["results"][task].items()):
            metric, comma, flt = key.partition(",")
            if not comma or metric.endswith("_stderr"):  # "metric,filter" keys only (not name, alias, sample_len)
                continue
            other = tf_res["results"][task].get(key)
            equal = other is not None and value == other
            ok &= equal
            rows.append({"task": task, "metric": metric, "filter": flt, "stateserve": value, "transformers": other,
                         "equal": equal})
    per_sample = {t: compare_samples(ss_samples[t], tf_samples[t]) for t in tasks
                  if t in ss_samples and t in tf_samples}

    print(f"\nmodel {folder} ({args.dtype}), lm-eval {ss_res.get('lm_eval_version', '?')}, "
          f"stateserve {ss_time:.0f} s, transformers {tf_time:.0f} s")
    print(f"{'task':<14}{'metric':<13}{'filter':<12}{'stateserve':>11}{'transformers':>14}  equal")
    for r in rows:
        tf_val = "-" if r["transformers"] is None else f"{r['transformers']:.4f}"
        print(f"{r['task']:<14}{r['metric']:<13}{r['filter']:<12}{r['stateserve']:>11.4f}{tf_val:>14}  "
              f"{'yes' if r['equal'] else 'NO'}")
    for task, cmp in per_sample.items():
        print(f"{task}: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in cmp.items()))

    report = {"model": folder, "dtype": args.dtype, "tasks": tasks, "limit": args.limit,
              "tokenizer_backend": args.tokenizer_backend, "lm_eval_version": ss_res.get("lm_eval_version"),
              "transformers_version": tf_res.get("transformers_version"), "seconds": {"stateserve": ss_time,
              "transformers": tf_time}, "rows": rows, "per_sample": per_sample, "equal": ok, "run_dir": str(work)}
    out = Path(args.output) if args.output else RESULTS / f"lm-eval-{stamp}.json"
    out.write_text(json.dumps(report, indent=2))
    print(f"{'all metrics equal' if ok else 'METRICS DIFFER'}; report {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
