#!/usr/bin/env bash
# Run the CUDA checks of stateserve (parity with transformers, graphs on/off, decode tokens/s, memory after
# shutdown) and write JSON. Usage: bench/gpu_check.sh [--out FILE] [--parts parity,graphs,speed,memory]
# Exits 0 with a message (and status "no_cuda" in the JSON) when there is no CUDA device.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
# the parts have their own limits (4.5 minutes together); this one catches a hang outside them
exec timeout --signal=INT --kill-after=15 300 "$PYTHON" bench/gpu_check.py "$@"
