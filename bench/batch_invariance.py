"""What batch invariance costs: the same model decoded with `batch_invariant` off and on, in one process, the
engines' timed runs interleaved (so that the machine's drift between runs falls on both alike).

    python bench/batch_invariance.py [--models llama-demo-wide,mamba2-demo-wide,hybrid-demo-wide] [--repeats 5]

Per model (bfloat16): one request of speculative decoding (prompt lookup, k = 4) on bench/spec_decode.py's copy
prompt, 128 new tokens, with batch_invariant on (speculative decoding's default) and off; and 16 concurrent
requests of plain decoding (the panel kernel's batched shape) on and off. Prints the median tokens/s of each and
the on/off ratio, and checks that the invariant runs' tokens do not change between the two batch shapes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault("STATESERVE_DISABLE_TQDM", "1")

from bench.common import MODEL_DIR  # noqa: E402
from bench.spec_decode import make_prompts  # noqa: E402
from bench.widen_demo import WIDE_MODELS, widened_folder  # noqa: E402

NEW_TOKENS = 128
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def _timed(llm, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    from stateserve import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds, [list(o.outputs[0].token_ids) for o in outs]


def measure(name: str, repeats: int) -> dict:
    import torch
    from stateserve import LLM

    folder = widened_folder(name, MODEL_DIR, torch.bfloat16)
    one = make_prompts("copy", 1, folder, "base")
    many = make_prompts("nocopy", 16, folder, "base")
    runs = {  # (engine arguments, prompts)
        "spec-invariant": (dict(speculative_config=SPEC), one),
        "spec-k-order": (dict(speculative_config=SPEC, batch_invariant=False), one),
        "batch16-invariant": (dict(batch_invariant=True), many),
        "batch16-k-order": (dict(batch_invariant=False), many),
    }
    engines = {key: LLM(folder, dtype="bfloat16", skip_tokenizer_init=True, enable_prefix_caching=False, seed=0,
                        **kw) for key, (kw, _) in runs.items()}
    rates: dict[str, list[float]] = {key: [] for key in runs}
    tokens: dict[str, list[list[int]]] = {}
    for key, (_, prompts) in runs.items():  # warm-up
        _timed(engines[key], prompts)
    for _ in range(repeats):
        for key, (_, prompts) in runs.items():
            rate, tokens[key] = _timed(engines[key], prompts)
            rates[key].append(rate)
    for llm in engines.values():
        llm.shutdown()
    med = {key: statistics.median(v) for key, v in rates.items()}
    return {"model": name, "tokens_per_s": med, "runs": rates,
            "spec_on_off": med["spec-invariant"] / med["spec-k-order"],
            "batch16_on_off": med["batch16-invariant"] / med["batch16-k-order"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(WIDE_MODELS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    from bench.common import cpu_name

    print(f"{cpu_name()}, {os.cpu_count()} CPUs", flush=True)
    results = []
    for name in args.models.split(","):
        r = measure(name, args.repeats)
        results.append(r)
        m = r["tokens_per_s"]
        print(f"{name}: speculative 1 request {m['spec-invariant']:.1f} tok/s invariant / {m['spec-k-order']:.1f} "
              f"k-order = {r['spec_on_off']:.3f}; plain 16 requests {m['batch16-invariant']:.1f} / "
              f"{m['batch16-k-order']:.1f} = {r['batch16_on_off']:.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_name(), "cpus": os.cpu_count(), "repeats": args.repeats, "models": results}, f,
                      indent=2)


if __name__ == "__main__":
    main()
