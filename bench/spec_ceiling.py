"""What a verify step costs against a decode step: one request whose drafts are always right, so every step
verifies k drafts and emits k + 1 tokens. The drafts are the request's own greedy output from an earlier run with
the same drafts (looked up by position), which makes acceptance 100% even in bfloat16, where verify rows may round
differently from one-row decoding. The ratio is speculation's ceiling at this k on this machine: what prompt lookup
or a draft model reaches when what it proposes is right (bench/spec_decode.py measures real proposers).

    .venv/bin/python bench/spec_ceiling.py [--models llama,mamba2,bamba] [--k 4] [--max-tokens 128]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(0, BENCH)

from common import MODEL_DIR, model_folder  # noqa: E402
from widen_demo import WIDE_MODELS, widened_folder  # noqa: E402
from stateserve import LLM, SamplingParams  # noqa: E402
from stateserve.spec_decode.proposer import Proposer  # noqa: E402


class OwnOutputProposer(Proposer):
    """Drafts the tokens a previous run produced at the request's next positions (no model, no state)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def propose(self, wanted) -> None:
        for req, k in wanted:
            req.spec_token_ids = self.tokens[req.num_output_tokens:req.num_output_tokens + k]


def timed(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[float, list[int]]:
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    return time.perf_counter() - start, out.outputs[0].token_ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama,mamba2,bamba", help="random kinds (--size) or bench/widen_demo.py's "
                   f"{', '.join(WIDE_MODELS)}")
    p.add_argument("--size", default="base", choices=("base", "small"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each; the fastest counts")
    args = p.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "unknown CPU")
    print(f"CPU: {cpu}; {torch.get_num_threads()} threads; {args.dtype}; one request, {args.max_tokens} new tokens, "
          f"k={args.k}, every draft right")
    print(f"{'model':<16} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} {'ms/decode':>9} {'ms/verify':>9} "
          f"{'tokens/verify':>13}")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    prompt = list(range(100, 164))
    dtype = getattr(torch, args.dtype)
    for kind in args.models.split(","):
        path = widened_folder(kind, MODEL_DIR, dtype) if kind in WIDE_MODELS else model_folder(kind, args.size, dtype)
        with LLM(path, dtype=args.dtype, skip_tokenizer_init=True, enable_prefix_caching=False) as llm:
            plain = min(timed(llm, prompt, params)[0] for _ in range(args.repeats + 1))
        spec_cfg = {"method": "ngram", "num_speculative_tokens": args.k}
        with LLM(path, dtype=args.dtype, skip_tokenizer_init=True, enable_prefix_caching=False,
                 speculative_config=spec_cfg) as llm:
            engine = llm.llm_engine
            tokens: list[int] = []
            for _ in range(8):  # until its own output is what it drafts (bfloat16 verify rows may round otherwise)
                engine.speculator.proposer = OwnOutputProposer(tokens)
                _, out = timed(llm, prompt, params)
                if out == tokens:
                    break
                tokens = out
            engine.speculator.proposer = OwnOutputProposer(tokens)
            best, steps = float("inf"), 0
            for _ in range(args.repeats):
                before = engine.stats["spec_decode_num_drafts"]
                elapsed, out = timed(llm, prompt, params)
                if elapsed < best:
                    best, steps = elapsed, engine.stats["spec_decode_num_drafts"] - before
            accepted = out == tokens
        n = args.max_tokens
        print(f"{kind:<16} {n / plain:>11.1f} {n / best:>10.1f} {plain / best:>5.2f}x {1000 * plain / n:>9.2f} "
              f"{1000 * best / max(steps, 1):>9.2f} {n / max(steps, 1):>13.2f}"
              + ("" if accepted else "  (drafts not all accepted)"))


if __name__ == "__main__":
    main()
