"""The path a user takes to see stateserve's logs: a plain script (or `stateserve serve`) with no logging set up of
its own must print the load report, with time, level and source, on stdout, as vLLM does; the two environment
variables change that, and an application that configures logging itself gets each line once.

Each case runs a fresh interpreter, since the configuration happens on the first import of the package."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# `LEVEL MM-DD HH:MM:SS [file.py:line] message`: the level, then the time, then where the line was logged
LOAD_LINE = re.compile(r"^INFO \d\d-\d\d \d\d:\d\d:\d\d \[model_runner\.py:\d+\] "
                       r"Model loading took \d+\.\d+ GiB memory and \d+\.\d+ seconds$", re.M)
LOAD_TEXT = "Model loading took"

# What a user writes: build an engine on the bundled demo model, nothing about logging. PREAMBLE lets a case set
# up logging the way an application would, before stateserve is imported.
SCRIPT = """
import logging
{preamble}
from stateserve import LLM
from stateserve.assets import default_model_path

LLM(default_model_path(), kv_cache_memory_bytes=16 << 20).shutdown()
logging.getLogger("stateserve.probe").warning("probe warning")
logger = logging.getLogger("stateserve")
print("LOGGER", logging.getLevelName(logger.level), len(logger.handlers), logger.propagate)
"""


def _env(**overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("STATESERVE_CONFIGURE_LOGGING", "STATESERVE_LOG_LEVEL")}
    # the C++ kernels play no part in logging; without them no case waits for a compiler
    env.update(STATESERVE_CPU_KERNELS="0", STATESERVE_DISABLE_TQDM="1", STATESERVE_NUM_THREADS="1", **overrides)
    return env


def _run(preamble: str = "", **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(preamble=preamble)], capture_output=True,
                          text=True, env=_env(**env), cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_a_plain_script_prints_the_load_report_with_time_level_and_source():
    proc = _run()
    assert len(LOAD_LINE.findall(proc.stdout)) == 1, proc.stdout + proc.stderr
    assert LOAD_TEXT not in proc.stderr  # on stdout only, like vLLM's logs
    assert re.search(r"^WARNING .* \[<string>:\d+\] probe warning$", proc.stdout, re.M), proc.stdout
    assert "LOGGER INFO 1 False" in proc.stdout  # one handler of our own, nothing passed on to the root


def test_an_application_root_handler_does_not_print_the_lines_twice():
    proc = _run('logging.basicConfig(level=logging.INFO, format="ROOT %(name)s %(message)s")')
    assert len(LOAD_LINE.findall(proc.stdout)) == 1, proc.stdout + proc.stderr
    assert "ROOT stateserve" not in proc.stdout + proc.stderr


def test_configure_logging_0_leaves_logging_to_the_application():
    quiet = _run(STATESERVE_CONFIGURE_LOGGING="0")
    assert LOAD_TEXT not in quiet.stdout + quiet.stderr
    assert "LOGGER NOTSET 0 True" in quiet.stdout  # no handler, no level, propagation as Python's default
    # the application's own configuration then decides: here a root handler at INFO with its own format
    own = _run('logging.basicConfig(level=logging.INFO, format="APP %(levelname)s %(message)s")',
               STATESERVE_CONFIGURE_LOGGING="0")
    assert re.findall(r"^APP INFO Model loading took .* GiB memory and .* seconds$", own.stderr, re.M), own.stderr
    assert LOAD_TEXT not in own.stdout


def test_log_level_warning_hides_the_info_lines():
    proc = _run(STATESERVE_LOG_LEVEL="warning")  # names are accepted in any case
    assert LOAD_TEXT not in proc.stdout + proc.stderr
    assert re.search(r"^WARNING .* probe warning$", proc.stdout, re.M), proc.stdout
    assert "LOGGER WARNING 1 False" in proc.stdout


def test_an_invalid_log_level_is_a_clear_error():
    proc = subprocess.run([sys.executable, "-c", "import stateserve"], capture_output=True, text=True,
                          env=_env(STATESERVE_LOG_LEVEL="LOUD"), cwd=REPO, timeout=120)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "STATESERVE_LOG_LEVEL='LOUD'" in last and "DEBUG, INFO, WARNING, ERROR, CRITICAL" in last, proc.stderr


def test_serve_prints_the_load_report():
    from stateserve.assets import default_model_path

    cmd = [sys.executable, "-m", "stateserve.entrypoints.cli", "serve", default_model_path(), "--port", "0",
           "--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO)
    out: list[str] = []
    err: list[str] = []
    readers = [threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True),
               threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)]
    for t in readers:
        t.start()
    try:
        deadline = time.monotonic() + 120
        # the server logs its address once the engine is built: by then the load report must be out
        while not any("on http://" in line for line in out + err):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(out + err)
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    for t in readers:
        t.join(timeout=10)
    stdout, stderr = "".join(out), "".join(err)
    assert len(LOAD_LINE.findall(stdout)) == 1, stdout + stderr
    assert re.search(r"^INFO .* \[server\.py:\d+\] serving .* on http://127\.0\.0\.1:\d+$", stdout, re.M), stdout
    assert LOAD_TEXT not in stderr
