// What the decode attention kernels share (paged_attention.cpp, and its AVX2 task in
// paged_attention_avx2.cpp): where a task reads, the walk over a sequence's keys block by block, and the prefetch
// of the next block's piece.
#pragma once
#include <torch/extension.h>
#include <xmmintrin.h>
#include <algorithm>
#include <vector>

namespace stateserve_attention {

// Where a task reads: kv heads [kh0, kh1) of one sequence of `len` keys, whose blocks `table` lists, in a cache laid
// out [num_blocks, num_kv_heads, block_size, head_dim]: one head's keys of a block are one contiguous piece.
struct TaskView {
  const int64_t* table;
  int64_t len, kh0, kh1, group, head_dim, block_size, head_stride, block_stride, piece_bytes;
  int64_t num_query_heads() const { return (kh1 - kh0) * group; }
  int64_t score_stride() const { return len + 16; }  // per head: room for a full 16-lane store at any key
};

// Visits the keys of one cache in groups of at most 16 within a block: fn(t0, n, rows, next) with rows pointing at
// key t0 of kv head 0 (kv head h: + h * head_stride), and next at the following block on a block's first group
// (else null), for fn to prefetch that block's piece of each head as it takes the head: spread out like that, the
// prefetches measured 7-25% faster than issuing the whole block's at once.
template <typename scalar_t, typename Fn>
inline void walk_keys(const scalar_t* cache, const TaskView& tv, Fn&& fn) {
  const int64_t num_blocks = (tv.len + tv.block_size - 1) / tv.block_size;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const scalar_t* base = cache + tv.table[b] * tv.block_stride;
    const char* next =
        b + 1 < num_blocks ? reinterpret_cast<const char*>(cache + tv.table[b + 1] * tv.block_stride) : nullptr;
    const int64_t keys = std::min(tv.block_size, tv.len - b * tv.block_size);
    for (int64_t o = 0; o < keys; o += 16)
      fn(b * tv.block_size + o, std::min<int64_t>(16, keys - o), base + o * tv.head_dim, o == 0 ? next : nullptr);
  }
}

// kv head kv's piece of the next block, into L2 (into L1 it evicts what is being computed; without it a pass
// waits on every piece).
inline void prefetch_piece(const char* next, int64_t kv, const TaskView& tv) {
  if (next == nullptr) return;
  for (int64_t x = 0; x < tv.piece_bytes; x += 64) _mm_prefetch(next + kv * tv.piece_bytes + x, _MM_HINT_T1);
}

// One task with AVX2 + FMA, T float or at::BFloat16 (head_dim a multiple of 8, at most 256; at most 256 query
// heads). Runs only in builds with AVX2 and without AVX-512 (decode_task_x8_supported()).
template <typename T>
void decode_task_x8(const T* q, const T* k_cache, const T* v_cache, const TaskView& tv, T* out, float scale,
                    std::vector<float>& scores, std::vector<float>& qf, std::vector<float>& acc);
bool decode_task_x8_supported();

}  // namespace stateserve_attention
