"""Redraw the bar chart of a bench/throughput.py run from its JSON, without running the benchmark again.

    python bench/plot.py RESULTS.json [--out FILE.png]

The PNG goes next to the JSON (same name, .png) unless --out names another file. throughput.py draws its chart with
this module's `plot`, so a redrawn chart is the one the benchmark wrote. Needs matplotlib:
pip install -e '.[bench]'.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def plot(rows: list[dict], engines: list[str], workloads: list[str], path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable: no plot (pip install -e '.[bench]' for one)")
        return False
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.5), squeeze=False)
    for ax, name in zip(axes[0], workloads):
        groups = list(dict.fromkeys((r["model"], r["dtype"]) for r in rows if r["workload"] == name))
        width = 0.8 / len(engines)
        for i, engine in enumerate(engines):
            speeds = [next((r["tok_s"] or 0 for r in rows if (r["model"], r["dtype"]) == g and
                            r["workload"] == name and r["engine"] == engine), 0) for g in groups]
            ax.bar([g + i * width - 0.4 + width / 2 for g in range(len(groups))], speeds, width, label=engine)
        ax.set_xticks(range(len(groups)), [f"{m}\n{d}" for m, d in groups])
        ax.set_title(f"{name} ({'prompt' if name == 'prefill' else 'generated'} tok/s)")
        ax.set_ylabel("tokens / s")
        ax.grid(axis="y", alpha=0.3)
    # One legend above the panels: inside a panel it can hide the top of a bar.
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(engines), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", help="a JSON file written by bench/throughput.py (or one in its format)")
    p.add_argument("--out", default=None, help="PNG to write (default: the JSON's path with .png)")
    args = p.parse_args(argv)
    with open(args.json) as f:
        data = json.load(f)
    rows = data["rows"]
    # The run's own order: rows are written engine by engine, and "workloads" keeps the order they were asked in.
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    workloads = [w for w in data.get("workloads", {}) if any(r["workload"] == w for r in rows)] or \
        list(dict.fromkeys(r["workload"] for r in rows))
    out = args.out or os.path.splitext(args.json)[0] + ".png"
    if not plot(rows, engines, workloads, out):
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
