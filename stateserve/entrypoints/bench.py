"""`stateserve bench throughput [ARGS...]`: runs bench/throughput.py of a source checkout with ARGS.

The benchmarks are not part of the installed package (they build models, start peer engines and write
results), so this subcommand only forwards to the checkout's script; `stateserve bench throughput --help`
prints that script's options."""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = {"throughput": "throughput.py"}


def bench_script(name: str) -> str:
    path = os.path.join(os.environ.get("STATESERVE_BENCH_DIR", os.path.join(REPO, "bench")), SCRIPTS[name])
    if not os.path.isfile(path):
        raise ValueError(f"{path} not found: the benchmarks ship with stateserve's source checkout "
                         "(run from an editable install, or set STATESERVE_BENCH_DIR to its bench/ folder)")
    return path


def cmd_bench(args: argparse.Namespace) -> int:
    path = bench_script(args.bench_command)
    spec = importlib.util.spec_from_file_location(f"stateserve_bench_{args.bench_command}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    sys.argv[0] = f"stateserve bench {args.bench_command}"  # the script's --help and errors name the command
    return int(module.main(args.args) or 0)


def add_bench_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("bench", help="benchmarks (from a source checkout)")
    sub = p.add_subparsers(dest="bench_command", required=True)
    for name in SCRIPTS:
        # every argument, --help included, goes to the script's own parser: "\0" means none is ours
        b = sub.add_parser(name, help=f"bench/{SCRIPTS[name]}; see `stateserve bench {name} --help`",
                           add_help=False, prefix_chars="\0")
        b.add_argument("args", nargs=argparse.REMAINDER)
        b.set_defaults(func=cmd_bench)
