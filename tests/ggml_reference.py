"""llama.cpp's own C reference for tests: ggml-quants.c from the pinned llama-cpp-python sdist (the archive
tests/test_gguf.py's converter fixture caches), compiled once into a shared library beside it and called with ctypes.

Only ggml-quants.c and the headers it includes are unpacked; the four ggml.c functions it calls outside the paths
used here are stubs that abort. -ffp-contract=off keeps C's float operations unfused on every target (aarch64 would
otherwise fuse a*b+c), which is the rounding the reference code is written for."""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile

import numpy as np

LLAMA_CPP_PYTHON = "0.3.36"  # as tests/test_gguf.py
_GGML = "vendor/llama.cpp/ggml/"
_SOURCES = ("include/", "src/ggml-quants.c", "src/ggml-quants.h", "src/ggml-common.h", "src/ggml-impl.h",
            "src/ggml-cpu/ggml-cpu-impl.h")
_STUBS = r"""
#include <stdlib.h>
#include "ggml.h"
void ggml_abort(const char * file, int line, const char * fmt, ...) { (void) file; (void) line; (void) fmt; abort(); }
size_t ggml_row_size(enum ggml_type type, int64_t ne) { (void) type; (void) ne; abort(); }
size_t ggml_type_size(enum ggml_type type) { (void) type; abort(); }
const char * ggml_type_name(enum ggml_type type) { (void) type; return "?"; }
"""
_FLAGS = ("-O1", "-DNDEBUG", "-ffp-contract=off", "-shared", "-fPIC", "-std=gnu11")
# block bytes and values of the types whose C functions are wrapped here
_SIZES = {"Q4_0": (18, 32), "Q4_1": (20, 32), "Q5_0": (22, 32), "Q8_0": (34, 32), "Q4_K": (144, 256),
          "Q5_K": (176, 256), "Q6_K": (210, 256), "IQ4_NL": (18, 32), "IQ4_XS": (136, 256)}


class Unavailable(Exception):
    """No C compiler, or the sdist can't be had: the tests that need the reference skip with this reason."""


def cache_dir() -> str:
    return os.path.join(os.path.expanduser(os.environ.get("STATESERVE_CACHE_DIR", "~/.cache/stateserve")),
                        f"llama_cpp_python-{LLAMA_CPP_PYTHON}")


def _archive() -> str:
    cache = cache_dir()
    archive = os.path.join(cache, f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz")
    if not os.path.isfile(archive):
        os.makedirs(cache, exist_ok=True)
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                            "-d", cache, f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], check=True, timeout=900,
                           capture_output=True)
        except (subprocess.SubprocessError, OSError) as e:
            raise Unavailable(f"llama-cpp-python {LLAMA_CPP_PYTHON} sdist not cached and not downloadable: {e}")
    return archive


def _sources() -> str:
    """The ggml folder with ggml-quants.c and its headers, unpacked from the sdist if not there yet."""
    root = os.path.join(cache_dir(), _GGML)
    if all(os.path.exists(os.path.join(root, p)) for p in _SOURCES):
        return root
    with tarfile.open(_archive()) as tar:
        members = [m for m in tar.getmembers() if f"/{_GGML}" in m.name
                   and m.name.split(f"/{_GGML}", 1)[1].startswith(_SOURCES)]
        for m in members:
            m.name = m.name.split("/", 1)[1]  # drop the sdist's top folder, as the converter fixture does
        tar.extractall(cache_dir(), members=members, filter="data")
    return root


def library() -> ctypes.CDLL:
    """ggml-quants.c as a shared library, built on first use (keyed by the sdist version and the build recipe)."""
    compiler = next(filter(None, map(shutil.which, (os.environ.get("CC", ""), "cc", "gcc", "clang"))), None)
    if compiler is None:
        raise Unavailable("no C compiler (cc, gcc or clang) to build llama.cpp's ggml-quants.c")
    key = hashlib.sha256((_STUBS + " ".join(_FLAGS)).encode()).hexdigest()[:12]
    path = os.path.join(cache_dir(), f"ggml_quants_ref-{key}.so")
    if not os.path.isfile(path):
        root = _sources()
        stubs = os.path.join(cache_dir(), f"ggml_stubs-{key}.c")
        with open(stubs, "w") as f:
            f.write(_STUBS)
        tmp = f"{path}.{os.getpid()}.tmp"
        cmd = [compiler, *_FLAGS, "-I", os.path.join(root, "include"), "-I", os.path.join(root, "src"),
               "-I", os.path.join(root, "src", "ggml-cpu"), os.path.join(root, "src", "ggml-quants.c"), stubs,
               "-o", tmp, "-lm"]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if run.returncode != 0:
            raise RuntimeError(f"building ggml-quants.c failed:\n{run.stderr[-3000:]}")
        os.replace(tmp, path)  # atomic: a concurrent run sees the old state or the whole library
    lib = ctypes.CDLL(path)
    for name in ("quantize_row_q4_0_ref", "quantize_row_q4_K_ref", *(_dequantizer(t) for t in _SIZES)):
        fn = getattr(lib, name)
        fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
        fn.restype = None
    return lib


def _dequantizer(type: str) -> str:
    """ggml's name for a type's dequantize function: lower case but for the K-quants' capital K."""
    low = type.lower()
    return f"dequantize_row_{low[:-1] + 'K' if type.endswith('_K') else low}"


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def quantize(lib: ctypes.CDLL, x: np.ndarray, type: str) -> np.ndarray:
    """float32 [N, K] -> ggml bytes uint8 [N, K / block * block_bytes] from quantize_row_{q4_0,q4_K}_ref."""
    fn = {"Q4_0": lib.quantize_row_q4_0_ref, "Q4_K": lib.quantize_row_q4_K_ref}[type]
    size, block = _SIZES[type]
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros((x.shape[0], x.shape[1] // block * size), dtype=np.uint8)
    fn(_ptr(x), _ptr(out), x.size)
    return out


def dequantize(lib: ctypes.CDLL, raw: np.ndarray, type: str, shape: tuple[int, int]) -> np.ndarray:
    """ggml bytes -> float32 of `shape` from dequantize_row_<type>."""
    fn = getattr(lib, _dequantizer(type))
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    out = np.zeros(shape, dtype=np.float32)
    fn(_ptr(raw), _ptr(out), out.size)
    return out
