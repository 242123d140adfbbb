// Tile and launch heuristics of the SM90 kernels, kept apart from the launch code so that a
// tuning change touches one file. Numbers here are choices, not contracts.
#pragma once

#include <cstdint>

namespace decode_indexer::kernels::cuda {

// Paged MQA logits: one key tile is one cache page (64 entries), so each tile's bytes are two
// contiguous runs (values, scales) and the page table is read once per tile.
inline constexpr int kMqaTileKeys = 64;
// Pages in flight per block (cp.async stages). 4 x 8.4 KB per block with several blocks per
// SM keeps well over the ~32 KB per SM that HBM latency x bandwidth asks for.
inline constexpr int kMqaStages = 4;
inline constexpr int kMqaHeadDim = 128;
// How the keys-as-M kernels widen e4m3 keys to f16 (sm90_mqa_keys_m.cuh): all by cvt, half
// the k-steps (2, 3, 6, 7) by the integer bit move (the two pipes share the work), or all of them
// by the bit move (a measurement). The logits are the same bits either way.
enum Widen { kWidenCvt = 0, kWidenSplit = 1, kWidenBitMove = 2 };

// The dense kernels' choices (kernel, rows per pass, blocks per SM, ring depths) live in
// sm90_heuristics.h.

// Radix top-k: one cluster of blocks per row; 11 + 11 + 10 key bits in three passes.
inline constexpr int kTopKThreads = 1024;
inline constexpr int kTopKBins = 2048;
inline constexpr int kTopKMaxCluster = 8;     // portable cluster size
inline constexpr int kTopKMinSegment = 8192;  // entries per block worth a block

// Blocks per row: clusters only when rows are few (a quarter of the SMs or less: measured, 64
// rows of 32K ran 1.6x slower in clusters of 4 than one block a row), never segments below
// kTopKMinSegment entries. The answer does not depend on it (the tests check).
inline constexpr int TopKClusterSize(int32_t num_rows, int32_t max_length, int num_sms) {
  if (num_rows <= 0 || max_length <= 0) return 1;
  int c = 1;
  while (c < kTopKMaxCluster && 4 * num_rows * (2 * c) <= 2 * num_sms &&
         max_length / (2 * c) >= kTopKMinSegment) {
    c *= 2;
  }
  return c;
}

// Devices one process may drive (per-device launch setup is cached in fixed arrays).
inline constexpr int kMaxDevices = 16;

// Small elementwise kernels.
inline constexpr int kWarpKernelThreads = 256;  // one warp per key / head / position
inline constexpr int kScheduleThreads = 1024;

}  // namespace decode_indexer::kernels::cuda
