"""The thread governor (platform/cpu_threads.py): a team no larger than the cores other processes leave free.

Its arithmetic and its windows against a fake clock and fake CPU counters, then the user's path: an engine in a
subprocess beside busy processes says it computes on fewer threads, and does."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from stateserve.platform import cpu_threads
from stateserve.platform.cpu_threads import ThreadGovernor, threads_for

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("max_threads,cores,others,expected", [
    (2, 2, 0.0, 2), (2, 2, 0.1, 2),  # background noise under the margin costs nothing
    (2, 2, 0.2, 1),  # a niced process that gets little CPU while we spin still takes a thread
    (2, 2, 1.3, 1), (2, 2, 5.0, 1),  # never below one
    (16, 16, 3.2, 12), (8, 16, 3.2, 8),  # never above the maximum
])
def test_threads_for(max_threads, cores, others, expected):
    assert threads_for(max_threads, cores, others, margin=0.15) == expected


class FakeMachine:
    """A clock and the counters the governor reads; `run(seconds, others=..., own=...)` advances them."""

    def __init__(self, monkeypatch):
        self.now, self.busy, self.own = 100.0, 0.0, 0.0
        monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(cpu_threads, "busy_seconds", lambda cpus: self.busy)
        monkeypatch.setattr(cpu_threads, "own_cpu_seconds", lambda: self.own)

    def run(self, seconds: float, others: float, own: float = 1.0) -> None:
        self.now += seconds
        self.busy += (others + own) * seconds
        self.own += own * seconds


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_governor_drops_at_once_and_grows_back_after_two_quiet_windows(monkeypatch, restore_threads):
    machine = FakeMachine(monkeypatch)
    gov = ThreadGovernor(2, window_s=0.25, cpus=frozenset({0, 1}))
    assert gov.poll() == 2 and torch.get_num_threads() == 2
    machine.run(0.3, others=0.05, own=2.0)
    assert gov.poll() == 2  # a quiet machine keeps every thread
    machine.run(0.3, others=0.6, own=1.4)
    assert gov.poll() == 1 and torch.get_num_threads() == 1 and gov.others == pytest.approx(0.6)
    machine.run(0.1, others=0.0)
    assert gov.poll() == 1  # inside a window: no decision
    machine.run(0.3, others=0.0)
    assert gov.poll() == 1  # one quiet window is not enough to grow
    machine.run(0.3, others=0.0)
    assert gov.poll() == 2 and torch.get_num_threads() == 2
    machine.run(0.3, others=0.0)
    machine.run(60.0, others=1.0)  # an idle gap of a minute, then a new window: the gap is not averaged in
    assert gov.poll() == 2
    machine.run(0.3, others=1.0)
    assert gov.poll() == 1


def test_a_burst_between_quiet_windows_does_not_grow_the_team(monkeypatch, restore_threads):
    machine = FakeMachine(monkeypatch)
    gov = ThreadGovernor(2, window_s=0.25, cpus=frozenset({0, 1}))
    machine.run(0.3, others=1.0)
    assert gov.poll() == 1
    for _ in range(5):  # quiet, busy, quiet, busy: never two quiet windows in a row
        machine.run(0.3, others=0.0)
        assert gov.poll() == 1
        machine.run(0.3, others=1.0)
        assert gov.poll() == 1


def test_the_team_size_is_applied_in_every_polling_thread(monkeypatch, restore_threads):
    """OpenMP's team size is an ICV of the calling thread (libgomp shares it between threads outside a team,
    Intel's runtime does not): the server's engine thread must set the decision itself when it polls."""
    machine = FakeMachine(monkeypatch)
    calls, real_set = [], torch.set_num_threads
    monkeypatch.setattr(cpu_threads.torch, "set_num_threads",
                        lambda n: (calls.append((threading.get_ident(), n)), real_set(n)))
    gov = ThreadGovernor(2, window_s=0.25, cpus=frozenset({0, 1}))
    machine.run(0.3, others=1.0)
    assert gov.poll() == 1 and calls == [(threading.get_ident(), 1)]
    worker = threading.Thread(target=gov.poll)
    worker.start()
    worker.join()
    assert calls[1:] == [(worker.ident, 1)]
    gov.poll()
    assert len(calls) == 2  # a thread that already has the decision does not set it again


def test_not_adaptive_keeps_the_maximum(monkeypatch, restore_threads):
    machine = FakeMachine(monkeypatch)
    gov = ThreadGovernor(2, adaptive=False, window_s=0.25, cpus=frozenset({0, 1}))
    machine.run(0.3, others=2.0)
    assert gov.poll() == 2 and torch.get_num_threads() == 2


def test_the_process_governor_follows_the_environment(monkeypatch, restore_threads):
    from stateserve import envs

    monkeypatch.setenv("STATESERVE_NUM_THREADS", "1")
    monkeypatch.setenv("STATESERVE_ADAPTIVE_THREADS", "0")
    envs.disable_envs_cache()
    cpu_threads.reset_governor()
    try:
        gov = cpu_threads.governor()
        assert (gov.max_threads, gov.adaptive) == (1, False)
        monkeypatch.setenv("STATESERVE_NUM_THREADS", "2")
        monkeypatch.setenv("STATESERVE_ADAPTIVE_THREADS", "1")
        assert cpu_threads.governor().max_threads == 2
    finally:
        cpu_threads.reset_governor()


_ENGINE = """
import os, time
from stateserve import LLM, SamplingParams
from stateserve.assets import default_model_path
from stateserve.platform import cpu_threads
llm = LLM(default_model_path())
params = SamplingParams(max_tokens=48, ignore_eos=True)
deadline = time.monotonic() + 60
while cpu_threads.governor().threads > 1 and time.monotonic() < deadline:
    llm.generate(["The with statement"] * 4, params, use_tqdm=False)
print("TEAM", cpu_threads.governor().threads, "OTHERS", round(cpu_threads.governor().others, 2), flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux's /proc/stat and two CPUs")
def test_an_engine_beside_busy_processes_says_it_computes_on_fewer_threads():
    """Two busy loops on the same two CPUs as a two-thread engine: the engine's log says it drops to one thread
    (at INFO, so a user sees why), and its team is one thread."""
    cpus = sorted(os.sched_getaffinity(0))[:2]

    def pin() -> None:
        os.sched_setaffinity(0, cpus)

    env = dict(os.environ, STATESERVE_NUM_THREADS="2", STATESERVE_ADAPTIVE_THREADS="1", PYTHONPATH=REPO,
               STATESERVE_LOG_LEVEL="INFO")
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pin) for _ in range(2)]
    try:
        proc = subprocess.run([sys.executable, "-c", _ENGINE], env=env, capture_output=True, text=True,
                              timeout=300, preexec_fn=pin)
    finally:
        for p in loops:
            p.kill()
            p.wait()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "TEAM 1" in out, out[-3000:]
    assert "other processes use about" in out and "computing on 1 thread(s) instead of 2" in out, out[-3000:]
