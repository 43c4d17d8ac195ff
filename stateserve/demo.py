"""`make run`: greedy text from every bundled demo model, then a batch whose prompts share a long prefix.

    python -m stateserve.demo                 # every bundled model
    python -m stateserve.demo llama hybrid    # only the folders whose names contain these words

The models (stateserve/assets/models/, trained by scripts/train_demo_models.py) were trained on Python's own
documentation, so the prompts read like it. A model whose architecture this build of stateserve cannot run
yet is skipped with a one-line notice.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time
from typing import Any

from stateserve import ModelRegistry, SamplingParams
from stateserve.assets import bundled_models

PROMPTS = [
    "The with statement is used to",
    "A list comprehension consists of",
    "The import statement",
    "Return a new list containing",
    "def read_text(self, encoding=None):\n",
]
CHAT_QUESTION = "What does the Python documentation say about The \"for\" statement?"
# The second pass: one long shared passage, then different questions about it. With prefix caching the
# later requests reuse the computed prefix (KV blocks, or a recurrent state snapshot) of the first.
SHARED_PREFIX = (
    "The \"try\" statement specifies exception handlers and/or cleanup code for a group of statements. "
    "The except clause(s) specify one or more exception handlers. When no exception occurs in the try "
    "clause, no exception handler is executed. When an exception occurs in the try suite, a search for an "
    "exception handler is started. This search inspects the except clauses in turn until one is found that "
    "matches the exception. If no except clause matches the exception, the search for an exception handler "
    "continues in the surrounding code and on the invocation stack.\n\n"
)
SHARED_SUFFIXES = ["The finally clause", "If the else clause is present,", "An expression-less except clause"]
MAX_TOKENS = 40
PREFIX_PASS_TOKENS = 16  # only the first line of these is shown


def _architecture(path: str) -> str:
    with open(os.path.join(path, "config.json")) as f:
        archs = json.load(f).get("architectures") or ["?"]
    return archs[0]


def _show(prompt: str, completion: str) -> None:
    indent = " " * 14
    print("  prompt:     " + textwrap.indent(prompt.rstrip("\n"), indent).lstrip())
    print("  completion: " + textwrap.indent(completion.strip("\n") or "(empty)", indent).lstrip())


def _timed_generate(llm: Any, prompts: list[str], params: SamplingParams) -> tuple[list[Any], float]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, time.perf_counter() - start


def _open(path: str) -> tuple[Any, str]:
    """An LLM with prefix caching on where the engine offers it, else with the engine's defaults."""
    from stateserve import LLM

    try:
        return LLM(path, enable_prefix_caching=True), "on"
    except (ValueError, NotImplementedError) as err:
        return LLM(path), f"not available ({err})"


def demo_model(name: str, path: str, max_tokens: int) -> None:
    arch = _architecture(path)
    if not ModelRegistry.is_registered(arch):
        print(f"--- {name}: skipped, stateserve does not run {arch} yet")
        return
    print(f"=== {name} ({arch}) ===")
    print(f"loading {path} ...")
    load_start = time.perf_counter()
    llm, caching = _open(path)
    print(f"loaded in {time.perf_counter() - load_start:.1f}s; prefix caching {caching}")
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    try:
        prompts = list(PROMPTS)
        tokenizer = llm.get_tokenizer()
        if getattr(tokenizer, "chat_template", None):
            prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": CHAT_QUESTION}],
                                                         tokenize=False, add_generation_prompt=True))
        outs, seconds = _timed_generate(llm, prompts, params)
        for prompt, out in zip(prompts, outs):
            _show(prompt, out.outputs[0].text)
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"{len(prompts)} prompts in one batch: {generated} tokens in {seconds:.2f}s = "
              f"{generated / seconds:.0f} tokens/s")

        # Prefix-cache pass: the first request computes the shared prefix, the batch after it may reuse it.
        shared = [SHARED_PREFIX + s for s in SHARED_SUFFIXES]
        prefix_len = len(llm.llm_engine.tokenize(SHARED_PREFIX))
        print(f"shared prefix of {prefix_len} tokens, {len(shared)} questions after it:")
        short = SamplingParams(temperature=0, max_tokens=PREFIX_PASS_TOKENS)
        first, _ = _timed_generate(llm, shared[:1], short)
        rest, seconds = _timed_generate(llm, shared[1:], short)
        for suffix, out in zip(SHARED_SUFFIXES, first + rest):
            first_line = (out.outputs[0].text.splitlines() or [""])[0]
            print(f"  {len(out.prompt_token_ids)}-token prompt, num_cached_tokens={out.num_cached_tokens}: "
                  f"...{suffix}{first_line}")
        print(f"  second batch: {sum(len(o.outputs[0].token_ids) for o in rest)} tokens in {seconds:.2f}s")
    finally:
        llm.shutdown()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Generate with the bundled demo models.")
    p.add_argument("only", nargs="*", help="run only models whose folder name contains one of these")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    args = p.parse_args(argv)
    # each line as it happens, also when make's output goes to a pipe or a log (block-buffered otherwise)
    sys.stdout.reconfigure(line_buffering=True)
    os.environ.setdefault("STATESERVE_DISABLE_TQDM", "1")
    models = {n: m for n, m in bundled_models().items() if not args.only or any(o in n for o in args.only)}
    # attention-free first, then the hybrid, then the transformer (the order default_model_path prefers)
    order = ["mamba2", "hybrid", "llama"]
    models = dict(sorted(models.items(), key=lambda kv: next((i for i, w in enumerate(order) if w in kv[0]),
                                                             len(order))))
    if not models:
        print("no bundled demo models found: run `python scripts/train_demo_models.py` to train them")
        return
    start, failed = time.perf_counter(), []
    for name, path in models.items():
        try:
            demo_model(name, path, args.max_tokens)
        except Exception as err:  # one broken model should not hide the others' output
            print(f"--- {name}: failed: {type(err).__name__}: {err}")
            failed.append(name)
        print()
    print(f"demo finished in {time.perf_counter() - start:.1f}s")
    if failed:
        raise SystemExit(f"demo failed for: {', '.join(failed)}")


if __name__ == "__main__":
    main()
