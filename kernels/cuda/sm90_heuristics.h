// Every "which kernel / how many blocks / rows per pass" choice of the CUDA backend's logits, in
// one place (numbers here are choices, not contracts: the logits do not depend on any of them
// except the precision):
// - the dense FP8 / 64-head kernel: the exact one (fp32 sums of exact f16 products, spec section
//   6's 4 fp32 ulps) or the fp8 tensor-core one (spec section 6's fp8-accumulation bound), by
//   the precision the backend was asked for (BackendLimits::logits_precision, the server's
//   --logits-precision); kDefault takes kDenseLogitsFp8ByDefault unless the environment says
//   otherwise (DI_LOGITS_PRECISION=exact or fp8: a switch for measurements, read once per
//   process);
// - FP4 caches with 32 heads: the FP4 tensor-core kernel (kFp4DenseWgmma);
// - the dense path of the other shapes (FP8 with other than 64 heads, FP4 shapes the FP4 kernel
//   refuses): the sparse tensor-core kernel over the dense rows, or the mma.sync kernel where
//   that one does not take the shape;
// - rows of a request per pass over a key tile, whether a block derives the schedule itself,
//   and per rows-per-pass the widening, the blocks per SM and the row pairs of the kernels.
// The launchers size the persistent grid as num_sms x the occupancy of that register cap
// (LaunchPersistentGrid, sm90_launch_setup.cuh).
#pragma once

#include <type_traits>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "decode_indexer/kernels/backend.h"
#include "kernels/cuda/sm90_launchers.h"
#include "kernels/cuda/sm90_tile_config.h"

namespace decode_indexer::kernels::cuda {

// ---- Which dense kernel ---------------------------------------------------------------------

// The two production kernels for FP8 with 64 heads.
inline constexpr MqaMath kExactDenseMqaMath = MqaMath::kWgmmaKeysMPipelined;
inline constexpr MqaMath kFp8DenseMqaMath = MqaMath::kWgmmaKeysMPipelinedFp8;
// What kDefault means: the fp8 kernel, measured 1.36x faster than the exact one at 64 x 32K
// next_n 1 and 1.6x at next_n 2 on the H200 (docs/results/cuda-bench.md, issue 17's first run),
// within spec section 6's fp8 bound of the reference (cuda_vs_cpu_test's
// CudaFp8ServerMatchesReference). The exact kernel stays a flag away (--logits-precision
// exact). (Why the default once moved to the exact kernel and back: docs/status.md, issue 17.)
inline constexpr bool kDenseLogitsFp8ByDefault = true;

// kDefault resolved: DI_LOGITS_PRECISION (exact / fp8) if set, else kDenseLogitsFp8ByDefault.
inline LogitsPrecision ResolveLogitsPrecision(LogitsPrecision asked) {
  if (asked != LogitsPrecision::kDefault) return asked;
  static const LogitsPrecision resolved = [] {
    const char* env = std::getenv("DI_LOGITS_PRECISION");
    if (env != nullptr && std::strcmp(env, "exact") == 0) return LogitsPrecision::kExact;
    if (env != nullptr && std::strcmp(env, "fp8") == 0) return LogitsPrecision::kFp8;
    return kDenseLogitsFp8ByDefault ? LogitsPrecision::kFp8 : LogitsPrecision::kExact;
  }();
  return resolved;
}

inline MqaMath DenseMqaMath(LogitsPrecision asked) {
  return ResolveLogitsPrecision(asked) == LogitsPrecision::kFp8 ? kFp8DenseMqaMath
                                                                : kExactDenseMqaMath;
}

// FP8 with other than 64 heads (and FP4 where the FP4 kernel below does not take the shape or
// kSparseMmaDense is asked for): the sparse consumer's tensor-core kernel scores
// the dense rows (position = index) wherever it takes the shape (SparseLogitsMmaTakes) and the
// caller did not ask for kMmaSync by name; the mma.sync kernel otherwise. That variant of the
// sparse kernel measured fastest and gives kMma's logits bit for bit; it is also what the
// backend's SparseTopK / MaskedTopK run (the v41 source layer's ~473 us of device work at
// 64 x 32K was mostly the mma.sync kernel: docs/results/multigpu.md, 13:27).
inline constexpr SparseLogitsMath kSparseLogitsMathDefault = SparseLogitsMath::kMmaPairLeanOcc;

// FP4 caches with 32 heads (v41): the FP4 tensor-core kernel (sm90_paged_mqa_logits_fp4.cu: the
// fp8 kernel's ring and schedule, pages widened to e4m3 in shared memory, fp8 wgmma per 32-dim
// scale group) instead of the sparse kernel above over the dense rows; the same logits bit for
// bit (gpu_test), so this is a speed choice only.
inline constexpr bool kFp4DenseWgmma = true;

// ---- Rows per pass, the in-block schedule ---------------------------------------------------

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
inline int DenseRowsPerPass(const RowBatch& rows) {
  return RowsPerPass(rows.num_rows, rows.num_requests, rows.rows_per_request);
}
// A dense kernel template's launch at the step's rows per pass: calls launch(rows) with rows a
// std::integral_constant<int, 1..4> (DenseRowsPerPass), so that each kernel file names its
// instantiation once instead of a case per row count.
template <typename Launch>
auto WithDenseRowsPerPass(const RowBatch& rows, Launch&& launch) {
  switch (DenseRowsPerPass(rows)) {
    case 1:
      return launch(std::integral_constant<int, 1>{});
    case 2:
      return launch(std::integral_constant<int, 2>{});
    case 3:
      return launch(std::integral_constant<int, 3>{});
    default:
      return launch(std::integral_constant<int, 4>{});
  }
}

// The warp-specialized kernels derive the step's schedule in each block's shared memory (no
// schedule launch, a kernel boundary on the critical path of small steps) up to this many
// requests; beyond it they read LaunchMqaSchedule's.
inline constexpr int kOwnScheduleMaxRequests = 256;
inline bool DenseComputesOwnSchedule(const RowBatch& rows) {
  return rows.num_requests <= kOwnScheduleMaxRequests;
}

// ---- The exact kernel (sm90_paged_mqa_logits_pipelined.cu) ----------------------------------

// Page slots in its producer warp's ring.
inline constexpr int kPipeStages = 4;
// Per rows per pass: the widening (both give the same logits; speed only), the blocks per SM
// its register cap is sized for, and whether two rows' MMAs are in flight at once.
// One row per pass: the split widening (7-10% faster than cvt at next_n 1, docs/results/
// cuda-bench.md 08:20) at 3 blocks per SM with 128 registers (4 fit in shared memory but cap
// registers at 96 and spill: measured slower at 1-64 x 8K-64K on the H200, 09:59). Several rows:
// cvt (split is 1-3% slower where two wgmma rounds per page hide the widening), row pairs at 2
// blocks per SM with up to 200 registers (faster than one row at a time with 3 blocks at every
// next_n 2 shape).
struct PipelinedShape {
  int widen;  // Widen (sm90_tile_config.h)
  int min_blocks;
  bool pair_rows;
};
inline constexpr PipelinedShape PipelinedShapeFor(int rows_per_pass) {
  return rows_per_pass <= 1 ? PipelinedShape{kWidenSplit, 3, false}
                            : PipelinedShape{kWidenCvt, 2, true};
}

// ---- The fp8 kernel (sm90_paged_mqa_logits_fp8.cu) ------------------------------------------

// Per rows per pass: the ring depth, the blocks per SM the register cap is sized for (160
// threads a block; ptxas -v) and where a thread's head weights live (the first one or two rows
// of a pass in registers, loaded once per request; later rows from shared memory, four 16-byte
// loads a row and page). One row: 4 slots, 96 registers at 4 blocks per SM (48 KB of shared
// memory each). Two rows (next_n 2): 3 blocks at up to 136 registers and 4 slots: measured 11%
// faster at 64 x 32K than 4 blocks at 96 registers with the weights read from shared memory (3
// slots), and 2.8x faster than 4 blocks with the weights in registers (spills); 5 slots gained
// nothing (docs/results/cuda-bench.md, the bench's fp8 variants). Three or four rows: q takes
// 32 KB, so 3 blocks (4 slots, 65-73 KB each) at 128 registers; rows 0-1's weights in registers
// measured 13% faster at next_n 3 and 2% at next_n 4 (where ptxas spills 24 bytes) than all
// four rows' from shared memory.
inline constexpr int kPipeFp8Stages = 4;
inline constexpr int PipeFp8MinBlocks(int rows_per_pass) { return rows_per_pass == 1 ? 4 : 3; }
inline constexpr bool kPipeFp8WeightRegs = true;

// ---- The FP4 kernel (sm90_paged_mqa_logits_fp4.cu) ------------------------------------------

// Page slots in its ring (4352 bytes each) and blocks per SM: 4 group accumulators of 16 floats
// per row live at once need more than the 96 registers of 4 blocks.
inline constexpr int kPipeFp4Stages = 4;
inline constexpr int PipeFp4MinBlocks(int /*rows_per_pass*/) { return 3; }
// The 4 group wgmmas of a row in one round (all 64 accumulators live).
inline constexpr int PipeFp4GroupRounds(int /*rows_per_pass*/) { return 1; }
// Each group's A widened with its signs (five instructions per 4 codes, one wgmma a group), not
// split by sign into two fragments (a prmt lookup per 4 codes each, a second wgmma subtracting):
// the split needs 16 more registers, spills at 3 blocks from two rows a pass, and measured
// 0.98-1.0x at next_n 1 and 6-9% slower at next_n 2-4 from 64 requests up (bench variant
// "fp4 A split by sign", docs/results/cuda-bench.md, session 19's 22:34 run).
inline constexpr bool kPipeFp4SignSplit = false;

// Top-k (LaunchRadixTopK, kAuto / kGeneral): plain rows (no index map, length divisor 1) whose
// bound is at most kMultiPassTopKMaxLength entries take the multi-pass kernel, whatever the
// row count. Measured on the H200 against the compact kernel kAuto took there, at avg 8K rows
// (max 7.2K-10.6K; docs/results/cuda-bench.md 13:58 and 17:20 runs, bench --topk): 1 row 10.8
// against 15.4 us, 8 rows 12.6 / 17.8, 64 rows 13.1 / 18.3, 128 rows 13.4 / 18.4, 256 rows 20.3
// / 34.3. Longer rows: not measured below 30K, where the multi-pass kernel loses from 64 rows on.
inline constexpr int32_t kMultiPassTopKMaxLength = 12288;
inline constexpr bool MultiPassTopKPreferred(int32_t max_length) {
  return max_length > 0 && max_length <= kMultiPassTopKMaxLength;
}

}  // namespace decode_indexer::kernels::cuda
