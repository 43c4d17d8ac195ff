"""The per-step cost of structured outputs: the same requests free and constrained by a JSON schema (llguidance
masks each constrained row every step), on a bundled demo model or a bench model; reports tokens/s of both and the
time the mask itself took per step (its share of the step).

    .venv/bin/python bench/structured_outputs.py [--model llama-demo] [--requests 1,16] [--max-tokens 64]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from stateserve import LLM, SamplingParams  # noqa: E402
from stateserve.assets import bundled_models  # noqa: E402
from stateserve.runner import structured  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "kind": {"enum": ["list", "dict", "set", "tuple"]},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 9999}},
          "required": ["name", "kind", "size"], "additionalProperties": False}


class MaskTimer:
    """Wraps structured.mask_rows to add up its time and calls."""

    def __init__(self) -> None:
        self.seconds, self.calls, self._inner = 0.0, 0, structured.mask_rows

    def __call__(self, logits, constraints) -> None:
        start = time.perf_counter()
        self._inner(logits, constraints)
        if any(c is not None for c in constraints):
            self.seconds += time.perf_counter() - start
            self.calls += 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-demo", help="a bundled demo model's name or a folder")
    p.add_argument("--requests", default="1,16")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    folder = bundled_models().get(args.model, args.model)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "unknown CPU")
    print(f"CPU: {cpu}; model {args.model}; {args.max_tokens} new tokens per request, greedy")
    timer = MaskTimer()
    structured.mask_rows = timer
    with LLM(folder, enable_prefix_caching=False) as llm:
        for n in map(int, args.requests.split(",")):
            prompts = [f"Describe container number {i}:" for i in range(n)]
            for label, so in (("free", None), ("json schema", {"json": SCHEMA})):
                params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=so is None,
                                        structured_outputs=so)
                llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up (and the grammar's compilation)
                timer.seconds, timer.calls = 0.0, 0
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                elapsed = time.perf_counter() - start
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                steps = max(timer.calls, 1)
                mask = f"mask {1000 * timer.seconds / steps:.3f} ms/step ({100 * timer.seconds / elapsed:.1f}% of " \
                       f"the time)" if timer.calls else ""
                print(f"{n:>3} requests  {label:<12} {tokens / elapsed:8.1f} tok/s  {elapsed:6.2f} s  {mask}")


if __name__ == "__main__":
    main()
