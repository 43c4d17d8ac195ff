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
