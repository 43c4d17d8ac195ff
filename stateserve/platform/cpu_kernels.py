"""Optional C++ CPU kernels, compiled on first use with torch's extension builder and cached on disk.

If the build fails (no compiler) or STATESERVE_CPU_KERNELS=0, load() returns None and the kernel table (kernels.py)
sends every operation to PyTorch.

The module is compiled with -march=native, so it runs only on CPUs with the instruction sets of the one that built it.
The cache folder is therefore keyed on the CPU too: a home directory shared by machines of different CPUs (NFS, a
container image built on another host) holds one build per CPU instead of handing one CPU another's module, which
would die with SIGILL at its first unknown instruction.

Each finished build is also kept under the hash of everything that made it (`content_key`: the sources' and
headers' bytes, the flags, the CPU's features, the compiler, torch): a fresh clone or another checkout of the same
sources loads it instead of compiling for minutes again (torch's builder would: its build file holds the sources'
paths and decides by their modification times, which every clone renews)."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import subprocess
import threading

from stateserve import envs

logger = logging.getLogger("stateserve")
_lock = threading.Lock()
_module = None
_failed = False
_SOURCES = ("bindings.cpp", "kv_cache_write.cpp", "paged_attention.cpp", "prefill_attention.cpp", "linear.cpp",
            "packed_linear.cpp", "ssm_update.cpp", "mamba1_update.cpp", "small_ops.cpp", "conv_update.cpp",
            "gated_norm.cpp", "selective_scan.cpp", "ssd_scan.cpp", "decoder_layer.cpp", "quant_linear.cpp",
            "quant_a8.cpp", "quant_exact.cpp", "quant_activations.cpp", "quant_q4_linear.cpp", "quant_q4_a8.cpp",
            "quant_q4_exact.cpp", "quant_q6k_linear.cpp", "quant_q6k_a8.cpp", "quant_q6k_exact.cpp", "projection.cpp",
            "quant_q4k_quantize.cpp", "delta_rule_update.cpp")
# STATESERVE_CPU_ISA: the flags that take instruction sets away from -march=native, so that this machine builds (in
# a folder of its own) and tests the paths of a CPU with fewer: AVX-512 without its bfloat16 and VNNI instructions
# (Skylake-SP), AVX2 (Zen 3, Intel client cores), none (the portable loops). x86-64 only; csrc/isa.h names what a
# build has.
ISA_FLAGS = {"native": [], "avx512": ["-mno-avx512bf16", "-mno-avx512vnni"], "avx2": ["-mno-avx512f"],
             "scalar": ["-mno-avx"]}
# the features worth naming in the log: the instruction sets the kernels have paths for (x86-64, then Arm)
_ISA_FLAGS = ("avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "avx2", "fma", "f16c", "asimd", "sve")


def cpu_features() -> str:
    """The CPU's feature flags as the kernel reports them (/proc/cpuinfo: `flags` on x86, `Features` on Arm), sorted;
    where there is no /proc/cpuinfo, the processor's name. All flags, not a chosen few: what -march=native enables
    follows them, and an unneeded rebuild costs minutes where a missed difference costs a crash."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return " ".join(sorted(set(value.split())))
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler_version() -> str:
    # torch's builder compiles with $CXX, else c++; a new compiler may emit other instructions for the same flags
    return _version_of(os.environ.get("CXX", "c++"))


@functools.lru_cache(maxsize=None)
def _version_of(compiler: str) -> str:
    """The compiler's first --version line (asked once per process: the build tag and the content key both need it)."""
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"  # the build itself then fails and says why


def build_tag(csrc: str | None = None) -> tuple[str, str]:
    """(a short hash of the CPU's features, the compiler's version, torch's version and where the sources are: the
    name of this machine's build folder, with the STATESERVE_CPU_ISA variant after it unless native; the
    instruction sets among the CPU's features, for the log). The sources' folder is part of it because torch's
    builder writes their absolute paths into its build file: two checkouts sharing one folder would each find the
    other's build stale and recompile it, every time either started."""
    import torch

    features = cpu_features()
    digest = hashlib.blake2b(digest_size=6)
    csrc = csrc or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")
    for part in (platform.machine(), features, _compiler_version(), torch.__version__, csrc):
        digest.update(part.encode() + b"\0")
    present = set(features.split())
    isa = " ".join(f for f in _ISA_FLAGS if f in present) or features
    variant = envs.STATESERVE_CPU_ISA
    return digest.hexdigest() + ("" if variant == "native" else f"-{variant}"), isa


def content_key(sources: list[str], headers: list[str], flags: list[str]) -> str:
    """The hash of everything a build's module depends on, and nothing of where the sources are: their bytes (by
    file name), the compiler flags, the machine, the CPU's features, the compiler and torch."""
    import torch

    digest = hashlib.blake2b(digest_size=10)
    for part in (platform.machine(), cpu_features(), _compiler_version(), torch.__version__, *flags):
        digest.update(part.encode() + b"\0")
    for path in sorted([*sources, *headers], key=os.path.basename):
        with open(path, "rb") as f:
            digest.update(os.path.basename(path).encode() + b"\0" + f.read())
    return digest.hexdigest()


def _import_module(path: str):
    spec = importlib.util.spec_from_file_location("stateserve_cpu_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


KEPT_BUILDS = 16  # builds kept by content (~1.5 MB each); the least recently made go first


def _keep_by_content(module, kept: str) -> None:
    """Copies a module torch built to `kept` (written aside, then renamed: a reader never sees half a file), and
    drops the oldest kept builds past KEPT_BUILDS (a loaded module stays mapped where its file is removed)."""
    built = getattr(module, "__file__", None)
    if not built or not os.path.isfile(built) or os.path.exists(kept):
        return
    import shutil

    os.makedirs(os.path.dirname(kept), exist_ok=True)
    partial = f"{kept}.{os.getpid()}.partial"
    shutil.copyfile(built, partial)
    os.replace(partial, kept)
    root = os.path.dirname(os.path.dirname(kept))
    entries = sorted((os.path.join(root, n) for n in os.listdir(root)), key=os.path.getmtime, reverse=True)
    for old in entries[KEPT_BUILDS:]:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _build_folder_lock(build_dir: str):
    """One builder per folder at a time, held by the kernel (flock): a process killed mid-build releases it, where
    torch's own marker file (`lock`, which its builder polls until it disappears) outlives the process and made
    every later build of the folder wait forever. Whoever holds this lock is the only live builder, so a `lock`
    file found under it is such a leftover and is removed."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system: torch's marker alone, as before
        yield
        return
    with open(os.path.join(build_dir, "build.flock"), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = os.path.join(build_dir, "lock")
        if os.path.exists(stale):
            logger.warning("removing %s, left by a build that was killed", stale)
            os.remove(stale)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def load():
    """The compiled module, or None when unavailable."""
    global _module, _failed
    if _module is not None or _failed or not envs.STATESERVE_CPU_KERNELS:
        return _module
    with _lock:
        if _module is None and not _failed:
            try:
                _module = _load_or_build()
            except Exception as e:  # any build problem: run the PyTorch path instead
                _failed = True
                logger.warning("CPU kernels unavailable (%s); using the PyTorch fallback", e)
    return _module


def kept_build(cache_dir: str, inputs: tuple[list[str], list[str], list[str]] | None = None) -> str:
    """Where a build of this checkout's sources (`inputs`: _build_inputs(), read here when not given), for this
    machine and STATESERVE_CPU_ISA, is kept under a cache folder (whether it exists or not)."""
    variant = envs.STATESERVE_CPU_ISA
    sources, headers, flags = inputs or _build_inputs()
    return os.path.join(os.path.expanduser(cache_dir), "cpu_kernels", "by-content",
                        content_key(sources, headers, flags) + ("" if variant == "native" else f"-{variant}"),
                        "stateserve_cpu_kernels.so")


def _build_inputs() -> tuple[list[str], list[str], list[str]]:
    """(sources, headers, compiler flags but the folder's tag)."""
    csrc = os.path.join(os.path.dirname(os.path.dirname(__file__)), "csrc")
    sources = [os.path.join(csrc, name) for name in _SOURCES]
    headers = sorted(os.path.join(csrc, n) for n in os.listdir(csrc) if n.endswith(".h"))
    # torch rebuilds when a source or a flag changes, not a header: the headers' hash is a flag
    digest = hashlib.blake2b(digest_size=8)
    for path in headers:
        with open(path, "rb") as f:
            digest.update(f.read())
    flags = ["-O3", "-march=native", *ISA_FLAGS[envs.STATESERVE_CPU_ISA], "-fopenmp",
             f"-DSTATESERVE_SIMD_H={digest.hexdigest()}"]
    return sources, headers, flags


def _load_or_build():
    from torch.utils.cpp_extension import load as build

    tag, isa = build_tag()
    variant = envs.STATESERVE_CPU_ISA
    if variant != "native" and platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"STATESERVE_CPU_ISA={variant} is for x86-64 CPUs")
    inputs = _build_inputs()
    sources, header_paths, flags = inputs
    build_dir = os.path.join(os.path.expanduser(envs.STATESERVE_CACHE_DIR), "cpu_kernels", tag)
    suffix = "" if variant == "native" else f", built for {variant} only"
    kept = kept_build(envs.STATESERVE_CACHE_DIR, inputs)
    if os.path.isfile(kept):
        logger.info("CPU kernels for %s (%s)%s: the build of these sources in %s", isa, platform.machine(), suffix,
                    os.path.dirname(kept))
        return _import_module(kept)
    os.makedirs(build_dir, exist_ok=True)
    logger.info("CPU kernels for %s (%s)%s in %s", isa, platform.machine(), suffix, build_dir)
    built = os.path.join(build_dir, "stateserve_cpu_kernels.so")
    newest = max(os.path.getmtime(p) for p in [*sources, *header_paths])
    if not os.path.exists(built) or os.path.getmtime(built) < newest:
        # the first run of a fresh checkout sits here for minutes; say why
        logger.warning("compiling stateserve's CPU kernels into %s (about 2 minutes on 2 cores, "
                       "once per change of the sources and per kind of CPU)", build_dir)
    with _build_folder_lock(build_dir):
        # the tag is a flag as well: torch's own check then rebuilds a folder that another CPU's build reached by
        # any other way
        module = build(name="stateserve_cpu_kernels", sources=sources, build_directory=build_dir,
                       extra_cflags=[*flags, f"-DSTATESERVE_CPU_TAG={tag.replace('-', '_')}"],
                       extra_ldflags=["-fopenmp"], verbose=False)
    _keep_by_content(module, kept)
    return module
