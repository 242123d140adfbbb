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
// The keys-as-M FP8 kernel keeps q (16 KB a row) in shared memory too. Measured at 64 x 32K
// (H200): 4 stages / 3 blocks per SM 135 us, 3 / 4 blocks 143 us, 6 / 3 blocks 174 us - the
// kernel is latency bound (docs/notes/cuda.md); 3 is what the recorded runs used.
inline constexpr int kKeysMStages = 3;
// The pipelined keys-as-M kernel (sm90_paged_mqa_logits_pipelined.cu): page slots in its
// producer warp's ring, and the blocks per SM its register cap is sized for. One row per
// pass: 3 (128 registers; 4 fit in shared memory but cap registers at 96 and spill: measured
// slower at 1-64 x 8K-64K on the H200, 09:59); several rows keep two rows' accumulators
// live, so 2 blocks with up to 200 registers (faster than 3 blocks one row at a time).
inline constexpr int kPipeStages = 4;
inline constexpr int kPipeMinBlocksOneRow = 3;
inline constexpr int kPipeMinBlocksMultiRow = 2;
// The warp-specialized variants (kWgmmaKeysMPipelinedWs2 / Ws4, one row per pass): a producer
// warpgroup that drops to kPipeWsProducerRegs registers (setmaxnreg) and 2 (2 blocks per SM)
// or 4 (1 block) consumer warpgroups that take the rest, alternating tiles over one ring of
// kPipeWsStagesPerConsumer slots per consumer. Producer registers: at 32 / 48 its unrolled
// cp.async loop spilled (ptxas -v: 330 / 200 bytes); at 64 the kernel spills ~30-100 bytes and
// the half-page consumer still fits (88 registers with 2 consumers, 104 with 4).
inline constexpr int kPipeWsProducerRegs = 64;
inline constexpr int kPipeWsStagesPerConsumer = 4;

// The fp8 pipelined kernels (kWgmmaKeysMPipelinedFp8 / PerRow, sm90_paged_mqa_logits_fp8.cu):
// v6's ring depth, and the blocks per SM each rows-per-pass instantiation's register cap is
// sized for (160 threads a block; ptxas -v): one row, no widened A fragments, fits 96 registers
// at 4 blocks per SM (48 KB of shared memory each; 28 B of spills); several rows keep at most
// two rows' accumulators (64) live and need 122-124 registers: 3 blocks (136; 54-71 KB each).
inline constexpr int kPipeFp8Stages = 4;
inline constexpr int PipeFp8MinBlocks(int rows_per_pass) { return rows_per_pass <= 1 ? 4 : 3; }

// Rows of one request scored together from each key tile (next_n 1-4 share every key read).
// Requests with more rows take several passes over the tile in shared memory.
// rows_per_request: the host's hint (RowBatch::rows_per_request), 0 for the average.
inline constexpr int RowsPerPass(int32_t num_rows, int32_t num_requests,
                                 int32_t rows_per_request = 0) {
  if (num_requests <= 0) return 1;
  const int32_t per_request =
      rows_per_request > 0 ? rows_per_request : (num_rows + num_requests - 1) / num_requests;
  return per_request <= 1 ? 1 : per_request >= 4 ? 4 : per_request;
}

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
