// The AVX2 task of causal prefill attention (prefill_attention_avx2.cpp), which prefill_attention.cpp's entry point
// runs in builds with AVX2 and without AVX-512.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

namespace stateserve_attention {

// Whether prefill_x8 is built and takes this head size (64 or 128).
bool prefill_x8_supported(int64_t head_dim);
// Causal attention of num_rows query rows (q: [num_rows, num_heads, head_dim], rows q_row_stride apart) at positions
// ctx.. over the paged caches [num_blocks, num_kv_heads, block_size, head_dim], whose blocks `table` lists; out:
// [num_rows, num_heads, head_dim] contiguous. T: float or at::BFloat16.
template <typename T>
void prefill_x8(const T* q, int64_t q_row_stride, const T* k_cache, const T* v_cache, const int64_t* table,
                int64_t ctx, int64_t num_rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                int64_t block_size, float scale, T* out);

}  // namespace stateserve_attention
