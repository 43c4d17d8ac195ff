"""Causal prefill attention: stateserve's C++ kernel (csrc/prefill_attention.cpp, reading the paged cache in place)
against PyTorch's CPU flash kernel on the same queries, keys and values, by chunk length and cached context. For a
chunk after context the flash side does what the engine's fallback does: the context and the chunk in two calls
(their merge left out), on copies of the keys and values. The limit PREFILL_KERNEL_MAX_KEYS_8_LANES in
stateserve/platform/kernels.py comes from this table.

    python bench/prefill_attention.py [--dtypes float32,bfloat16] [--heads 12] [--head-dim 64] [--threads N]

Prints ms and GFLOP/s (causal: the visible half of the chunk's own scores counted) for each engine.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.machine_limits import DTYPES, best_time  # noqa: E402
from stateserve.platform import cpu_kernels  # noqa: E402

CASES = [(0, 256), (256, 256), (0, 512), (512, 512), (0, 1024), (1024, 1024), (0, 2048), (2048, 2048)]  # (ctx, rows)
BLOCK_SIZE = 16


def measure(kernels, dtype: torch.dtype, heads: int, head_dim: int, ctx: int, rows: int) -> tuple[float, float]:
    """Seconds of (the kernel, PyTorch's flash path) for one chunk of `rows` query rows after `ctx` cached keys."""
    total = ctx + rows
    num_blocks = -(-total // BLOCK_SIZE)
    k_cache, v_cache = (torch.randn(num_blocks, heads, BLOCK_SIZE, head_dim).to(dtype) for _ in range(2))
    table = torch.arange(num_blocks)
    q = torch.randn(rows, heads, head_dim).to(dtype)
    scale = head_dim ** -0.5
    kernel = best_time(lambda: kernels.paged_prefill_attention(q, k_cache, v_cache, table, ctx, scale),
                       min_total_s=0.3, max_reps=10)
    keys, values = (c.transpose(0, 1).flatten(1, 2)[None, :, :total] for c in (k_cache, v_cache))  # [1, H, L, D]
    queries = q.transpose(0, 1)[None]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def torch_path() -> None:
        if ctx:
            flash(queries, keys[:, :, :ctx].contiguous(), values[:, :, :ctx].contiguous(), 0.0, False, scale=scale)
        flash(queries, keys[:, :, ctx:].contiguous(), values[:, :, ctx:].contiguous(), 0.0, True, scale=scale)

    return kernel, best_time(torch_path, min_total_s=0.3, max_reps=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = cpu_kernels.load()
    for name in args.dtypes.split(","):
        if name not in DTYPES:
            parser.error(f"unknown dtype {name!r}; choose from {sorted(DTYPES)}")
        if kernels is None or not kernels.prefill_attention_supported(DTYPES[name], args.head_dim):
            raise SystemExit(f"no prefill attention kernel here for {name}, head size {args.head_dim}")
    print(f"{torch.backends.cpu.get_cpu_capability()}, {args.threads} threads, {args.heads} heads of {args.head_dim}")
    for name in args.dtypes.split(","):
        for ctx, rows in CASES:
            kernel, flash = measure(kernels, DTYPES[name], args.heads, args.head_dim, ctx, rows)
            flops = 4 * args.heads * args.head_dim * (rows * ctx + rows * rows / 2)
            print(f"{name:>8} context {ctx:>5} rows {rows:>5}: kernel {kernel * 1e3:7.1f} ms "
                  f"({flops / kernel / 1e9:5.0f} GFLOP/s)  flash {flash * 1e3:7.1f} ms ({flops / flash / 1e9:5.0f})",
                  flush=True)


if __name__ == "__main__":
    main()
