"""The C++ CPU kernels must build wherever a compiler is present: the kernel tests skip themselves when the module
is unavailable, so without this check a source that no longer compiles would pass the suite on the fallbacks."""
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
    (tmp_path / "cpu_kernels" / "stateserve_cpu_kernels.so").write_bytes(b"")  # newer than every source
    assert fresh_load() == []
