"""The linear kernels by row count: stateserve's few-row kernel (csrc/linear.cpp), its panel kernel
(csrc/packed_linear.cpp; "panel-lanes": packed for batch_invariant's summation order) and PyTorch's F.linear, on
every weight of a base-size model in turn (so the weights come from memory, as in decoding), in float32 and
bfloat16. The row thresholds in stateserve/platform/kernels.py
(MAX_ROWS_PREPACKED*) come from this kind of table.

    python bench/linears.py [--dtypes float32,bfloat16] [--rows 1,2,4,6,8,16] [--threads N] [--json FILE]
        [--formats q8_0,q4_0,q4_k,q6_k]

Prints, per dtype and row count, ms for one pass over the weights and the GB/s of weights that makes. The weights
are Llama-base's 12 layers of [3072, 768] and [768, 3072] (hidden 768, MLP 3072), random. `--formats` adds the
quantized products (csrc/quant_*.cpp, int8 activations, bfloat16 x) on the same shapes, random codes, the GB/s
counting the packed bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.machine_limits import DTYPES, best_time  # noqa: E402
from stateserve.platform import cpu_kernels  # noqa: E402
from stateserve.layers.linear import PANEL_COLUMNS  # noqa: E402

SHAPES = [(3072, 768), (768, 3072)] * 12  # [out_features, in_features] of a base model's MLPs, layer by layer


def packed(kernels, weight: torch.Tensor, lane_order: bool = False) -> torch.Tensor:
    step = 2 if weight.dtype == torch.bfloat16 else 1
    n, k = weight.shape
    out = torch.zeros(-(-n // PANEL_COLUMNS), k // step, PANEL_COLUMNS, dtype=torch.int32)
    kernels.pack_linear_weight_(out, weight, lane_order)
    return out


def quantized(kernels, fmt: str, n: int, k: int) -> torch.Tensor:
    """A random [n, k] weight of `fmt`, packed for its product."""
    codes = lambda hi: torch.randint(0, hi, (n, k), dtype=torch.uint8)  # noqa: E731
    half = lambda cols: (torch.rand(n, cols) * 0.01).half()  # noqa: E731
    small = lambda cols: torch.randint(0, 64, (n, cols), dtype=torch.uint8)  # noqa: E731
    if fmt == "q8_0":
        return kernels.q8_0_pack(torch.randint(-127, 128, (n, k), dtype=torch.int8), half(k // 32))
    if fmt == "q4_0":
        return kernels.q4_pack("q4_0", codes(16), half(k // 32))
    if fmt == "q4_k":
        return kernels.q4_pack("q4_k", codes(16), half(k // 256), half(k // 256), small(k // 32), small(k // 32))
    if fmt == "q6_k":
        return kernels.q6_k_pack(codes(64), torch.randint(-128, 128, (n, k // 16), dtype=torch.int8), half(k // 256))
    raise SystemExit(f"unknown format {fmt!r}: q8_0, q4_0, q4_k, q6_k")


def measure_quantized(fmt: str, rows_list: list[int]) -> list[dict]:
    kernels = cpu_kernels.load()
    if kernels is None:
        raise SystemExit("the C++ kernels did not build here: nothing to compare")
    product = {"q8_0": kernels.q8_0_linear, "q6_k": kernels.q6_k_linear}.get(fmt, kernels.q4_linear)
    weights = [(quantized(kernels, fmt, n, k), n, k) for n, k in SHAPES]
    nbytes = sum(p.numel() for p, _, _ in weights)
    results = []
    for rows in rows_list:
        xs = {k: torch.randn(rows, k).bfloat16() for k in {k for _, k in SHAPES}}
        seconds = best_time(lambda: [product(xs[k], p, None, n, k, True) for p, n, k in weights],
                            min_total_s=0.3, max_reps=10)
        results.append({"format": fmt, "rows": rows, "ms": seconds * 1e3, "weight_GB_s": nbytes / seconds / 1e9})
        print(f"{fmt:>8} {rows:>4} rows  {seconds * 1e3:7.2f} ms ({nbytes / seconds / 1e9:5.1f} GB/s of "
              f"{nbytes / 1e6:.0f} MB)", flush=True)
    return results


def measure(dtype: torch.dtype, rows_list: list[int]) -> list[dict]:
    kernels = cpu_kernels.load()
    if kernels is None:
        raise SystemExit("the C++ kernels did not build here: nothing to compare")
    weights = [torch.randn(n, k).to(dtype) for n, k in SHAPES]
    panels = [packed(kernels, w) for w in weights] if kernels.packed_linear_supported(dtype, 768) else None
    lane_panels = [packed(kernels, w, True) for w in weights] if panels is not None else None
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    results = []
    for rows in rows_list:
        xs = {k: torch.randn(rows, k).to(dtype) for k in {k for _, k in SHAPES}}
        paths = {"torch": lambda: [F.linear(xs[w.shape[1]], w) for w in weights]}
        if kernels.fast_linear_supported(dtype):
            paths["few-row"] = lambda: [kernels.fast_linear(xs[w.shape[1]], w, None) for w in weights]
        if panels is not None:
            paths["panel"] = lambda: [kernels.packed_linear(xs[w.shape[1]], p, None, w.shape[0])
                                      for w, p in zip(weights, panels)]
            # batch_invariant's layout: sums in the few-row kernel's order
            paths["panel-lanes"] = lambda: [kernels.packed_linear(xs[w.shape[1]], p, None, w.shape[0], True)
                                            for w, p in zip(weights, lane_panels)]
        row = {"dtype": str(dtype).removeprefix("torch."), "rows": rows}
        for name, fn in paths.items():
            seconds = best_time(fn, min_total_s=0.3, max_reps=10)
            row[name] = {"ms": seconds * 1e3, "weight_GB_s": nbytes / seconds / 1e9}
        results.append(row)
        cells = "  ".join(f"{name} {row[name]['ms']:7.2f} ms ({row[name]['weight_GB_s']:5.1f} GB/s)"
                          for name in paths)
        print(f"{row['dtype']:>8} {rows:>4} rows  {cells}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rows", default="1,2,4,6,8,16")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--json", help="also write the table here")
    parser.add_argument("--formats", default="", help="quantized formats to add: q8_0,q4_0,q4_k,q6_k")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    unknown = [d for d in args.dtypes.split(",") if d not in DTYPES]
    if unknown:
        parser.error(f"unknown dtype(s) {unknown}; choose from {sorted(DTYPES)}")
    print(f"{torch.backends.cpu.get_cpu_capability()}, {args.threads} threads, {len(SHAPES)} weights "
          f"(a pass reads each once)")
    rows = [int(x) for x in args.rows.split(",")]
    results = [r for d in args.dtypes.split(",") for r in measure(DTYPES[d], rows)]
    results += [r for f in args.formats.split(",") if f for r in measure_quantized(f, rows)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
