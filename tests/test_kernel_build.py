"""The C++ CPU kernels must build wherever a compiler is present: the kernel tests skip themselves when the module
is unavailable, so without this check a source that no longer compiles would pass the suite on the fallbacks."""
import os
import platform
import shutil

import pytest

from stateserve import envs
from stateserve.layers import cpu_kernels


@pytest.mark.skipif(shutil.which("c++") is None or platform.machine() not in ("x86_64", "AMD64"),
                    reason="no C++ compiler, or not an x86-64 machine")
def test_cpu_kernels_build_where_a_compiler_exists():
    if not envs.STATESERVE_CPU_KERNELS:
        pytest.skip("STATESERVE_CPU_KERNELS=0")
    assert cpu_kernels.load() is not None, "the C++ CPU kernels failed to build (see the warning in the log)"


def test_a_build_says_it_is_compiling_and_a_built_module_does_not(tmp_path, monkeypatch, caplog):
    """A fresh checkout's first run sits minutes in the compiler: it must say so, and only then."""
    import torch.utils.cpp_extension as cpp_extension

    built = object()
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: built)
    monkeypatch.setenv("STATESERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("STATESERVE_CPU_KERNELS", "1")
    envs.disable_envs_cache()

    def fresh_load():
        monkeypatch.setattr(cpu_kernels, "_module", None)
        monkeypatch.setattr(cpu_kernels, "_failed", False)
        caplog.clear()
        with caplog.at_level("WARNING", logger="stateserve"):
            assert cpu_kernels.load() is built
        return [r.getMessage() for r in caplog.records if "compiling" in r.getMessage()]

    messages = fresh_load()  # nothing built in this cache folder yet
    assert messages and str(tmp_path) in messages[0]
    # this machine's build folder, keyed on its CPU; the module there is newer than every source
    (tmp_path / "cpu_kernels" / cpu_kernels.build_tag()[0] / "stateserve_cpu_kernels.so").write_bytes(b"")
    assert fresh_load() == []


# Two CPUs of one cluster: the same x86-64 base, and only the second with AVX-512 (what -march=native compiles for)
CPU_AVX2 = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi2"
CPU_AVX512 = CPU_AVX2 + " avx512f avx512bw avx512vl avx512_bf16"


def test_a_module_built_for_one_cpu_is_not_loaded_on_another(tmp_path, monkeypatch, caplog):
    """A cache folder shared by machines of different CPUs (NFS home, an image built elsewhere) must not hand one
    CPU the module compiled with -march=native for another: that dies with SIGILL at the first AVX-512 instruction."""
    import torch.utils.cpp_extension as cpp_extension

    def fake_build(name, sources, build_directory, extra_cflags, **kwargs):
        """torch's builder in small: load what the folder holds, else compile for the CPU it runs on."""
        so = os.path.join(build_directory, name + ".so")
        if not os.path.exists(so):
            with open(so, "w") as f:
                f.write(f"built for <{cpu[0]}> with {' '.join(extra_cflags)}")
        with open(so) as f:
            return f.read()

    cpu = [CPU_AVX512]
    # the function cpu_kernels reads the CPU's features through (raising=False: the test states what must happen,
    # whatever the module calls it)
    monkeypatch.setattr(cpu_kernels, "cpu_features", lambda: cpu[0], raising=False)
    monkeypatch.setattr(cpp_extension, "load", fake_build)
    monkeypatch.setenv("STATESERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("STATESERVE_CPU_KERNELS", "1")
    envs.disable_envs_cache()

    def load_on(features: str) -> tuple[str, list[str], str]:
        cpu[0] = features
        monkeypatch.setattr(cpu_kernels, "_module", None)
        monkeypatch.setattr(cpu_kernels, "_failed", False)
        caplog.clear()
        with caplog.at_level("INFO", logger="stateserve"):
            module = cpu_kernels.load()
        built = sorted(str(p.parent) for p in tmp_path.rglob("stateserve_cpu_kernels.so"))
        return module, built, caplog.text

    module_a, built, log = load_on(CPU_AVX512)
    assert module_a.startswith(f"built for <{CPU_AVX512}>") and "compiling" in log
    assert len(built) == 1 and built[0] in log  # the log names the folder it uses
    folder_a = built[0]
    assert load_on(CPU_AVX512)[0] == module_a  # the same CPU: the same folder, nothing rebuilt
    module_b, built, log = load_on(CPU_AVX2)
    assert module_b.startswith(f"built for <{CPU_AVX2}>"), "the AVX-512 module was loaded on an AVX2-only CPU"
    assert "compiling" in log and len(built) == 2
    folder_b = next(b for b in built if b != folder_a)
    assert folder_b in log
    # the CPU is part of the compile flags too, so torch's own check would rebuild a folder shared anyway
    flags_a = module_a.split(" with ", 1)[1].split()
    flags_b = module_b.split(" with ", 1)[1].split()
    assert set(flags_a) != set(flags_b)
    assert load_on(CPU_AVX512)[0] == module_a  # and back: the first folder is still there and still used


def test_two_checkouts_build_into_two_folders():
    """torch's builder writes the sources' absolute paths into its build file: a checkout sharing another's folder
    would find that build stale and recompile it on every start, each undoing the other's."""
    assert cpu_kernels.build_tag("/a/stateserve/csrc") == cpu_kernels.build_tag("/a/stateserve/csrc")
    assert cpu_kernels.build_tag("/a/stateserve/csrc")[0] != cpu_kernels.build_tag("/b/stateserve/csrc")[0]
