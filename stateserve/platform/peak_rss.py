"""The process's resident memory, sampled while a CPU forward runs: how the runner measures a step's activation
peak on a CPU, where no allocator keeps count."""
from __future__ import annotations

import os
import sys
import threading


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """The process's resident memory at its highest so far (VmHWM: the kernel keeps it); 0 where /proc lacks it."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return 0


class PeakRssSampler:
    """Samples the process's resident memory from a thread while a CPU forward runs; `growth` is the peak above
    the level before it. Short spikes between samples are missed, and memory the allocator already holds and
    reuses is not counted (it is resident already, so it needs no new room)."""

    def __init__(self, period_s: float = 0.0005) -> None:
        self.period_s = period_s
        self.base = self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self) -> "PeakRssSampler":
        self.base = self.peak = rss_bytes()
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(self.period_s)  # the forward holds the GIL between ops: let the sampler in
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.peak = max(self.peak, rss_bytes())
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._switch_interval)

    @property
    def growth(self) -> int:
        return max(0, self.peak - self.base)
