// Launchers of the SM90 kernels. Device code takes raw pointers; each launcher checks what is
// cheap, enqueues its kernel(s) on `stream` and returns a Status (never synchronises). The
// Backend (cuda_backend.cc) owns workspaces and streams and strings these together; the
// benchmark calls them one by one to time each stage.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "decode_indexer/kernels/backend.h"
#include "decode_indexer/kernels/types.h"

namespace decode_indexer::kernels::cuda {

// ---- Key insert (sm90_insert_keys.cu) ------------------------------------------------------
absl::Status LaunchInsertKeys(const KeyInsertArgs& args, cudaStream_t stream);

// ---- rope_quant_q (sm90_rope_quant_q.cu) ---------------------------------------------------
// weight_scale is float(1 / sqrt(double(H * D))), computed once on the host.
absl::Status LaunchRopeQuantQ(const QPrepArgs& args, float weight_scale, cudaStream_t stream);

// ---- Work schedule of the paged logits (sm90_mqa_schedule.cu) -------------------------------
// Per request of a RowBatch: its first row, its row count, its longest row and an inclusive
// prefix of its key tiles. Computed on the device from the step's lengths (no host sync).
struct MqaSchedule {
  int32_t* request_first_row = nullptr;  // [max_requests]
  int32_t* request_num_rows = nullptr;   // [max_requests]
  int32_t* request_max_len = nullptr;    // [max_requests]
  int32_t* tile_prefix = nullptr;        // [max_requests + 1]: tiles of requests < b
};
// Workspace ints an MqaSchedule for `max_requests` requests needs.
int64_t MqaScheduleInts(int32_t max_requests);
MqaSchedule CarveMqaSchedule(int32_t* workspace, int32_t max_requests);
absl::Status LaunchMqaSchedule(const RowBatch& rows, const MqaSchedule& schedule,
                               cudaStream_t stream);

// ---- Paged MQA logits (sm90_paged_mqa_logits.cu) -------------------------------------------
// logits[r * logits_stride + t] for t < row_length[r]; other entries are left alone.
// Requests with more rows than a pass holds (RowsPerPass, sm90_heuristics.h, from the host's
// rows_per_request hint) are scored in several passes over each key tile.
// The production kernels, one per job (which one runs where: sm90_heuristics.h). Comparison
// variants (keys-M and its split / fused / bit-move widenings, the 2 / 4 consumer-warpgroup Ws2 /
// Ws4) live under bench/cuda/variants/, built only with the benchmarks (DI_BUILD_BENCH).
enum class MqaMath {
  // mma.sync m16n8k32 (every format and head count). FP4 / 32-head caches run the FP4 kernel,
  // other FP4 shapes and FP8 with other than 64 heads the sparse tensor-core kernel over the
  // dense rows, unless this is asked for explicitly (LaunchPagedMqaLogits); it is their
  // fallback where neither takes the shape.
  kMmaSync,
  // FP8 / 64 heads, exact (f16 products, fp32 sums: spec section 6's 4 fp32 ulps): keys as M,
  // warp-specialized: a producer warp fills an mbarrier ring of page slots, the consumer
  // warpgroup never waits on a block barrier (sm90_paged_mqa_logits_pipelined.cu); derives its
  // own schedule for up to kOwnScheduleMaxRequests requests.
  kWgmmaKeysMPipelined,
  // FP8 / 64 heads, not exact (spec section 6, the fp8-accumulation tolerance): the same page
  // ring filled by the TMA unit, the consumer's wgmma m64nNk32 e4m3 reading the page slot and q
  // (e4m3) straight from shared memory, N = 64 per row or 128 per row pair: every key read once
  // per request for next_n 1-4 (sm90_paged_mqa_logits_fp8.cuh / .cu). Bit-identical across runs,
  // grids and batch compositions.
  kWgmmaKeysMPipelinedFp8,
  // The sparse consumer's tensor-core kernel over the dense rows (position = index), wherever
  // it takes the shape: the path FP4 / 32-head layers took before the FP4 kernel below, asked
  // for by name to time and check against. FP8 with other than 64 heads takes it whatever is
  // asked, except kMmaSync.
  kSparseMmaDense,
};
struct PagedLogitsArgs {
  CacheView cache;
  RowBatch rows;
  QView q;
  MqaSchedule schedule;
  float* logits = nullptr;
  int64_t logits_stride = 0;
  // FP8 with 64 heads: which kernel (DenseMqaMath, sm90_heuristics.h, picks it for the
  // backend). Other shapes run the sparse tensor-core kernel or kMmaSync.
  MqaMath math = MqaMath::kWgmmaKeysMPipelined;
  // Optional threshold-filter histogram (null: off), filled only by the keys-M comparison
  // variant (bench/cuda/variants/, MqaVariantFillsHistogram): it adds the TopKBucket
  // (sm90_topk_bucket.cuh) of each logit it writes at a position that is a multiple of
  // kTopKSampleStride to row_histogram[row * kTopKBins + bucket]. The production kernels ignore
  // it.
  uint32_t* row_histogram = nullptr;
};
absl::Status LaunchPagedMqaLogits(const PagedLogitsArgs& args, int num_sms, cudaStream_t stream);
// False when this launch derives the schedule itself (the FP8 / 64-head kernels with few enough
// requests): then args.schedule is not read and LaunchMqaSchedule may be skipped.
bool PagedLogitsNeedsSchedule(const PagedLogitsArgs& args);
// The two FP8 / 64-head kernels, reached through LaunchPagedMqaLogits: the exact one
// (sm90_paged_mqa_logits_pipelined.cu) and the fp8 one (sm90_paged_mqa_logits_fp8.cu).
absl::Status LaunchPagedMqaLogitsPipelined(const PagedLogitsArgs& args, int num_sms,
                                           cudaStream_t stream);
absl::Status LaunchPagedMqaLogitsFp8(const PagedLogitsArgs& args, int num_sms, cudaStream_t stream);
// The FP4 tensor-core kernel (sm90_paged_mqa_logits_fp4.cu): MXFP4 caches of 64-entry pages,
// 128 dims, 32 heads (the v41 profile), where PagedMqaLogitsFp4Takes; the logits are the sparse
// tensor-core kernel's bit for bit. LaunchPagedMqaLogits takes it for those shapes unless
// kMmaSync or kSparseMmaDense is asked for (sm90_heuristics.h, kFp4DenseWgmma).
bool PagedMqaLogitsFp4Takes(const PagedLogitsArgs& args);
absl::Status LaunchPagedMqaLogitsFp4(const PagedLogitsArgs& args, int num_sms, cudaStream_t stream);

// ---- Radix top-k (sm90_radix_topk.cu) ------------------------------------------------------
// Per row r: the top k of values[r * stride + i], i < lengths[r] (or `fixed_length` when
// lengths is null), by (value desc, index asc); out[r * k ...] holds the indices ascending
// (mapped through index_map[r * index_map_stride + i] when given), -1 padded.
struct TopKArgs {
  int32_t num_rows = 0;
  const float* values = nullptr;
  int64_t stride = 0;
  const int32_t* lengths = nullptr;
  int32_t fixed_length = 0;
  // Candidate blocks: lengths are entry counts and the row's length in blocks is
  // ceil(length / length_divisor) (1 for plain rows).
  int32_t length_divisor = 1;
  int32_t k = 0;
  int32_t* out = nullptr;
  const int32_t* index_map = nullptr;
  int64_t index_map_stride = 0;
  // Host-known bound on a row's length in entries (0: unknown); sizes the clusters.
  int32_t max_length = 0;
  // kAuto (the default): kMultiPass when rows are few enough to get clusters of 4-8 blocks
  // (measured faster there: 1 x 128K, 8 x 32K), else kCompact with one block a row, two for
  // rows of 64K+ when 2 blocks a row still fit the SMs; kCompact whenever row_histogram is set
  // (H200, 10:18 run, docs/notes/cuda.md "Top-k, second session").
  // kCompact: a histogram of a 1/16 sample of the row (none when row_histogram
  // is given) bounds the threshold bucket from below, one pass compacts the candidates (the
  // entries at or above that bound) into shared memory, and the exact radix passes and the
  // output read only those; rows where the sample misleads or the candidates do not fit fall
  // back to a full histogram and passes over the row (the same answer, slower). kMultiPass: the
  // first version (11 + 11 + 10-bit passes over the row, then an ordered compaction pass), kept to
  // time against and as a switch-off.
  // kCooperative: LaunchCooperativeTopK (the row's keys held in a cluster's shared memory, one
  // launch; 1-64 rows, max_length required and in keys, no row_histogram), InvalidArgument
  // where CooperativeTopKSupported refuses. kGeneral: kAuto's choice between kCompact and
  // kMultiPass, never kCooperative (a switch-off). kAuto takes kCooperative only where
  // CooperativeTopKPreferred says (measured faster) and no row_histogram is given.
  enum class Algo { kAuto, kCompact, kMultiPass, kCooperative, kGeneral };
  Algo algo = Algo::kAuto;
  // Optional per-row histogram of TopKBucket over the row's sample, as the logits epilogue
  // builds it (PagedLogitsArgs::row_histogram); kCompact only, length_divisor 1. The kernel
  // then skips its own sample pass, and zeroes the row's histogram after reading it.
  uint32_t* row_histogram = nullptr;
  // Blocks per row (a thread-block cluster, 1-8, a power of two); 0: the algorithm's heuristic.
  int32_t cluster_size = 0;
};
absl::Status LaunchRadixTopK(const TopKArgs& args, int num_sms, cudaStream_t stream);

// ---- Cooperative top-k (sm90_cooperative_topk.cu) ------------------------------------------
// TopKArgs::Algo::kCooperative (LaunchRadixTopK calls it): LaunchRadixTopK's answer bit for
// bit, for 1-kCooperativeTopKMaxRows rows, in one launch of a thread-block cluster a row (2-8
// blocks: rows x cluster <= 128; TopKArgs::cluster_size overrides) whose blocks hold the row's
// keys in shared memory. Needs a bound on a row's keys (TopKArgs::max_length, in keys, i.e.
// ceil(entries / length_divisor); the fixed length when lengths is null): it sizes shared
// memory, and a longer row answers all -1 (a contract violation made visible).
inline constexpr int32_t kCooperativeTopKMaxRows = 64;
// The gate on host values (row count, bound on a row's keys, k) at the default cluster size:
// 1-16 rows up to 425,984 keys a row, 17-32 212,992, 33-64 106,496.
bool CooperativeTopKSupported(int32_t num_rows, int32_t max_length, int32_t k);
absl::Status LaunchCooperativeTopK(const TopKArgs& args, cudaStream_t stream);
// kAuto's choice (host values only, so the ranks of a step decide alike): the gate holds and
// the cooperative top-k measured faster than the general kernels at this shape.
bool CooperativeTopKPreferred(int32_t num_rows, int32_t max_length, int32_t k, int num_sms);

// ---- Candidate-block scores (sm90_candidate_scores.cu) ------------------------------------
// scores[r * scores_stride + j] = max logit of block j below row_length[r]; the newest block
// scores +inf (spec section 7).
absl::Status LaunchCandidateScores(int32_t num_rows, const float* logits, int64_t logits_stride,
                                   const int32_t* row_length, int32_t block_size, float* scores,
                                   int64_t scores_stride, int32_t max_blocks, cudaStream_t stream);

// ---- Cooperative candidate-block selection (sm90_cooperative_topk.cu) ---------------------
// The two launches above in one (the seed's select_candidate_blocks_cooperative), for up to
// kCooperativeCandidatesMaxRows rows: out[r * k ...] = the top min(k, ceil(row_length[r] /
// block_size)) blocks by (score desc, block id asc), ascending, -1 padded; the same answer
// as LaunchCandidateScores + LaunchRadixTopK (length_divisor block_size) bit for bit. One
// thread-block cluster a row (2-8 blocks: rows x cluster <= 128), the row's block scores held
// in the cluster's shared memory.
inline constexpr int32_t kCooperativeCandidatesMaxRows = kCooperativeTopKMaxRows;
struct CooperativeCandidatesArgs {
  int32_t num_rows = 0;
  const float* logits = nullptr;  // [num_rows, logits_stride]
  int64_t logits_stride = 0;
  const int32_t* row_length = nullptr;  // [num_rows]
  int32_t block_size = 0;
  // Host bound on ceil(row_length[r] / block_size): sizes shared memory (a longer row answers
  // all -1).
  int32_t max_blocks_per_row = 0;
  int32_t k = 0;
  int32_t* out = nullptr;  // [num_rows, k]
};
// The gate, on host values only (the rank's row count, ceil(max context / block size), K_c),
// so every rank of a step decides alike: true for 1-64 rows whose blocks fit the cluster's
// shared memory (with 1-16 rows up to 425,984 blocks a row, 17-32 212,992, 33-64 106,496).
bool CooperativeCandidatesSupported(int32_t num_rows, int32_t max_blocks_per_row, int32_t k);
// InvalidArgument where the gate refuses (0 rows: nothing to do).
absl::Status LaunchCooperativeCandidates(const CooperativeCandidatesArgs& args,
                                         cudaStream_t stream);

// ---- Candidate expansion (sm90_expand_candidates.cu) ---------------------------------------
absl::Status LaunchExpandCandidates(const ExpandArgs& args, cudaStream_t stream);

// ---- Sparse logits at given positions (sm90_sparse_logits.cu) ------------------------------
// logits[r * max_positions + i] for i < counts[r], of position positions[r * max_positions + i];
// entries at i >= counts[r] are left alone (the top-k reads counts[r] entries).
// kGrid (this launcher's default argument): blocks over (row, 256 positions), one thread per
// position, q in shared memory (FP8/FP4, up to 64 heads, 16-byte aligned pages; other shapes
// fall back). kWarpPerPosition: the first version, one block per row (kept to time against).
// kMma: tensor cores, a warp per 16 positions (mma.sync m16n8k16 f16, keys gathered with
// cp.async, widened exactly; sm90_sparse_logits_mma.cuh); shapes it does not take fall back to
// kGrid. kMmaPairLeanOcc (what the backend's SparseTopK / MaskedTopK run,
// kSparseLogitsMathDefault): kMma with two m-tiles per warp step, q's fragments in shared
// memory, a lean copy issue and each key's group scales decoded once (FP4, <= 32 heads; other
// shapes run kMma): kMma's logits bit for bit. The kernel's other shapes (key-folded, plain
// pairs, q shared alone, the lean copy alone) are comparison variants, built with the
// benchmarks (bench/cuda/variants/sparse_logits_variants.h).

enum class SparseLogitsMath {
  kGrid,
  kWarpPerPosition,
  kMma,
  kMmaPairLeanOcc,
};
absl::Status LaunchSparseLogits(const CacheView& cache, const RowBatch& rows, const QView& q,
                                const int32_t* positions, const int32_t* counts,
                                int32_t max_positions, float* logits, cudaStream_t stream,
                                SparseLogitsMath math = SparseLogitsMath::kGrid);
// The kMma kernel (sm90_sparse_logits_mma.cu), reached through LaunchSparseLogits: whether it
// takes the shape (head dim 128, 1-64 heads, 16-byte aligned pages, 4-byte scales), and its
// launch (Unimplemented for other shapes). positions == nullptr scores a dense row: row r's
// positions 0 .. counts[r] - 1, logits at [r * max_positions + position]; this is how
// LaunchPagedMqaLogits runs the dense layers the keys-M kernels do not take (FP4, FP8 with
// other than 64 heads).
// The tensor-core variant the backend runs: kSparseLogitsMathDefault (sm90_heuristics.h).
bool SparseLogitsMmaTakes(const CacheView& cache, const QView& q);
absl::Status LaunchSparseLogitsMma(const CacheView& cache, const RowBatch& rows, const QView& q,
                                   const int32_t* positions, const int32_t* counts,
                                   int32_t max_positions, float* logits, cudaStream_t stream,
                                   SparseLogitsMath math = SparseLogitsMath::kMma);

// ---- Row copies (sm90_copy_rows.cu) --------------------------------------------------------
absl::Status LaunchCopyRows(const CopyRowsArgs& args, cudaStream_t stream);

// ---- Value checks of device-resident inputs (sm90_check_values.cu) ------------------------
// Clears *args.flags, then ORs in the bit of each tensor holding a NaN / Inf.
absl::Status LaunchCheckValues(const ValueCheckArgs& args, int32_t num_sms, cudaStream_t stream);

}  // namespace decode_indexer::kernels::cuda
