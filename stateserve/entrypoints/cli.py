"""`stateserve` command line: generate (one-off text), serve (OpenAI-compatible HTTP), bench."""
from __future__ import annotations

import argparse
import sys
import time

from stateserve.entrypoints.engine_args import add_engine_args, default_model, engine_kwargs


def cmd_generate(args: argparse.Namespace) -> int:
    from stateserve import LLM, SamplingParams

    model = args.model or default_model()
    with LLM(model, **engine_kwargs(args)) as llm:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.sampling_seed)
        start = time.perf_counter()
        outs = llm.generate(args.prompt, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        num_tokens = 0
        for out in outs:
            print(f"Prompt: {out.prompt!r}\nOutput: {out.outputs[0].text!r}\n")
            num_tokens += len(out.outputs[0].token_ids)
        print(f"{num_tokens} tokens in {elapsed:.2f} s ({num_tokens / max(elapsed, 1e-9):.1f} tokens/s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stateserve", description="LLM inference for decoders, SSMs and hybrids")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("--model", default=None, help="Hugging Face model folder (default: a bundled demo model)")
    g.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for several")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None)
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)
    from stateserve.entrypoints import server

    server.add_serve_parser(sub)
    from stateserve.entrypoints import bench

    bench.add_bench_parser(sub)
    return parser


def run_worker_node(args: argparse.Namespace) -> int:
    """--node-rank K > 0: this host runs only its tensor-parallel ranks; node 0 runs the engine (and the server)."""
    from stateserve.config import EngineConfig
    from stateserve.distributed.driver import run_worker_node as run

    config = EngineConfig.from_kwargs(model=args.model or default_model(), **engine_kwargs(args))
    return run(config)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "node_rank", 0):
            return run_worker_node(args)
        return args.func(args)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
