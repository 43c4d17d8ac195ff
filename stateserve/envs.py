"""Every environment variable stateserve reads, declared once: name, type, default, doc.

Values are read lazily on attribute access (`envs.STATESERVE_LOG_LEVEL`). An engine calls
`enable_envs_cache()` at start-up to freeze them for speed; tests that change `os.environ`
(e.g. with monkeypatch.setenv) call `disable_envs_cache()` so the new value is seen."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Callable


def _bool(v: str) -> bool:
    if v.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if v.strip().lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0/true/false), got {v!r}")


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _log_level(v: str) -> str:
    # checked here, not by logging.setLevel, so the error names the variable and what it accepts
    name = v.strip().upper()
    if name not in _LOG_LEVELS:
        raise ValueError(f"expected one of {', '.join(_LOG_LEVELS)}, got {v!r}")
    return name


_CPU_ISAS = ("native", "avx512", "avx2", "scalar")


def _cpu_isa(v: str) -> str:
    name = v.strip().lower()
    if name not in _CPU_ISAS:
        raise ValueError(f"expected one of {', '.join(_CPU_ISAS)}, got {v!r}")
    return name


@dataclass(frozen=True)
class EnvVar:
    parse: Callable[[str], Any]
    default: Any
    doc: str


ENV_VARS: dict[str, EnvVar] = {
    "STATESERVE_LOG_LEVEL": EnvVar(_log_level, "INFO", "Level of the 'stateserve' logger (DEBUG, INFO, WARNING, "
                                                       "ERROR, CRITICAL; any case)."),
    "STATESERVE_CONFIGURE_LOGGING": EnvVar(_bool, True, "On the first import, give the 'stateserve' logger a stdout "
                                                        "handler and STATESERVE_LOG_LEVEL, and stop propagation; 0 = "
                                                        "leave logging to the application."),
    "STATESERVE_RUNNER": EnvVar(str, "default", "default | reference: the reference runner recomputes everything "
                                                "one request at a time (the oracle for bug reports)."),
    "STATESERVE_CPU_KV_CACHE_SPACE": EnvVar(float, 4.0, "GiB of cache (KV blocks + state slots) on CPU when "
                                                        "kv_cache_memory_bytes is not given."),
    "STATESERVE_NUM_THREADS": EnvVar(int, 0, "Most intra-op threads a CPU step uses; 0 = torch's count (all "
                                             "cores unless set otherwise)."),
    "STATESERVE_ADAPTIVE_THREADS": EnvVar(_bool, True, "Compute on fewer threads while other processes use cores "
                                                       "(platform/cpu_threads.py); 0 = always the most."),
    "STATESERVE_DISABLE_TQDM": EnvVar(_bool, False, "Turn off progress bars."),
    "STATESERVE_CPU_KERNELS": EnvVar(_bool, True, "Use the C++ CPU kernels (built on first use) where they exist."),
    "STATESERVE_CPU_ISA": EnvVar(_cpu_isa, "native", "Instruction sets the C++ CPU kernels are compiled for: native "
                                                     "(this CPU's), or fewer to build and test another CPU's paths "
                                                     "here: avx512 (no bfloat16 dot products), avx2, scalar."),
    "STATESERVE_CACHE_DIR": EnvVar(str, "~/.cache/stateserve", "Where compiled kernels are kept."),
    "STATESERVE_PACK_LINEARS": EnvVar(_bool, True, "Keep a copy of CPU linear weights in 48-column panels for "
                                                   "products of 3+ rows (skipped when memory is short)."),
    "STATESERVE_MALLOC_TUNING": EnvVar(_bool, True, "On CPU, keep large temporaries in glibc's heap instead of a "
                                                    "fresh mmap each (raised mmap/trim thresholds)."),
    "STATESERVE_HUGE_PAGES": EnvVar(_bool, True, "Put CPU weights and caches on transparent huge pages "
                                                 "(madvise) where Linux offers them."),
    "STATESERVE_MAX_CONSECUTIVE_STEP_FAILURES": EnvVar(int, 3, "A step that raises fails only the requests in it; "
                                                               "this many failed steps in a row stop the engine "
                                                               "(EngineDeadError). At least 1."),
    "STATESERVE_LOG_STATS_INTERVAL": EnvVar(float, 10.0, "Seconds between the engine's stats log lines "
                                                         "(throughput, queue, cache use, speculative acceptance); "
                                                         "0 = none."),
    "STATESERVE_FAULT_INJECT": EnvVar(str, "", "Test hook, 'layer=L,step=S[,count=C]': decoder layer L raises after "
                                               "its forward in model steps S..S+C-1 (engine/fault_inject.py); "
                                               "turns CUDA graphs off. Empty = off."),
}


def _read(name: str) -> Any:
    if name not in ENV_VARS:
        raise AttributeError(f"module 'stateserve.envs' has no attribute {name!r}")
    var = ENV_VARS[name]
    raw = os.environ.get(name)
    if raw is None:
        return var.default
    try:
        return var.parse(raw)
    except ValueError as e:
        raise ValueError(f"environment variable {name}={raw!r} is invalid: {e}") from None


_getter: Callable[[str], Any] = _read


def __getattr__(name: str) -> Any:
    return _getter(name)


def __dir__() -> list[str]:
    return sorted(ENV_VARS)


def is_set(name: str) -> bool:
    return name in os.environ


_frozen_raw: dict[str, str | None] = {}  # what os.environ held for each variable when the cache froze them


def enable_envs_cache() -> None:
    """Freeze every variable's current value (idempotent)."""
    global _getter
    if _getter is _read:
        _getter = functools.cache(_read)
        for name in ENV_VARS:
            _getter(name)
            _frozen_raw[name] = os.environ.get(name)


def frozen_environ() -> dict[str, str | None]:
    """Each variable's string as this process uses it (None: unset): the frozen one while the cache is on, else
    os.environ's. The processes an engine starts take these, so that every rank runs with rank 0's settings even
    after os.environ changed under a frozen cache."""
    if is_cache_enabled():
        return dict(_frozen_raw)
    return {name: os.environ.get(name) for name in ENV_VARS}


def apply_environ(values: dict[str, str | None]) -> None:
    """Set (or unset, for None) each variable in os.environ, and read them afresh from there."""
    for name, raw in values.items():
        if raw is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = raw
    disable_envs_cache()


def disable_envs_cache() -> None:
    """Read os.environ again on every access."""
    global _getter
    _getter = _read


def is_cache_enabled() -> bool:
    return _getter is not _read


