"""Optional C++ CPU kernels, compiled on first use with torch's extension builder and cached on disk.

If the build fails (no compiler) or STATESERVE_CPU_KERNELS=0, callers fall back to pure PyTorch."""
from __future__ import annotations

import hashlib
import logging
import os
import threading

from stateserve import envs

logger = logging.getLogger("stateserve")
_lock = threading.Lock()
_module = None
_failed = False
_SOURCES = ("bindings.cpp", "paged_attention.cpp", "paged_attention_avx2.cpp", "prefill_attention.cpp",
            "prefill_attention_avx2.cpp", "linear.cpp", "packed_linear.cpp", "ssm_update.cpp", "mamba1_update.cpp",
            "small_ops.cpp", "conv_update.cpp", "gated_norm.cpp", "selective_scan.cpp", "ssd_scan.cpp",
            "decoder_layer.cpp")


def load():
    """The compiled module, or None when unavailable."""
    global _module, _failed
    if _module is not None or _failed or not envs.STATESERVE_CPU_KERNELS:
        return _module
    with _lock:
        if _module is None and not _failed:
            try:
                from torch.utils.cpp_extension import load as build

                csrc = os.path.join(os.path.dirname(os.path.dirname(__file__)), "csrc")
                sources = [os.path.join(csrc, name) for name in _SOURCES]
                build_dir = os.path.join(os.path.expanduser(envs.STATESERVE_CACHE_DIR), "cpu_kernels")
                os.makedirs(build_dir, exist_ok=True)
                # torch rebuilds when a source or a flag changes, not a header: the headers' hash is a flag
                header_paths = sorted(os.path.join(csrc, n) for n in os.listdir(csrc) if n.endswith(".h"))
                digest = hashlib.blake2b(digest_size=8)
                for path in header_paths:
                    with open(path, "rb") as f:
                        digest.update(f.read())
                header = digest.hexdigest()
                built = os.path.join(build_dir, "stateserve_cpu_kernels.so")
                newest = max(os.path.getmtime(p) for p in [*sources, *header_paths])
                if not os.path.exists(built) or os.path.getmtime(built) < newest:
                    # the first run of a fresh checkout sits here for minutes; say why
                    logger.warning("compiling stateserve's CPU kernels into %s (about 2 minutes on 2 cores, "
                                   "once per change of the sources)", build_dir)
                _module = build(name="stateserve_cpu_kernels", sources=sources, build_directory=build_dir,
                                extra_cflags=["-O3", "-march=native", "-fopenmp", f"-DSTATESERVE_SIMD_H={header}"],
                                extra_ldflags=["-fopenmp"],
                                verbose=False)
            except Exception as e:  # any build problem: run the PyTorch path instead
                _failed = True
                logger.warning("CPU kernels unavailable (%s); using the PyTorch fallback", e)
    return _module
