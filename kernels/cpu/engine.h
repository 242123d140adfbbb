// The CPU kernels' engine: the scoring core shared by the free reference functions (one
// thread) and the CPU backend (a thread pool). Private to kernels/cpu.
//
// Scoring works on chunks of kKeyChunk cache entries: the chunk's keys are dequantized once
// into a [D][kKeyChunk] double tile and scored for every loaded row, so the rows of a request
// share each key read. The per-key arithmetic is fixed (exact dots, then double sums in head
// order), so a logit never depends on which rows or positions share its chunk.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "decode_indexer/kernels/backend.h"
#include "kernels/cpu/dot_tile.h"
#include "kernels/cpu/thread_pool.h"

namespace decode_indexer::kernels::cpu::internal {

inline constexpr int32_t kKeyChunk = kTileKeys;
// Rows of one request scored together (sharing key reads); longer requests take more passes.
inline constexpr int32_t kMaxGroupRows = 8;

// The dequantized q of up to kMaxGroupRows rows.
struct LoadedQ {
  CacheFormat format = CacheFormat::kFp8;
  int32_t num_rows = 0;
  int32_t num_heads = 0;
  int32_t head_dim = 0;
  std::vector<double> values;   // [rows, H, D] code values (unscaled)
  std::vector<double> scales;   // FP4: [rows, H, D/32]
  std::vector<double> weights;  // [rows, H]
};

struct ThreadScratch {
  LoadedQ q;
  std::vector<double> key_tile;    // [D, kKeyChunk]
  std::vector<double> key_scales;  // FP8: [kKeyChunk]; FP4: [D/32, kKeyChunk]
  std::vector<float> chunk_out;    // [kMaxGroupRows, kKeyChunk]
  std::vector<int64_t> slots;      // [kKeyChunk]
  std::vector<float> logits;       // [kMaxGroupRows, max_context]
  std::vector<float> select;       // top-k work, [max(max_context, candidate positions)]
  std::vector<float> gathered;     // logits at a position list
  std::vector<int32_t> positions;  // a position list
  std::vector<float> block_scores;
};

// Runs the kernels single-threaded (pool == nullptr) or over a thread pool. Scratch is kept
// between calls and only grows; Reserve sizes it once from the backend's limits.
class Engine {
 public:
  explicit Engine(ThreadPool* pool);

  void Reserve(const BackendLimits& limits);
  int num_threads() const { return pool_ ? pool_->size() : 1; }

  absl::Status DenseTopK(const DenseArgs& args);
  absl::Status SparseTopK(const SparseArgs& args);
  absl::Status MaskedTopK(const MaskedArgs& args);

 private:
  // Consecutive rows of one request, at most kMaxGroupRows.
  struct RowGroup {
    int32_t begin = 0;
    int32_t end = 0;
    int32_t request = 0;
    int32_t max_length = 0;
  };
  absl::Status BuildGroups(const CacheView& cache, const RowBatch& rows);
  void ParallelFor(int64_t n, const std::function<void(int64_t, int)>& fn);
  // Dense logits of a group into scratch.logits (row i at i * stride), in parallel over
  // position spans when there are fewer groups than threads.
  void GroupLogits(const CacheView& cache, const RowBatch& rows, const QView& q,
                   const RowGroup& group, ThreadScratch& owner, bool split_positions);
  // Builds every group's logits, then calls row_fn(row, logits, scratch) for each row with
  // the running thread's scratch (row_fn must not touch scratch.logits).
  template <typename RowFn>
  void ForGroups(const CacheView& cache, const RowBatch& rows, const QView& q, RowFn row_fn);

  ThreadPool* pool_;
  std::vector<ThreadScratch> scratch_;
  std::vector<RowGroup> groups_;
  int64_t logits_stride_ = 0;
};

// ---- The scoring core ----------------------------------------------------------------------

// Loads rows [row_begin, row_begin + num_rows) of q.
void LoadQ(const QView& q, CacheFormat format, int32_t head_dim, int32_t row_begin,
           int32_t num_rows, LoadedQ& out);

// Scores `count` (<= kKeyChunk) entries at cache slot indices `slots` for every loaded row:
// scratch.chunk_out[r * kKeyChunk + i] = logit of loaded row r at entry i.
void ScoreChunk(const CacheView& cache, const LoadedQ& q, const int64_t* slots, int32_t count,
                ThreadScratch& scratch);

// Dense logits of the loaded rows at positions [begin, end) of `request` (begin a multiple of
// kKeyChunk): out[r * stride + p] for p < lengths[r].
void ScoreSpan(const CacheView& cache, const RowBatch& rows, int32_t request, const LoadedQ& q,
               const int32_t* lengths, int64_t begin, int64_t end, float* out, int64_t stride,
               ThreadScratch& scratch);

// Logits of loaded row 0 at positions[0..count) of `request` into out[count].
void ScorePositions(const CacheView& cache, const RowBatch& rows, int32_t request, const LoadedQ& q,
                    const int32_t* positions, int32_t count, float* out, ThreadScratch& scratch);

// Top-k with caller-provided work space (grown as needed).
void TopKWith(const float* logits, int32_t length, int32_t k, int32_t* out,
              std::vector<float>& work);
void TopKAtWith(const float* logits, const int32_t* positions, int32_t count, int32_t k,
                int32_t* out, std::vector<float>& work);
void SelectCandidateBlocksWith(const float* logits, int32_t length, int32_t num_blocks,
                               int32_t block_size, int32_t* out, std::vector<float>& scores,
                               std::vector<float>& work);
// Expands one row's candidate blocks into positions (ascending, below length); returns count.
int32_t ExpandRow(const int32_t* candidates, int32_t num_blocks, int32_t block_size, int32_t length,
                  int32_t* positions);

}  // namespace decode_indexer::kernels::cpu::internal
