"""What loading a model costs: seconds and the resident memory's peak above the process's before `LLM(...)`, beside
the weights' own size (with the panel copies the CPU kernels keep: about twice the weights). Each load runs in a
fresh process (a process's peak is kept for its lifetime), one after another.

    python bench/load_memory.py [--models llama,mamba2] [--size base|1b] [--dtype bfloat16] [--repeats 1]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
from common import cpu_name, model_folder  # noqa: E402

CHILD = """
import json, sys, time
import stateserve
from stateserve import LLM
from stateserve.platform.peak_rss import peak_rss_bytes, rss_bytes
before = rss_bytes()
start = time.perf_counter()
llm = LLM(sys.argv[1], dtype=sys.argv[2], skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 27,
          enable_prefix_caching=False)
print(json.dumps({"source": stateserve.__file__, "load_s": time.perf_counter() - start,
                  "peak_gib": (peak_rss_bytes() - before) / 2**30, "after_gib": (rss_bytes() - before) / 2**30,
                  "model_gib": llm.llm_engine.runner.model_bytes / 2**30}))
"""

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama,mamba2", help="comma-separated kinds of bench/common.py")
    p.add_argument("--size", default="1b")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    print(f"CPU: {cpu_name()}; checkpoints in float32, loaded as {args.dtype}")
    for kind in args.models.split(","):
        folder = model_folder(kind, args.size)
        for _ in range(args.repeats):
            out = subprocess.run([sys.executable, "-c", CHILD, folder, args.dtype], capture_output=True, text=True,
                                 env={**os.environ, "STATESERVE_DISABLE_TQDM": "1"})
            if out.returncode:
                print(f"{kind}-{args.size}: failed\n{out.stderr[-2000:]}")
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            code = os.path.dirname(os.path.dirname(r["source"]))
            print(f"{kind}-{args.size} ({code}): load {r['load_s']:.1f} s; resident peak {r['peak_gib']:.2f} GiB "
                  f"above the start, {r['after_gib']:.2f} GiB after; weights {r['model_gib']:.2f} GiB", flush=True)


if __name__ == "__main__":
    main()
