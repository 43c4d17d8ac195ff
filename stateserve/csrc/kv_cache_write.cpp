// The new keys and values of a step into the paged KV cache, for every attention layer (decode, prefill, fused
// decode alike): row copies, any dtype.
#include <ATen/core/Tensor.h>  // (not torch/extension.h: its headers cost each source ~10x the compile time)
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <cstring>
#include "kernels.h"

// Writes new keys and values into their cache rows. k, v: [T, KH, D] in the cache's dtype; slots: [T] int64
// (block * block_size + offset); caches [num_blocks, KH, block_size, D], so each head's row is its own copy.
void write_kv_cache(at::Tensor k_cache, at::Tensor v_cache, at::Tensor k, at::Tensor v,
                    at::Tensor slots) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k.is_contiguous() && v.is_contiguous(),
              "write_kv_cache: tensors must be contiguous");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(),
              "write_kv_cache: k/v dtype differs from the cache's");
  TORCH_CHECK(k_cache.dim() == 4 && k.dim() == 3 && k.sizes() == v.sizes() && k_cache.sizes() == v_cache.sizes() &&
              k.size(1) == k_cache.size(1) && k.size(2) == k_cache.size(3), "write_kv_cache: shapes do not match");
  auto slot_t = slots.to(at::kLong).contiguous();
  TORCH_CHECK(slot_t.numel() == k.size(0), "write_kv_cache: one slot per token");
  const int64_t T = k.size(0), KH = k_cache.size(1), bs = k_cache.size(2), D = k_cache.size(3);
  const int64_t num_slots = k_cache.size(0) * bs, elem = k.element_size(), row_bytes = D * elem;
  const int64_t* slot = slot_t.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "write_kv_cache: slot ", slot[t], " outside the cache");
  const char *ks = static_cast<const char*>(k.data_ptr()), *vs = static_cast<const char*>(v.data_ptr());
  char *kc = static_cast<char*>(k_cache.data_ptr()), *vc = static_cast<char*>(v_cache.data_ptr());
  auto body = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = slot[t] / bs, offset = slot[t] % bs;
      for (int64_t h = 0; h < KH; ++h) {
        const int64_t dst = ((block * KH + h) * bs + offset) * row_bytes, src = (t * KH + h) * row_bytes;
        std::memcpy(kc + dst, ks + src, row_bytes);
        std::memcpy(vc + dst, vs + src, row_bytes);
      }
    }
  };
  if (T * KH * row_bytes < (1 << 18)) body(0, T);  // a decode step's few rows: less than forking the team
  else at::parallel_for(0, T, 16, body);
}
