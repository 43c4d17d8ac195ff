"""glibc malloc tuning of a CPU engine process: large temporaries come back from the heap instead of being
page-faulted anew, only when switched on, and free memory is returned on request."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from stateserve.platform import host_allocator

pytestmark = pytest.mark.skipif(host_allocator._glibc() is None, reason="not glibc")

_CHILD = """
import resource, sys, torch
from stateserve.platform import host_allocator
tuned = host_allocator.tune()
faults = []
for _ in range(14):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.ones(8 << 20)  # 32 MiB, touched
    del t
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
host_allocator.release_free_memory()
print(tuned, sum(faults[-6:]))  # steady state: glibc settles after a few rounds
"""


def _run(setting: str) -> tuple[bool, int]:
    env = dict(os.environ, STATESERVE_MALLOC_TUNING=setting)
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True)
    tuned, faults = out.stdout.split()
    return tuned == "True", int(faults)


def test_tuning_reuses_large_temporaries_and_can_be_switched_off():
    tuned, faults_tuned = _run("1")
    untuned, faults_default = _run("0")
    assert tuned and not untuned
    # 32 MiB is 8192 pages: by default every allocation faults them all again
    assert faults_default > 6 * 6000
    assert faults_tuned < faults_default / 4
