"""The CUDA parts of stateserve in one run (<= 5 minutes on one GPU), results as JSON.

Parts (each under its own time limit; a failure is recorded in the JSON and the next part runs):
  parity     greedy tokens and the largest logit difference against transformers on CUDA, for a decoder (Llama),
             an attention-free model (Mamba2) and a hybrid (Bamba): small random models built here, float32
  graphs     CUDA graphs on vs off (enforce_eager) give the same greedy tokens, on the bundled demo models
  speed      decode tokens/s with and without graphs (batch 1 and 16)
  memory     torch.cuda.memory_allocated() back to its value before the first engine after LLM.shutdown(),
             over ten create -> generate -> shutdown cycles

    bench/gpu_check.sh [--out results.json] [--parts parity,graphs,speed,memory]

Without a CUDA device it says so, writes {"status": "no_cuda"} and exits 0. `--device cpu` runs the same code on
CPU (graphs then never capture, memory is not checked) to debug the script itself."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # tiny model builders and teacher forcing (tests/utils.py)
os.environ.setdefault("STATESERVE_DISABLE_TQDM", "1")

import torch  # noqa: E402

DEMO = os.path.join(ROOT, "stateserve", "assets", "models")
DEMO_MODELS = {"llama": "llama-demo", "mamba2": "mamba2-demo", "bamba": "hybrid-demo"}
PART_LIMITS_S = {"parity": 90, "graphs": 60, "speed": 60, "memory": 60}


class PartTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: int):
    """SIGALRM-based limit: raised at the next Python bytecode after `seconds` (a kernel already running
    finishes first)."""
    def on_alarm(signum, frame):
        raise PartTimeout(f"part exceeded its {seconds} s limit")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---- parity with transformers --------------------------------------------------------------------------------
def _tiny_hf(kind: str):
    from transformers import (BambaConfig, BambaForCausalLM, LlamaConfig, LlamaForCausalLM, Mamba2Config,
                              Mamba2ForCausalLM)
    from utils import build_hf_model

    if kind == "llama":
        return build_hf_model(LlamaConfig, LlamaForCausalLM, vocab_size=300, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=512)
    if kind == "mamba2":
        return build_hf_model(Mamba2Config, Mamba2ForCausalLM, vocab_size=300, hidden_size=64, num_heads=8,
                              head_dim=16, state_size=16, n_groups=1, num_hidden_layers=2, chunk_size=16,
                              tie_word_embeddings=False)
    return build_hf_model(BambaConfig, BambaForCausalLM, vocab_size=300, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1],
                          mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1,
                          mamba_chunk_size=16, tie_word_embeddings=False, max_position_embeddings=512)


def _hf_greedy(hf, prompt: list[int], n: int, device: str) -> list[int]:
    ids = torch.tensor([prompt], device=device)
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          pad_token_id=0, generation_config=hf.generation_config)
    return out[0, len(prompt):].tolist()


def part_parity(device: str, workdir: str) -> dict:
    from stateserve import LLM, SamplingParams
    from utils import engine_teacher_forced_logits, save_model

    torch.backends.cudnn.allow_tf32 = False  # transformers' Mamba convs would otherwise round differently
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = [[5, 17, 42], list(range(20, 45)), [(13 * i) % 290 + 3 for i in range(60)]]
    results = {}
    for kind in ("llama", "mamba2", "bamba"):
        entry: dict = {}
        results[kind] = entry
        try:
            hf = _tiny_hf(kind)
            path = save_model(hf, os.path.join(workdir, f"tiny-{kind}"))
            hf = hf.to(device)
            ref = [_hf_greedy(hf, p, 16, device) for p in prompts]
            params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
            with LLM(path, skip_tokenizer_init=True, device=device, dtype="float32") as llm:
                ours = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                     params)]
                full = prompts[-1] + ref[-1]
                our_logits = engine_teacher_forced_logits(llm, full, chunk=16)
            with torch.no_grad():
                hf_logits = hf(torch.tensor([full], device=device)).logits[0].float()
            entry.update(tokens_equal=ours == ref, max_logit_diff=float((our_logits - hf_logits).abs().max()),
                         ours=ours, transformers=ref)
        except Exception as e:  # record and go on with the next model
            entry.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=6))
    results["ok"] = all(r.get("tokens_equal") and r.get("max_logit_diff", 1.0) < 1e-3
                        for k, r in results.items() if isinstance(r, dict))
    return results


# ---- graphs on vs off, tokens/s ------------------------------------------------------------------------------
def _demo_prompts(n: int) -> list[dict]:
    return [{"prompt_token_ids": [(7 * i + 3 * j) % 200 + 3 for j in range(5 + i % 7)]} for i in range(n)]


def _graph_info(llm) -> dict:
    manager = llm.llm_engine.runner.graph_manager
    return {"captured_sizes": sorted(manager.graphs) if manager is not None else []}


def part_graphs(device: str) -> dict:
    from stateserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    results = {}
    for kind, folder in DEMO_MODELS.items():
        entry: dict = {}
        results[kind] = entry
        try:
            tokens = {}
            for eager in (True, False):
                with LLM(os.path.join(DEMO, folder), device=device, enforce_eager=eager, max_num_seqs=16) as llm:
                    if not eager:
                        entry.update(_graph_info(llm))
                    tokens[eager] = [o.outputs[0].token_ids for o in llm.generate(_demo_prompts(11), params)]
            entry["tokens_equal"] = tokens[True] == tokens[False]
            if not entry["tokens_equal"]:
                entry["first_difference"] = next(i for i, (a, b) in enumerate(zip(tokens[True], tokens[False]))
                                                 if a != b)
        except Exception as e:
            entry.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=6))
    # on CUDA every one of these models is expected to capture (a failed capture falls back to eager silently)
    must_capture = device.startswith("cuda")
    results["ok"] = all(r.get("tokens_equal") and (r.get("captured_sizes") or not must_capture)
                        for r in results.values() if isinstance(r, dict))
    return results


def part_speed(device: str) -> dict:
    from stateserve import LLM, SamplingParams

    results = {}
    for kind, folder in DEMO_MODELS.items():
        entry: dict = {}
        results[kind] = entry
        try:
            for eager in (True, False):
                label = "eager" if eager else "graphs"
                with LLM(os.path.join(DEMO, folder), device=device, enforce_eager=eager, max_num_seqs=16) as llm:
                    for batch in (1, 16):
                        params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
                        llm.generate(_demo_prompts(batch), SamplingParams(max_tokens=4))  # warm up
                        _sync(device)
                        start = time.perf_counter()
                        outs = llm.generate(_demo_prompts(batch), params)
                        _sync(device)
                        elapsed = time.perf_counter() - start
                        generated = sum(len(o.outputs[0].token_ids) for o in outs)
                        entry[f"{label}_batch{batch}_tokens_per_s"] = round(generated / elapsed, 1)
            for batch in (1, 16):
                eager_tps = entry.get(f"eager_batch{batch}_tokens_per_s")
                if eager_tps:
                    entry[f"speedup_batch{batch}"] = round(entry[f"graphs_batch{batch}_tokens_per_s"] / eager_tps, 2)
        except Exception as e:
            entry.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=6))
    return results


# ---- memory back to baseline ---------------------------------------------------------------------------------
def part_memory(device: str) -> dict:
    from stateserve import LLM, SamplingParams

    if not device.startswith("cuda"):
        return {"skipped": "memory_allocated is a CUDA measure"}
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    after = []
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for cycle in range(10):
        folder = list(DEMO_MODELS.values())[cycle % len(DEMO_MODELS)]  # graphs, KV and state pools each time
        llm = LLM(os.path.join(DEMO, folder), device=device, max_num_seqs=8)
        llm.generate(_demo_prompts(4), params)
        llm.shutdown()
        after.append(torch.cuda.memory_allocated())
    return {"baseline_bytes": baseline, "after_each_shutdown_bytes": after,
            "max_excess_bytes": max(a - baseline for a in after), "ok": all(a == baseline for a in after)}


# ---- driver --------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gpu_check.json", help="where the JSON results go")
    parser.add_argument("--parts", default="parity,graphs,speed,memory", help="comma-separated parts to run")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cuda:N; cpu only to debug the script")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PART_LIMITS_S))
    if unknown:
        parser.error(f"unknown part(s) {unknown}; choose from {sorted(PART_LIMITS_S)}")
    report: dict = {"device": args.device, "torch": torch.__version__, "parts": {}}
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device is available; nothing to check (results say status=no_cuda)")
            report["status"] = "no_cuda"
            _write(args.out, report)
            return 0
        report["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    funcs = {"parity": part_parity, "graphs": part_graphs, "speed": part_speed, "memory": part_memory}
    with tempfile.TemporaryDirectory() as workdir:
        for name in parts:
            start = time.perf_counter()
            try:
                with time_limit(PART_LIMITS_S[name]):
                    result = funcs[name](args.device, workdir) if name == "parity" else funcs[name](args.device)
            except Exception as e:  # a timeout or a crash: record it, run the next part
                result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)}
            result["seconds"] = round(time.perf_counter() - start, 1)
            report["parts"][name] = result
            print(f"gpu_check: {name}: {'ok' if result.get('ok', 'error' not in result) else 'FAILED'} "
                  f"({result['seconds']} s)", flush=True)
            _write(args.out, report)  # after every part, so a killed run still leaves what it measured
    failed = [n for n, r in report["parts"].items() if "error" in r or r.get("ok") is False]
    report["status"] = "failed" if failed else "ok"
    report["failed_parts"] = failed
    _write(args.out, report)
    print(f"gpu_check: wrote {args.out}; status {report['status']}" + (f" ({', '.join(failed)})" if failed else ""))
    return 1 if failed else 0


def _write(path: str, report: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2, default=str)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
