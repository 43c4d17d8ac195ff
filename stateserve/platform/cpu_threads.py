"""How many intra-op threads a CPU step computes on: all of its cores on a quiet machine, fewer when other
processes want them.

Why: every parallel kernel (ours, oneDNN's, ATen's) splits its work statically over the OpenMP team and ends at a
barrier. When another process holds one of the cores, the team member waiting for that core delays the whole
region by a scheduler time slice (milliseconds) while a kernel takes microseconds: measured on a 2-core machine,
a two-job compile at nice 10 made two-thread decode ~100x slower than one thread. A team no larger than the cores
the other processes leave free never waits for a slice.

How: `ThreadGovernor.poll()`, called by the thread that runs the forward before each step (and at a few points of
loading), compares over windows of `window_s` the CPU time the CPUs this process may run on spent busy
(/proc/stat, steal included: a vCPU the hypervisor takes stalls a team too) with this process's own CPU time
(getrusage). The difference is the cores other processes use; the team is the usable cores minus those, rounded so that a fraction
of a core above `margin` costs a whole thread (a low-priority process gets little CPU while we spin, yet stalls
every region it lands in), never below one thread and never above the maximum (STATESERVE_NUM_THREADS, or the
torch thread count the engine started with). Dropping takes one window; growing back takes two in a row, so a
burst does not make the team flap. STATESERVE_ADAPTIVE_THREADS=0 keeps the maximum whatever the load.

OpenMP's team size is per calling thread, so the count is applied in each thread that polls."""
from __future__ import annotations

import logging
import math
import os
import resource
import threading
import time

import torch

logger = logging.getLogger("stateserve")

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_INFO_EVERY_S = 60.0  # a load that comes and goes is logged at INFO at most this often; each change at DEBUG
# The first window may reach back to this module's import (a script imports, then builds its engine within
# seconds): a small model loads in a tenth of a second and generates in a few more, too soon for a fresh window.
_FIRST_WINDOW_MAX_S = 30.0


def busy_seconds(cpus: frozenset[int]) -> float | None:
    """CPU seconds the given CPUs have spent not idle since boot (whoever ran), or None without /proc/stat."""
    total, seen = 0, 0
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if not line.startswith(b"cpu"):
                    break
                fields = line.split()
                if fields[0] == b"cpu" or int(fields[0][3:]) not in cpus or len(fields) < 9:
                    continue
                # user nice system idle iowait irq softirq steal [guest guest_nice: inside user and nice]
                user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
                total += user + nice + system + irq + softirq + steal
                seen += 1
    except (OSError, ValueError):
        return None
    return total / _TICKS_PER_S if seen else None


def own_cpu_seconds() -> float:
    """CPU seconds this process (all its threads) has used."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def usable_cpus() -> frozenset[int]:
    """The CPUs this process may run on (its affinity), where the team's threads and its rivals meet."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


def threads_for(max_threads: int, cores: int, others: float, margin: float) -> int:
    """The team size when other processes use `others` cores (a fraction above `margin` counts whole)."""
    taken = max(0, math.ceil(others - margin))
    return max(1, min(max_threads, cores - taken))


class ThreadGovernor:
    def __init__(self, max_threads: int, *, adaptive: bool = True, window_s: float = 0.25, margin: float = 0.15,
                 cpus: frozenset[int] | None = None) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self.max_threads = max_threads
        measured_since_import = cpus is None and _IMPORT_SAMPLE is not None and _IMPORT_SAMPLE[0] == usable_cpus()
        self.cpus = cpus if cpus is not None else usable_cpus()
        self.cores = len(self.cpus)
        self.adaptive = adaptive and max_threads > 1 and busy_seconds(self.cpus) is not None
        self.window_s = window_s
        self.margin = margin
        self.threads = max_threads  # the decision in force
        self.others = 0.0  # cores other processes used in the last full window
        self._applied = threading.local()  # team size last set in each polling thread
        self._lock = threading.Lock()
        self._start = _IMPORT_SAMPLE[1] if measured_since_import else self._sample()
        self._longest_window = _FIRST_WINDOW_MAX_S
        self._pending_raise = False
        self._last_info = -math.inf

    def _sample(self) -> tuple[float, float, float]:
        return time.monotonic(), busy_seconds(self.cpus) or 0.0, own_cpu_seconds()

    def poll(self) -> int:
        """Re-decide when a window has passed, apply the decision to the calling thread; returns the team size."""
        if self.adaptive and time.monotonic() - self._start[0] >= self.window_s:
            with self._lock:
                self._decide()
        if getattr(self._applied, "threads", None) != self.threads:
            torch.set_num_threads(self.threads)
            self._applied.threads = self.threads
        return self.threads

    def _decide(self) -> None:
        now, before = self._sample(), self._start
        wall = now[0] - before[0]
        if wall < self.window_s:
            return  # another thread decided while this one waited for the lock
        self._start = now
        longest, self._longest_window = self._longest_window, 8 * self.window_s
        if wall > longest:
            return  # the engine sat idle: an average over the idle time says little about now; measure afresh
        # this process runs only on self.cpus, so what else kept them busy is the other processes' share
        self.others = max(0.0, (now[1] - before[1]) - (now[2] - before[2])) / wall
        target = threads_for(self.max_threads, self.cores, self.others, self.margin)
        if target > self.threads and not self._pending_raise:
            self._pending_raise = True  # grow only when the next window agrees
            return
        self._pending_raise = False
        if target != self.threads:
            self._report(target)
            self.threads = target

    def _report(self, target: int) -> None:
        message = ("other processes use about %.1f of %d cores: computing on %d thread(s) instead of %d "
                   "(STATESERVE_ADAPTIVE_THREADS=0 keeps %d)")
        args = (self.others, self.cores, target, self.threads, self.max_threads)
        now = time.monotonic()
        if target < self.threads and now - self._last_info >= _INFO_EVERY_S:
            self._last_info = now
            logger.info(message, *args)
        else:
            logger.debug(message, *args)


def _import_sample() -> tuple[frozenset[int], tuple[float, float, float]] | None:
    cpus = usable_cpus()
    busy = busy_seconds(cpus)
    return None if busy is None else (cpus, (time.monotonic(), busy, own_cpu_seconds()))


_IMPORT_SAMPLE = _import_sample()
_governor: ThreadGovernor | None = None
_governor_key: tuple[int, bool] | None = None
_governor_lock = threading.Lock()


def governor() -> ThreadGovernor:
    """The process's governor (threads are a process-wide resource, shared by every engine in it). Its maximum
    is STATESERVE_NUM_THREADS when set, else torch's thread count when it is first asked for; a change of either
    variable makes a new one."""
    global _governor, _governor_key
    from stateserve import envs

    key = (envs.STATESERVE_NUM_THREADS, envs.STATESERVE_ADAPTIVE_THREADS)
    with _governor_lock:
        if _governor is None or key != _governor_key:
            max_threads = key[0] if key[0] > 0 else (_governor.max_threads if _governor else torch.get_num_threads())
            _governor, _governor_key = ThreadGovernor(max_threads, adaptive=key[1]), key
    return _governor


def reset_governor() -> None:
    """Forget the process's governor (tests)."""
    global _governor, _governor_key
    with _governor_lock:
        _governor = _governor_key = None
