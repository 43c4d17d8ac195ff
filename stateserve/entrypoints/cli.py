"""`stateserve` command line: generate (one-off text), serve (OpenAI-compatible HTTP), bench."""
from __future__ import annotations

import argparse
import sys
import time


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Every EngineConfig field as a --flag (shared by generate and serve)."""
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--mamba-cache-mode", default=None, choices=["none", "all", "align"])
    p.add_argument("--mamba-ssm-cache-dtype", default="float32", choices=["float32", "bfloat16", "auto"],
                   help="dtype of Mamba2-style SSM states (auto: the model's); bfloat16 halves their memory traffic")
    p.add_argument("--device", default="auto")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="no tokenizer: prompts must be token ids and outputs carry no text (benchmarks)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    keys = ["dtype", "load_format", "seed", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
            "block_size", "enable_prefix_caching", "mamba_cache_mode", "mamba_ssm_cache_dtype", "device", "enforce_eager",
            "kv_cache_memory_bytes", "tokenizer", "skip_tokenizer_init"]
    return {k: getattr(args, k) for k in keys}


def default_model() -> str:
    from stateserve.assets import default_model_path

    return default_model_path()


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
    try:
        from stateserve.entrypoints import server
    except ImportError:
        server = None
    if server is not None and hasattr(server, "add_serve_parser"):
        server.add_serve_parser(sub)
    from stateserve.entrypoints import bench

    bench.add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
