// The instruction sets the kernels use, named once from the compiler's predefined macros: what -march=native
// enables on the building CPU, or less with a STATESERVE_CPU_ISA build (cpu_kernels.py), which is how one machine
// compiles and tests every path. Each macro is always defined, 0 or 1, and only these are tested in csrc/.
#pragma once

#if defined(__AVX512F__)
#define SS_HAS_AVX512 1
#else
#define SS_HAS_AVX512 0
#endif

// AVX-512 with masked loads and stores of 16-bit words (BW) on 256-bit vectors (VL): every AVX-512 server CPU
// since Skylake-SP and every AMD one.
#if SS_HAS_AVX512 && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SS_HAS_AVX512_BW 1
#else
#define SS_HAS_AVX512_BW 0
#endif

// vdpbf16ps: bfloat16 pairs multiplied and added into float32 lanes (Zen 4+, Intel Cooper Lake and Sapphire
// Rapids on).
#if SS_HAS_AVX512 && defined(__AVX512BF16__)
#define SS_HAS_AVX512_BF16 1
#else
#define SS_HAS_AVX512_BF16 0
#endif

// vpdpbusd: unsigned x signed bytes, four products added into each int32 lane (Ice Lake / Cascade Lake on, Zen 4+):
// the int8 products of quant_a8.cpp. A build without it (STATESERVE_CPU_ISA=avx512, standing for Skylake-SP) takes
// the AVX-512BW vpmaddubsw path instead.
#if SS_HAS_AVX512_BW && defined(__AVX512VNNI__)
#define SS_HAS_AVX512_VNNI 1
#else
#define SS_HAS_AVX512_VNNI 0
#endif

// 8-lane float32 vectors where they are the widest: AVX2 + FMA without AVX-512 (Zen 2/3, Intel client cores). An
// AVX-512 build takes the 16-lane paths instead, so this is 0 there.
#if !SS_HAS_AVX512 && defined(__AVX2__) && defined(__FMA__)
#define SS_HAS_AVX2 1
#else
#define SS_HAS_AVX2 0
#endif

// vcvtph2ps on 8 lanes: float16 values (the Q4 formats' scales) widened in registers. Every AVX2 + FMA CPU has it;
// AVX-512F has its own 16-lane form, so this only matters for the AVX2 paths.
#if defined(__F16C__)
#define SS_HAS_F16C 1
#else
#define SS_HAS_F16C 0
#endif

// Some float32 vector type (stateserve_simd::F32Vec: 16 or 8 lanes); without it the portable loops run.
#define SS_HAS_SIMD (SS_HAS_AVX512 || SS_HAS_AVX2)

// The build's paths in one word, as compiled_isa() reports it (the names of STATESERVE_CPU_ISA).
#if SS_HAS_AVX512_BF16
#define SS_ISA_NAME "avx512_bf16"
#elif SS_HAS_AVX512
#define SS_ISA_NAME "avx512"
#elif SS_HAS_AVX2
#define SS_ISA_NAME "avx2"
#else
#define SS_ISA_NAME "scalar"
#endif
