"""Redraw the bar chart of a bench/throughput.py run from its JSON, without running the benchmark again.

    python bench/plot.py RESULTS.json [--out FILE.png]

The PNG goes next to the JSON (same name, .png) unless --out names another file. The drawing is throughput.py's
own `plot`, so a redrawn chart is the one the benchmark would have written. Needs matplotlib:
pip install -e '.[bench]'.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from throughput import plot  # noqa: E402


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
