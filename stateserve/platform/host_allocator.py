"""glibc malloc settings for a process that runs an engine on CPU.

By default glibc serves every allocation above a dynamic threshold (128 KiB, rising to at most 32 MiB) with a fresh
mmap and returns it to the kernel when freed. A prefill step makes and frees dozens of such temporaries (a
[2048, 3072] float32 activation is 25 MiB); each is page-faulted and zeroed by the kernel page by page on first
touch. Keeping them in the heap instead — what tcmalloc, which vLLM's CPU guide preloads, also does — measured
+50% on a Mamba2-base 4096-token prefill and a few % on serving (A/B, alternating processes). Free heap memory is
handed back with malloc_trim at shutdown and before the activation profile, so neither memory accounting nor a
finished engine keeps it. STATESERVE_MALLOC_TUNING=0 leaves malloc alone; other C libraries are left alone too.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

from stateserve import envs

logger = logging.getLogger("stateserve")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
MMAP_THRESHOLD_BYTES = 256 << 20  # larger blocks (KV pools, weights) still get their own mapping
TRIM_THRESHOLD_BYTES = 512 << 20  # free memory kept at the heap's top before glibc trims it by itself

_lock = threading.Lock()
_tuned = False


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc only: other C libraries' mallopt differs or does nothing
        return libc
    except (OSError, AttributeError):
        return None


def tune() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once). Returns whether they are set."""
    global _tuned
    with _lock:
        if _tuned or not envs.STATESERVE_MALLOC_TUNING:
            return _tuned
        libc = _glibc()
        if libc is None:
            return False
        _tuned = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and \
            bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
        logger.debug("glibc malloc thresholds %s", "raised" if _tuned else "unchanged (mallopt refused)")
        return _tuned


def release_free_memory() -> None:
    """Hand free heap memory back to the kernel (malloc_trim(0)); a no-op off glibc."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
