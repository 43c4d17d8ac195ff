"""Quantized models, stateserve against llama.cpp on the same GGUF file: throughput (bench/throughput.py's
workloads, engines alternating in processes of their own) and, beside each figure, the KL divergence of each
engine's quantized logits from the float32 model's on fixed tokens and stateserve's resident weights against the
file's size.

    .venv/bin/python bench/quantized.py [--models llama,mamba2,mamba] [--types q8_0] [--size base|1b] [--skip-kl]
        [--rounds 2] [--llamacpp-python /opt/peers/llamacpp/bin/python]
        [--llamacpp-convert /opt/peers/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py]

Runs bench/throughput.py with --dtypes bfloat16,TYPES and --engines stateserve,llamacpp (bfloat16 is our own
float baseline and llama.cpp's), then the KL: 512 token ids drawn with a fixed seed; the reference is stateserve's
float32 model (equal to transformers' within round-off, tests/test_llama.py and friends); stateserve's quantized
logits come from the GGUF file through the engine (teacher forcing), llama.cpp's from llama-cpp-python's
`Llama(logits_all=True)`. Extra arguments go to throughput.py unchanged.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.dirname(BENCH))
import throughput  # noqa: E402
from common import model_folder, write_json  # noqa: E402

PEERS = "/opt/peers"
DEFAULT_LLAMACPP = f"{PEERS}/llamacpp/bin/python"
DEFAULT_CONVERT = f"{PEERS}/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py"
KL_TOKENS = 512


def kl(reference, logits) -> float:
    """Mean over positions of KL(reference || quantized), both [T, V] float32 logits."""
    import torch

    ref, q = torch.log_softmax(reference.double(), -1), torch.log_softmax(logits.double(), -1)
    return float((ref.exp() * (ref - q)).sum(-1).mean())


def kl_rows(kind: str, types: list[str], args: argparse.Namespace, convert_args: argparse.Namespace) -> list[dict]:
    import numpy as np
    import torch

    from stateserve import LLM
    from stateserve.engine.teacher_forcing import teacher_forced_logits

    folder = model_folder(kind, args.size)
    with open(os.path.join(folder, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    rng = random.Random(7)
    tokens = [rng.randrange(10, vocab - 10) for _ in range(KL_TOKENS)]
    reference = None
    if not args.skip_kl:
        with LLM(folder, dtype="float32", skip_tokenizer_init=True, enable_prefix_caching=False) as llm:
            reference = teacher_forced_logits(llm, tokens, 512)
    rows = []
    for qtype in types:
        gguf = throughput.convert_gguf(folder, qtype, convert_args)
        with LLM(gguf, skip_tokenizer_init=True, enable_prefix_caching=False) as llm:
            resident = llm.llm_engine.runner.model_bytes
            ours = teacher_forced_logits(llm, tokens, 512) if reference is not None else None
        row = {"model": kind, "type": qtype, "file_gib": os.path.getsize(gguf) / 2**30,
               "resident_gib": resident / 2**30, "resident_over_file": resident / os.path.getsize(gguf)}
        print(f"  weights {kind} {qtype}: {row['resident_gib']:.4f} GiB resident, file {row['file_gib']:.4f} GiB "
              f"({row['resident_over_file']:.3f}x)", flush=True)
        if reference is None:
            rows.append(row)
            continue
        row["stateserve_kl"] = kl(reference, ours)
        if args.llamacpp_python:
            with tempfile.TemporaryDirectory() as tmp:
                tok_path, out = os.path.join(tmp, "tokens.json"), os.path.join(tmp, "logits.npy")
                with open(tok_path, "w") as f:
                    json.dump(tokens, f)
                subprocess.run([args.llamacpp_python, os.path.join(BENCH, "peers", "llamacpp_logits.py"), gguf,
                                tok_path, out, str(args.threads)], check=True, timeout=1800)
                theirs = torch.from_numpy(np.load(out))[:, :reference.shape[1]]
            row["llamacpp_kl"] = kl(reference, theirs)
        rows.append(row)
        print(f"  KL {kind} {qtype}: stateserve {row['stateserve_kl']:.2e}"
              + (f", llama.cpp {row['llamacpp_kl']:.2e}" if "llamacpp_kl" in row else ""), flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama,mamba2,mamba")
    p.add_argument("--types", default="q8_0", help=f"comma-separated: {', '.join(throughput.QUANT_TYPES)}")
    p.add_argument("--size", default="base", choices=["base", "1b", "small"])
    p.add_argument("--skip-kl", action="store_true", help="no KL divergences (the resident weights still)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--llamacpp-python", default=DEFAULT_LLAMACPP if os.path.isfile(DEFAULT_LLAMACPP) else None)
    p.add_argument("--llamacpp-convert", default=DEFAULT_CONVERT)
    p.add_argument("--skip-throughput", action="store_true", help="only the KL divergences and resident weights")
    args, rest = p.parse_known_args()
    types = args.types.split(",")
    engines = "stateserve" + (",llamacpp" if args.llamacpp_python else "")
    argv = ["--models", args.models, "--dtypes", ",".join(["bfloat16", *types]), "--engines", engines, "--size",
            args.size, "--threads", str(args.threads), "--llamacpp-convert", args.llamacpp_convert, *rest]
    if args.llamacpp_python:
        argv += ["--llamacpp-python", args.llamacpp_python]
    if not args.skip_throughput:
        throughput.main(argv)
    convert_args = throughput.parse_args(argv)
    rows = [row for kind in args.models.split(",") for row in kl_rows(kind, types, args, convert_args)]
    out = os.path.join(BENCH, "results", f"quantized-kl-{args.size}.json")
    write_json(out, {"tokens": KL_TOKENS, "reference": "stateserve float32", "rows": rows,
                     "resident": "the weights' bytes stateserve's load log reports, beside the GGUF file's size"})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
