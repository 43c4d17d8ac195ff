// The panel kernel's layout (packed_linear.cpp): panels of kPanel output columns, and the order in which every
// output's sum is taken, shared with the few-row kernel (linear.cpp).
#pragma once
#include <algorithm>
#include <cstdint>
#include "isa.h"

namespace stateserve_panels {
constexpr int64_t kPanel = 48;  // output columns per panel

// Two orders of every output's sum. The fast one: one chain over all k-steps in order. The lane order, shared with
// the few-row kernel (linear.cpp), so that a row's result is the same bits whichever kernel computed it (one request
// decoding alone, the same request batched, the rows of a verify step): there, each output is kChains partial
// chains (chain j: the k-steps s = j, j + kChains, j + 2 kChains, ... in order, a vector lane each) added up by a fixed tree at the end. Here each chain runs on its own (its words
// packed contiguously, one after the other in kChainOrder) with outputs in the lanes, and the tree is the same:
// the few-row reductions (linear.cpp's reduce_add16 and reduce8_ps on AVX-512, reduce8_ps on AVX2) are
// perfect binary trees over the lanes taken in kChainOrder (bit-reversed on AVX-512, natural on AVX2).
#if SS_HAS_AVX512
constexpr int kChains = 16;
constexpr int kChainOrder[kChains] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
#else
constexpr int kChains = 8;
constexpr int kChainOrder[kChains] = {0, 1, 2, 3, 4, 5, 6, 7};
#endif
constexpr int kTreeDepth = 4;  // partial sums the tree holds at once (log2(kChains))

// The chains of an order: kLanes, the few-row kernel's kChains; else one.
template <bool kLanes>
struct SumOrder {
  static constexpr int kCount = kLanes ? kChains : 1;
  static constexpr int chain(int i) { return kLanes ? kChainOrder[i] : 0; }  // the i-th chain in a panel
};

// Where the chains' words lie in a panel of `steps` k-steps: of `count` chains, chain j has steps / count of them,
// one more when j < steps % count; chains follow one another in kChainOrder. The few-row kernel runs every chain
// for ceil(steps / kChains) steps (its last vector zero-padded), so shorter chains end with a multiply-add of zeros.
struct ChainLayout {
  int64_t full, rest;
  ChainLayout(int64_t steps, int count) : full(steps / count), rest(steps % count) {}
  int64_t length(int j) const { return full + (j < rest ? 1 : 0); }
  bool padded(int j) const { return rest != 0 && j >= rest; }
};
}  // namespace stateserve_panels
