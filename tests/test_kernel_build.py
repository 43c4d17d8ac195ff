"""The C++ CPU kernels must build wherever a compiler is present: the kernel tests skip themselves when the module
is unavailable, so without this check a source that no longer compiles would pass the suite on the fallbacks."""
import os
import platform
import shutil
import subprocess
import sys

import pytest

from stateserve import envs
from stateserve.platform import cpu_kernels


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


def test_a_build_killed_midway_does_not_block_the_next(tmp_path, monkeypatch, caplog):
    """torch's builder marks a folder being built with a `lock` file and polls until it disappears; a build that was
    killed leaves it behind. The next load must build anyway (here: a process that took the folder's lock, wrote the
    marker as torch does and died), not wait forever."""
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setenv("STATESERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("STATESERVE_CPU_KERNELS", "1")
    envs.disable_envs_cache()
    folder = tmp_path / "cpu_kernels" / cpu_kernels.build_tag()[0]
    folder.mkdir(parents=True)
    killed = subprocess.run([sys.executable, "-c", (
        "import os; from stateserve.platform import cpu_kernels\n"
        f"with cpu_kernels._build_folder_lock({str(folder)!r}):\n"
        f"    open(os.path.join({str(folder)!r}, 'lock'), 'w').close()\n"
        "    os._exit(9)  # killed in the middle of the build\n")], timeout=60)
    assert killed.returncode == 9 and (folder / "lock").exists()

    built = object()

    def fake_build(build_directory, **kwargs):  # torch's builder in small: it would poll the marker forever
        assert not os.path.exists(os.path.join(build_directory, "lock")), "the stale marker would block this build"
        return built

    monkeypatch.setattr(cpp_extension, "load", fake_build)
    monkeypatch.setattr(cpu_kernels, "_module", None)
    monkeypatch.setattr(cpu_kernels, "_failed", False)
    with caplog.at_level("WARNING", logger="stateserve"):
        assert cpu_kernels.load() is built
    assert any("left by a build that was killed" in r.getMessage() for r in caplog.records)


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


def test_the_content_key_follows_the_sources_not_where_they_are(tmp_path):
    """A kept build is found by the bytes of the sources and the flags: two copies of the sources in two places
    give one key (a fresh clone reuses the build), a changed byte of a header or another flag another."""
    csrc = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "stateserve", "csrc")
    copies = []
    for place in ("a", "b"):
        shutil.copytree(csrc, tmp_path / place / "csrc")
        folder = tmp_path / place / "csrc"
        copies.append(([str(folder / "linear.cpp"), str(folder / "bindings.cpp")],
                       sorted(str(p) for p in folder.glob("*.h"))))
    flags = ["-O3", "-march=native"]
    key = cpu_kernels.content_key(*copies[0], flags)
    assert cpu_kernels.content_key(*copies[1], flags) == key
    assert cpu_kernels.content_key(*copies[1], [*flags, "-mno-avx512f"]) != key
    header = tmp_path / "b" / "csrc" / "simd.h"
    header.write_bytes(header.read_bytes() + b" ")
    assert cpu_kernels.content_key(*copies[1], flags) != key


def test_a_fresh_clone_loads_the_kept_build_without_compiling(tmp_path):
    """A build of the same sources kept under the cache folder is loaded as it is: no minutes in the compiler for
    a fresh clone whose files only have newer modification times. (Here: this process's module placed where a
    new cache folder keeps it; a second process loads it, says from where, and its kernels run.)"""
    module = cpu_kernels.load()
    if module is None:
        pytest.skip("C++ CPU kernels unavailable")
    env = {**os.environ, "STATESERVE_CACHE_DIR": str(tmp_path)}
    env.pop("STATESERVE_CPU_ISA", None)
    if envs.STATESERVE_CPU_ISA != "native":
        pytest.skip("runs from the native build's suite")
    kept = cpu_kernels.kept_build(str(tmp_path))
    os.makedirs(os.path.dirname(kept))
    shutil.copyfile(module.__file__, kept)
    run = subprocess.run([sys.executable, "-c", (
        "import torch\nfrom stateserve.platform import cpu_kernels\n"
        "m = cpu_kernels.load()\nprint(m.__file__)\n"
        "print(m.fast_linear(torch.ones(1, 4), torch.ones(2, 4), None).tolist())\n")],
        env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    log = run.stdout + run.stderr
    assert run.stdout.splitlines()[-2:] == [kept, "[[4.0, 4.0]]"], log
    assert "compiling" not in log and f"the build of these sources in {os.path.dirname(kept)}" in log


def test_two_checkouts_build_into_two_folders():
    """torch's builder writes the sources' absolute paths into its build file: a checkout sharing another's folder
    would find that build stale and recompile it on every start, each undoing the other's."""
    assert cpu_kernels.build_tag("/a/stateserve/csrc") == cpu_kernels.build_tag("/a/stateserve/csrc")
    assert cpu_kernels.build_tag("/a/stateserve/csrc")[0] != cpu_kernels.build_tag("/b/stateserve/csrc")[0]


def test_without_the_module_the_table_sends_everything_to_pytorch():
    """STATESERVE_CPU_KERNELS=0 or a failed build: no operation has a C++ kernel, and off the CPU nothing has one."""
    import torch

    from stateserve.platform import kernels

    for table in (kernels.build(None), kernels.table(torch.device("meta"))):
        assert table.module is None and table.lanes == 0
        ops = [op for op in vars(table).values() if isinstance(op, kernels.Op)]
        assert len(ops) > 15 and not any(op.kernels or op.default for op in ops)
        for dtype in (torch.float32, torch.bfloat16):
            routes = table.linear(dtype)
            assert routes is None or (routes.few_row is None and routes.panel is None)
            assert table.prefill_attention(dtype, dtype, 64) is None
    assert kernels.table(torch.device("meta")).linear(torch.float32) is None
    env = {**os.environ, "STATESERVE_CPU_KERNELS": "0"}
    out = subprocess.run([sys.executable, "-c", "from stateserve.platform import kernels; "
                          "print(kernels.table().describe())"], env=env, capture_output=True, text=True, check=True)
    assert "C++ kernels: none" in out.stdout


def test_the_table_serves_the_modules_kernels_by_dtype():
    import torch

    from stateserve.platform import kernels

    module = cpu_kernels.load()
    if module is None:
        pytest.skip("C++ CPU kernels unavailable")
    table = kernels.table()
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    assert table.module is module and table.isa == module.compiled_isa() and table.lanes in (16, 8, 0)
    assert table.rms_norm(f32, f32) is module.rms_norm and table.rms_norm(f32, bf16) is None
    assert table.add_rms_norm(f32, bf16, bf16) is module.add_rms_norm_ and table.add_rms_norm(bf16, f32, f32) is None
    assert table.decode_attention(f16, f16) is not None and table.decode_attention(f32, bf16) is None
    assert table.write_kv(torch.int8) is module.write_kv_cache  # row copies: any dtype
    assert table.mamba1_decode(bf16, bf16, f32) is module.mamba1_decode_
    assert table.mamba1_decode(bf16, bf16, bf16) is None  # Mamba1's ssm state is float32
    routes = table.linear(f32)
    assert (routes.few_row is not None) == bool(module.fast_linear_supported(f32))
    assert routes.max_rows_prepacked == (kernels.MAX_ROWS_PREPACKED_8_LANES if table.lanes == 8
                                         else kernels.MAX_ROWS_PREPACKED)[f32]
    assert table.linear(f16) is None
    assert "\nrms_norm: float32/float32, bfloat16/bfloat16" in table.describe()


def test_csrc_names_instruction_sets_and_kernels_once():
    """csrc/isa.h is the one place that reads the compiler's ISA macros, and csrc/kernels.h the one that declares
    kernels: no other file spells them its own way or copies a prototype."""
    import re

    csrc = os.path.join(os.path.dirname(cpu_kernels.__file__), "..", "csrc")
    sources = {n: open(os.path.join(csrc, n)).read() for n in os.listdir(csrc) if n.endswith((".h", ".cpp"))}
    for name, text in sources.items():
        if name != "isa.h":
            assert not re.search(r"__(AVX|FMA|F16C|SSE)\w*__", text), f"{name} tests an ISA macro of its own"
            assert not re.search(r"#\s*if(def|ndef)?\s+(!\s*)?defined\(\s*SS_HAS", text), name  # always 0 or 1
    declared = re.findall(r"^\S[^(]*?\b(\w+)\(", sources["kernels.h"], re.M)
    for name, text in sources.items():
        if name != "kernels.h":
            # a declaration at file scope: a type from the first column, the name, parameters, no body
            copies = [k for k in declared if re.search(rf"^[A-Za-z_][\w:<>, *&]*\b{k}\([^;{{]*\);", text, re.M)]
            assert not copies, f"{name} declares {copies} again"


def _isa_variants() -> list[str]:
    """The STATESERVE_CPU_ISA builds that differ from this CPU's native one (x86-64 only)."""
    if platform.machine() not in ("x86_64", "AMD64") or shutil.which("c++") is None:
        return []
    flags = set(cpu_kernels.cpu_features().split())
    native = "avx512_bf16" if {"avx512f", "avx512_bf16"} <= flags else "avx512" if "avx512f" in flags else \
        "avx2" if {"avx2", "fma"} <= flags else "scalar"
    order = ["avx512_bf16", "avx512", "avx2", "scalar"]
    return [v for v in order[order.index(native) + 1:] if v != "avx512" or {"avx512bw", "avx512vl"} <= flags]


# (test_ggml_types.py: quant_q4k_quantize.cpp's Q4_K quantization against llama.cpp's C; of test_quantization_q4.py
# only its decode-path check (~2-5 s): every build must run a quantized layer's decode step fused, no silent fallback)
KERNEL_TESTS = ["test_cpu_kernels.py", "test_delta_rule_kernels.py", "test_cpu_small_ops.py", "test_attention.py",
                "test_linear_kernel.py", "test_packed_linear.py", "test_fused_decode.py", "test_quant_kernels.py",
                "test_quant_q4_kernels.py", "test_quant_q6k_kernels.py", "test_ggml_types.py",
                "test_quantization_q4.py::test_decode_runs_fused_with_the_quantized_products"]


@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
def test_kernel_tests_pass_with_fewer_instruction_sets(isa):
    """Every path of the kernels is built and tested here, not only this CPU's: the kernel tests run again on a
    module built without AVX-512's bfloat16 instructions (AVX-512 CPUs before Zen 4 / Cooper Lake), without
    AVX-512 (Zen 3's AVX2 paths) and without AVX (the portable loops). The first run of each builds its module
    (minutes; cached after)."""
    if envs.STATESERVE_CPU_ISA != "native" or not envs.STATESERVE_CPU_KERNELS:
        pytest.skip("runs from the native build's suite")
    if isa not in _isa_variants():
        pytest.skip(f"{isa} is this CPU's own build, or more than it has")
    tests = os.path.dirname(__file__)
    env = {**os.environ, "STATESERVE_CPU_ISA": isa}
    # the build's own check first: a variant that fails to compile would otherwise skip every kernel test and pass
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                          f"{tests}/test_kernel_build.py::test_cpu_kernels_build_where_a_compiler_exists",
                          f"{tests}/test_kernel_build.py::test_the_module_has_the_instruction_sets_asked_for",
                          *(os.path.join(tests, t) for t in KERNEL_TESTS)],
                         env=env, capture_output=True, text=True, cwd=os.path.dirname(tests))
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]


def test_the_module_has_the_instruction_sets_asked_for():
    if not envs.STATESERVE_CPU_KERNELS or cpu_kernels.load() is None:
        pytest.skip("C++ CPU kernels unavailable")
    isa = envs.STATESERVE_CPU_ISA
    expected = {"avx512": "avx512", "avx2": "avx2", "scalar": "scalar"}.get(isa)
    assert expected is None or cpu_kernels.load().compiled_isa() == expected
    assert cpu_kernels.load().simd_float32_lanes() == {"avx512_bf16": 16, "avx512": 16, "avx2": 8, "scalar": 0}[
        cpu_kernels.load().compiled_isa()]
