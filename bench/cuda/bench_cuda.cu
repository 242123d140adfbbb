// decode-indexer-bench-cuda: times the CUDA backend's dense layer step on the GPU (a binary,
// not a test). For each (requests, next_n, average context) of the issue's grid: microseconds
// per layer step for logits (the schedule launch where the variant needs one + paged logits), for
// top-k alone, and for both; the key bytes each step must read and the achieved key-read bandwidth
// against a large device-to-device copy measured in the same run. Writes one JSON object per
// configuration (with the lengths drawn, so torch_baseline.py times the PyTorch path on the same
// shapes).
//
// Timing: CUDA events around a batch of back-to-back steps (the steady state a server sees
// when it adds no host work between launches), median of several batches after warm-up; each
// step of a batch uses another of several input sets (page tables over distinct pages, q and
// weights), so that no step finds its keys in L2.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "bench/cuda/variants/fp4_variants.h"
#include "bench/cuda/variants/mqa_variants.h"
#include "bench/cuda/variants/sparse_logits_variants.h"
#include "common/version_line.h"
#include "kernels/cuda/sm90_heuristics.h"
#include "kernels/cuda/sm90_launchers.h"
#include "kernels/cuda/sm90_tile_config.h"

namespace di = decode_indexer::kernels;
namespace dc = decode_indexer::kernels::cuda;

#define CHECK_CUDA(expr, what)                                                      \
  do {                                                                              \
    cudaError_t e_ = (expr);                                                        \
    if (e_ != cudaSuccess) {                                                        \
      std::fprintf(stderr, "CUDA error in %s: %s\n", what, cudaGetErrorString(e_)); \
      std::exit(1);                                                                 \
    }                                                                               \
  } while (0)
#define CHECK_OK(expr, what)                                                     \
  do {                                                                           \
    absl::Status s_ = (expr);                                                    \
    if (!s_.ok()) {                                                              \
      std::fprintf(stderr, "%s: %s\n", what, std::string(s_.message()).c_str()); \
      std::exit(1);                                                              \
    }                                                                            \
  } while (0)

namespace {

constexpr int kHeads = 64;  // v32
constexpr int kTopK = 2048;
constexpr int kPage = 64;
constexpr int64_t kPageBytes = 64 * 132;

// Random finite e4m3 codes (|code| < 0x78) and power-of-two scales, by a hash of the index.
__global__ void FillPages(uint8_t* pool, int64_t pages, uint64_t seed) {
  const int64_t n = pages * kPageBytes / 4;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint64_t h = (i + seed) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 31;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 29;
    const int64_t byte = i * 4;
    const int64_t in_page = byte % kPageBytes;
    uint32_t v;
    if (in_page < 64 * 128) {
      v = (static_cast<uint32_t>(h) & 0x77777777u) | (static_cast<uint32_t>(h >> 32) & 0x80808080u);
    } else {
      const int e = 120 + static_cast<int>(h % 8);  // 2^-7 .. 2^0
      v = static_cast<uint32_t>(e) << 23;
    }
    reinterpret_cast<uint32_t*>(pool)[i] = v;
  }
}

// FP4 key scales as quantizing one vector gives them (the consumer's folded variants): per
// cache slot of an FP4 pool, a largest group scale 2^-7 .. 2^0 and the other groups within 3
// binades below it.
__global__ void FillFp4KeyScales(uint8_t* pool, int64_t pages, int64_t page_bytes, int page_size,
                                 int value_bytes, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < pages * page_size;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint64_t h = (i + seed) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 31;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 29;
    const uint32_t top = 120 + static_cast<uint32_t>(h % 8);
    const int top_group = static_cast<int>((h >> 8) % 4);
    uint32_t v = 0;
    for (int g = 0; g < 4; ++g) {
      const uint32_t b =
          g == top_group ? top : top - static_cast<uint32_t>((h >> (16 + 2 * g)) % 4);
      v |= b << (8 * g);
    }
    uint8_t* page = pool + (i / page_size) * page_bytes;
    reinterpret_cast<uint32_t*>(page + int64_t{page_size} * value_bytes)[i % page_size] = v;
  }
}

__global__ void FillQ(uint8_t* q, int64_t n, float* w, int64_t nw, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint64_t h = (i + seed) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 29;
    q[i] = static_cast<uint8_t>(h & 0x77) | static_cast<uint8_t>((h >> 8) & 0x80);
    if (i < nw) w[i] = (static_cast<int>((h >> 16) & 1023) - 512) / 4096.0f;
  }
}

struct InputSet {
  int32_t* page_table = nullptr;
  uint8_t* q = nullptr;
  float* w = nullptr;
};

float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median microseconds per step over `batches` batches of `per_batch` back-to-back steps (CUDA
// events around each batch), after 3 warm-up steps.
template <typename Step>
float TimeBatches(cudaStream_t st, cudaEvent_t e0, cudaEvent_t e1, int batches, int per_batch,
                  Step&& step) {
  for (int i = 0; i < 3; ++i) step();  // warm-up
  std::vector<float> per_step;
  for (int bt = 0; bt < batches; ++bt) {
    CHECK_CUDA(cudaEventRecord(e0, st), "record");
    for (int i = 0; i < per_batch; ++i) step();
    CHECK_CUDA(cudaEventRecord(e1, st), "record");
    CHECK_CUDA(cudaEventSynchronize(e1), "sync");
    float ms;
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1), "elapsed");
    per_step.push_back(ms * 1000.f / per_batch);
  }
  return Median(per_step);
}

// The same timing as CUDA-graph replay: `per_batch` steps captured once into a graph (each step
// what it would launch eagerly, so the rotated input sets too), replayed `batches` times: GPU time
// without the host's launch cost, as DeepGEMM's dg_bench.py times its graph column. The
// launchers' one-time setup must have run (an eager call first).
template <typename Step>
float TimeGraph(cudaStream_t st, cudaEvent_t e0, cudaEvent_t e1, int batches, int per_batch,
                Step&& step) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CHECK_CUDA(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), "begin capture");
  for (int i = 0; i < per_batch; ++i) step();
  CHECK_CUDA(cudaStreamEndCapture(st, &graph), "end capture");
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  CHECK_CUDA(cudaGraphLaunch(exec, st), "warm-up replay");
  std::vector<float> per_step;
  for (int bt = 0; bt < batches; ++bt) {
    CHECK_CUDA(cudaEventRecord(e0, st), "record");
    CHECK_CUDA(cudaGraphLaunch(exec, st), "replay");
    CHECK_CUDA(cudaEventRecord(e1, st), "record");
    CHECK_CUDA(cudaEventSynchronize(e1), "sync");
    float ms;
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1), "elapsed");
    per_step.push_back(ms * 1000.f / per_batch);
  }
  CHECK_CUDA(cudaGraphExecDestroy(exec), "destroy graph exec");
  CHECK_CUDA(cudaGraphDestroy(graph), "destroy graph");
  return Median(per_step);
}

// The v41 consumer layer step (docs/results/multigpu.md): 64 rows (one request each, contexts
// around 64K) x 2048 candidate blocks of 8 = 16K positions, FP4 cache, 32 heads, top 512.
// Times the sparse logits in each variant (warp per position, grid, tensor-core kMma), the radix
// top-k over them, and the step (logits + top-k) as SparseTopK runs it (kMma) and with kGrid;
// the byte floor is the candidate keys read once at the copy bandwidth measured in this run. The
// pool's bytes read as FP4 pages are valid codes and scales (FillPages never writes 0xFF). Each
// step uses another of several page tables.
int RunConsumer(uint8_t* pool, int64_t pool_bytes, int sms, cudaStream_t st, cudaEvent_t e0,
                cudaEvent_t e1, std::mt19937_64& rng, FILE* out, double copy_gbs) {
  constexpr int kRows = 64, kHeads32 = 32, kBlocks = 2048, kBlock = 8, kK = 512, kCtx = 65536;
  constexpr int kMaxPos = kBlocks * kBlock;
  const di::CacheGeometry geo{di::CacheFormat::kFp4, 128, kPage};
  const int64_t pages = pool_bytes / geo.page_bytes();
  const int ctx_pages = kCtx / kPage;
  const int sets = static_cast<int>(std::min<int64_t>(8, pages / (int64_t{kRows} * ctx_pages)));
  std::vector<int32_t> perm(pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t*> tables(sets);
  for (int s = 0; s < sets; ++s) {
    std::vector<int32_t> pt(perm.begin() + int64_t{s} * kRows * ctx_pages,
                            perm.begin() + int64_t{s + 1} * kRows * ctx_pages);
    CHECK_CUDA(cudaMalloc(&tables[s], 4 * pt.size()), "page table");
    CHECK_CUDA(cudaMemcpy(tables[s], pt.data(), 4 * pt.size(), cudaMemcpyHostToDevice), "pt");
  }
  // Candidates: 2048 distinct random blocks of each row's 8192, ascending, expanded.
  std::vector<int32_t> rr(kRows), rl(kRows, kCtx), pos(int64_t{kRows} * kMaxPos),
      cnt(kRows, kMaxPos);
  std::vector<int32_t> blocks(kCtx / kBlock);
  for (int r = 0; r < kRows; ++r) {
    rr[r] = r;
    std::iota(blocks.begin(), blocks.end(), 0);
    std::shuffle(blocks.begin(), blocks.end(), rng);
    std::sort(blocks.begin(), blocks.begin() + kBlocks);
    for (int j = 0; j < kBlocks; ++j) {
      for (int o = 0; o < kBlock; ++o)
        pos[int64_t{r} * kMaxPos + j * kBlock + o] = blocks[j] * kBlock + o;
    }
  }
  int32_t *d_rr, *d_rl, *d_pos, *d_cnt, *d_out;
  uint8_t *d_q, *d_qs;
  float *d_w, *d_logits;
  CHECK_CUDA(cudaMalloc(&d_rr, 4 * kRows), "rows");
  CHECK_CUDA(cudaMalloc(&d_rl, 4 * kRows), "lengths");
  CHECK_CUDA(cudaMalloc(&d_cnt, 4 * kRows), "counts");
  CHECK_CUDA(cudaMalloc(&d_pos, 4 * pos.size()), "positions");
  CHECK_CUDA(cudaMalloc(&d_out, 4 * kRows * kK), "out");
  CHECK_CUDA(cudaMalloc(&d_logits, 4 * pos.size()), "logits");
  CHECK_CUDA(cudaMalloc(&d_q, kRows * kHeads32 * 64), "q");
  CHECK_CUDA(cudaMalloc(&d_qs, kRows * kHeads32 * 4), "q scales");
  CHECK_CUDA(cudaMalloc(&d_w, 4 * kRows * kHeads32), "w");
  CHECK_CUDA(cudaMemcpy(d_rr, rr.data(), 4 * kRows, cudaMemcpyHostToDevice), "rows");
  CHECK_CUDA(cudaMemcpy(d_rl, rl.data(), 4 * kRows, cudaMemcpyHostToDevice), "lengths");
  CHECK_CUDA(cudaMemcpy(d_cnt, cnt.data(), 4 * kRows, cudaMemcpyHostToDevice), "counts");
  CHECK_CUDA(cudaMemcpy(d_pos, pos.data(), 4 * pos.size(), cudaMemcpyHostToDevice), "positions");
  FillQ<<<64, 256, 0, st>>>(d_q, kRows * kHeads32 * 64, d_w, kRows * kHeads32, rng());
  // q scales 2^-40: with the pool's key scale bytes (up to 2^120) every logit stays finite.
  CHECK_CUDA(cudaMemsetAsync(d_qs, 87, kRows * kHeads32 * 4, st), "q scales");
  CHECK_CUDA(cudaGetLastError(), "fill q");
  CHECK_CUDA(cudaStreamSynchronize(st), "setup");
  // Step i's rows (it takes page-table set i % sets).
  auto batch_of = [&](int i) {
    di::RowBatch b;
    b.num_rows = kRows;
    b.row_request = d_rr;
    b.row_length = d_rl;
    b.page_table = tables[i % sets];
    b.page_table_stride = ctx_pages;
    b.num_requests = kRows;
    b.max_row_length = kCtx;
    return b;
  };
  const di::QView q{d_q, d_qs, d_w, kHeads32};
  auto logits_step = [&](int i, dc::SparseLogitsMath math) {
    CHECK_OK(dc::LaunchSparseLogits({pool, pages, geo}, batch_of(i), q, d_pos, d_cnt, kMaxPos,
                                    d_logits, st, math),
             "sparse logits");
  };
  // A comparison variant of the tensor-core kernel (bench/cuda/variants/) on the same inputs.
  auto variant_step = [&](int i, dc::SparseVariant v) {
    CHECK_OK(dc::LaunchSparseLogitsVariant(v, {pool, pages, geo}, batch_of(i), q, d_pos, d_cnt,
                                           kMaxPos, d_logits, st),
             "sparse logits (variant)");
  };
  auto topk_step = [&](dc::TopKArgs::Algo algo = dc::TopKArgs::Algo::kAuto) {
    dc::TopKArgs t;
    t.algo = algo;
    t.num_rows = kRows;
    t.values = d_logits;
    t.stride = kMaxPos;
    t.lengths = d_cnt;
    t.k = kK;
    t.out = d_out;
    t.index_map = d_pos;
    t.index_map_stride = kMaxPos;
    t.max_length = kMaxPos;
    CHECK_OK(dc::LaunchRadixTopK(t, sms, st), "topk");
  };
  // Each step gets the next index (so it takes the next page-table set).
  auto time_steps = [&](auto&& step, int batches, int per_batch) {
    int i = 0;
    return TimeBatches(st, e0, e1, batches, per_batch, [&] { step(i++); });
  };
  const float t_warp =
      time_steps([&](int i) { logits_step(i, dc::SparseLogitsMath::kWarpPerPosition); }, 3, 2);
  const float t_grid =
      time_steps([&](int i) { logits_step(i, dc::SparseLogitsMath::kGrid); }, 7, 10);
  const float t_mma = time_steps([&](int i) { logits_step(i, dc::SparseLogitsMath::kMma); }, 7, 10);
  const float t_grid2 =
      time_steps([&](int i) { logits_step(i, dc::SparseLogitsMath::kGrid); }, 7, 10);
  const float t_mma2 =
      time_steps([&](int i) { logits_step(i, dc::SparseLogitsMath::kMma); }, 7, 10);
  const float t_topk = time_steps([&](int) { topk_step(); }, 7, 10);
  // The top-k column split by kernel: the radix kernels (kGeneral) and the cooperative top-k.
  const float t_topk_general =
      time_steps([&](int) { topk_step(dc::TopKArgs::Algo::kGeneral); }, 7, 10);
  const float t_topk_coop =
      time_steps([&](int) { topk_step(dc::TopKArgs::Algo::kCooperative); }, 7, 10);
  const float t_step_grid = time_steps(
      [&](int i) {
        logits_step(i, dc::SparseLogitsMath::kGrid);
        topk_step();
      },
      7, 10);
  const float t_step = time_steps(
      [&](int i) {
        logits_step(i, dc::SparseLogitsMath::kMma);
        topk_step();
      },
      7, 10);
  CHECK_CUDA(cudaStreamSynchronize(st), "sync");
  CHECK_CUDA(cudaGetLastError(), "after timing");
  // The two variants on the same inputs (the tests check them against the CPU): the largest
  // difference relative to the largest |logit| (different fp32 sums, so a few ulps).
  std::vector<float> lg(pos.size()), lm(pos.size());
  logits_step(0, dc::SparseLogitsMath::kGrid);
  CHECK_CUDA(cudaMemcpyAsync(lg.data(), d_logits, 4 * lg.size(), cudaMemcpyDeviceToHost, st), "dl");
  logits_step(0, dc::SparseLogitsMath::kMma);
  CHECK_CUDA(cudaMemcpyAsync(lm.data(), d_logits, 4 * lm.size(), cudaMemcpyDeviceToHost, st), "dl");
  CHECK_CUDA(cudaStreamSynchronize(st), "sync");
  double max_abs = 0.0, max_diff = 0.0;
  for (size_t i = 0; i < lg.size(); ++i) {
    max_abs = std::max(max_abs, static_cast<double>(std::fabs(lg[i])));
    const double d = std::fabs(static_cast<double>(lg[i]) - lm[i]);
    max_diff = std::isnan(d) ? INFINITY : std::max(max_diff, d);
  }
  // kMma's unfolded group scaling: one head per row with group scales 2^24 apart (past what
  // the kernel folds into q), so every row scales each group sum by q_scale * k_scale.
  std::vector<uint8_t> qs_host(int64_t{kRows} * kHeads32 * 4, 87);
  for (int r = 0; r < kRows; ++r) qs_host[int64_t{r} * kHeads32 * 4 + 3] = 87 + 24;
  CHECK_CUDA(cudaMemcpy(d_qs, qs_host.data(), qs_host.size(), cudaMemcpyHostToDevice), "qs");
  const float t_mma_unfolded =
      time_steps([&](int i) { logits_step(i, dc::SparseLogitsMath::kMma); }, 7, 10);
  CHECK_CUDA(cudaMemset(d_qs, 87, kRows * kHeads32 * 4), "q scales");
  // The folded variants on the pool as filled (FP8 bytes read as FP4 scales: a key's 4 group
  // scales are random bytes, nearly never within 2^23, so nearly every key takes the
  // group-scaled path inside the folded kernels: their worst case).
  const float t_fold_rand =
      time_steps([&](int i) { variant_step(i, dc::SparseVariant::kMmaFolded); }, 7, 10);
  const float t_pair_rand =
      time_steps([&](int i) { variant_step(i, dc::SparseVariant::kMmaFoldedPair); }, 7, 10);
  // Key scales as quantized vectors have them (groups within 3 binades): every key folds.
  FillFp4KeyScales<<<4 * sms, 256, 0, st>>>(pool, pages, geo.page_bytes(), kPage, geo.value_bytes(),
                                            rng());
  CHECK_CUDA(cudaGetLastError(), "fill fp4 scales");
  CHECK_CUDA(cudaStreamSynchronize(st), "fill fp4 scales");
  // The kinds below: the production kMma (0) and kMmaPairLeanOcc (7), the variants between.
  constexpr int kKinds = 8;
  const dc::SparseVariant variants[kKinds - 2] = {
      dc::SparseVariant::kMmaFolded,       dc::SparseVariant::kMmaFoldedPair,
      dc::SparseVariant::kMmaPair,         dc::SparseVariant::kMmaQShared,
      dc::SparseVariant::kMmaPairLeanCopy, dc::SparseVariant::kMmaPairLean};
  auto kind_step = [&](int i, int kind) {
    if (kind == 0) {
      logits_step(i, dc::SparseLogitsMath::kMma);
    } else if (kind == kKinds - 1) {
      logits_step(i, dc::SparseLogitsMath::kMmaPairLeanOcc);
    } else {
      variant_step(i, variants[kind - 1]);
    }
  };
  auto run_logits = [&](int kind) {
    std::vector<float> h(pos.size());
    kind_step(0, kind);
    CHECK_CUDA(cudaMemcpyAsync(h.data(), d_logits, 4 * h.size(), cudaMemcpyDeviceToHost, st), "dl");
    CHECK_CUDA(cudaStreamSynchronize(st), "sync");
    return h;
  };
  const std::vector<float> ref = run_logits(0);
  auto rel_diff = [&](int kind) {
    const std::vector<float> v = run_logits(kind);
    double m = 0.0, d = 0.0;
    for (size_t i = 0; i < v.size(); ++i) {
      m = std::max(m, static_cast<double>(std::fabs(ref[i])));
      const double e = std::fabs(static_cast<double>(v[i]) - ref[i]);
      d = std::isnan(e) ? INFINITY : std::max(d, e);
    }
    return d / m;
  };
  // The tensor-core kinds (docs/notes/cuda.md), timed in two interleaved rounds.
  const char* const kind_names[kKinds] = {"mma",           "mma-folded",       "mma-folded-pair",
                                          "mma-pair",      "mma-q-shared",     "mma-pair-lean-copy",
                                          "mma-pair-lean", "mma-pair-lean-occ"};
  double kind_diff[kKinds];  // max |variant - kMma| / max |logit|
  for (int v = 0; v < kKinds; ++v) kind_diff[v] = rel_diff(v);
  float t_q[kKinds][2];
  for (int round = 0; round < 2; ++round) {
    for (int v = 0; v < kKinds; ++v) {
      t_q[v][round] = time_steps([&](int i) { kind_step(i, v); }, 7, 10);
    }
  }
  float t_qstep[kKinds];
  for (int v = 0; v < kKinds; ++v) {
    t_qstep[v] = time_steps(
        [&](int i) {
          kind_step(i, v);
          topk_step();
        },
        7, 10);
  }
  const double key_bytes = double{kRows} * kMaxPos * geo.entry_bytes();
  // Keys read once (counting read bytes only against a read+write copy rate).
  const double floor_us = key_bytes / (copy_gbs * 1e9) * 1e6;
  std::printf(
      "consumer %d rows x %d positions, FP4, %d heads, K %d: logits warp-per-position %.1f us, "
      "grid %.1f / %.1f us, mma %.1f / %.1f us (%.0f GB/s of keys); byte floor %.1f us "
      "(%.1f MB at %.0f GB/s), mma / floor %.2fx, grid / floor %.1fx; top-k %.1f us; step "
      "(mma + top-k) %.1f us, (grid + top-k) %.1f us; max |mma-grid| / max |logit| %.3g; "
      "mma unfolded q scales %.1f us; %d sets\n",
      kRows, kMaxPos, kHeads32, kK, t_warp, t_grid, t_grid2, t_mma, t_mma2,
      key_bytes / (t_mma * 1e-6) / 1e9, floor_us, key_bytes / 1e6, copy_gbs, t_mma / floor_us,
      t_grid / floor_us, t_topk, t_step, t_step_grid, max_diff / max_abs, t_mma_unfolded, sets);
  std::printf("consumer top-k: auto %.1f us, general (radix) %.1f us, cooperative %.1f us\n",
              t_topk, t_topk_general, t_topk_coop);
  std::printf(
      "consumer, random key scales (folded variants' fallback path nearly everywhere): "
      "mma-folded %.1f us, mma-folded-pair %.1f us\n",
      t_fold_rand, t_pair_rand);
  std::printf(
      "consumer, quantized-like key scales (every key folds), logits us in two rounds, / floor, "
      "step with top-k us, max |variant-mma| / max |logit|:\n");
  for (int v = 0; v < kKinds; ++v) {
    std::printf("  %-20s %6.1f / %6.1f us (%.2fx)  step %6.1f us  diff %.3g\n", kind_names[v],
                t_q[v][0], t_q[v][1], t_q[v][0] / floor_us, t_qstep[v], kind_diff[v]);
  }
  std::fprintf(out,
               "{\"consumer\": true, \"rows\": %d, \"positions\": %d, \"heads\": %d, "
               "\"k\": %d, \"logits_warp_us\": %.2f, \"logits_grid_us\": %.2f, "
               "\"logits_mma_us\": %.2f, \"floor_us\": %.2f, \"topk_us\": %.2f, "
               "\"step_us\": %.2f, \"step_grid_us\": %.2f, \"key_bytes\": %.0f, "
               "\"mma_grid_rel_diff\": %.3g, \"logits_mma_unfolded_us\": %.2f, \"sets\": %d, "
               "\"folded_random_scales_us\": %.2f, \"folded_pair_random_scales_us\": %.2f, "
               "\"mma_quant_scales_us\": %.2f, \"folded_us\": %.2f, \"folded_pair_us\": %.2f, "
               "\"step_mma_quant_scales_us\": %.2f, \"step_folded_us\": %.2f, "
               "\"step_folded_pair_us\": %.2f, \"folded_rel_diff\": %.3g, "
               "\"folded_pair_rel_diff\": %.3g, \"mma_pair_us\": %.2f, \"mma_q_shared_us\": %.2f, "
               "\"step_mma_pair_us\": %.2f, \"step_mma_q_shared_us\": %.2f, "
               "\"mma_pair_lean_copy_us\": %.2f, \"step_mma_pair_lean_copy_us\": %.2f, "
               "\"topk_general_us\": %.2f, \"topk_coop_us\": %.2f}\n",
               kRows, kMaxPos, kHeads32, kK, t_warp, t_grid, t_mma, floor_us, t_topk, t_step,
               t_step_grid, key_bytes, max_diff / max_abs, t_mma_unfolded, sets, t_fold_rand,
               t_pair_rand, t_q[0][0], t_q[1][0], t_q[2][0], t_qstep[0], t_qstep[1], t_qstep[2],
               kind_diff[1], kind_diff[2], t_q[3][0], t_q[4][0], t_qstep[3], t_qstep[4], t_q[5][0],
               t_qstep[5], t_topk_general, t_topk_coop);
  for (int32_t* t : tables) CHECK_CUDA(cudaFree(t), "free");
  for (void* p :
       {static_cast<void*>(d_rr), static_cast<void*>(d_rl), static_cast<void*>(d_pos),
        static_cast<void*>(d_cnt), static_cast<void*>(d_out), static_cast<void*>(d_logits),
        static_cast<void*>(d_q), static_cast<void*>(d_qs), static_cast<void*>(d_w)}) {
    CHECK_CUDA(cudaFree(p), "free");
  }
  return 0;
}

// Random logits (a hash of the index, spread over [-4, 4) with a few exact repeats), so the
// candidate-selection timings see distinct block scores as the logits kernel's would give.
__global__ void FillLogits(float* logits, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint64_t h = (i + seed) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 31;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 29;
    logits[i] = static_cast<float>(static_cast<int32_t>(h & 0xFFFFFu) - 0x80000) / 131072.0f;
  }
}

// Rows of 0.7-1.3x `avg` random lengths (to lengths_d) of hash-random logits (row stride: the
// longest rounded up to 4); returns the longest, or -1 where the buffer is too small.
int32_t RandomRows(int rows, int avg, std::mt19937_64& rng, float* logits, int64_t logits_stride,
                   int32_t* lengths_d, int sms, cudaStream_t st, const char* what) {
  std::uniform_real_distribution<double> u(0.7, 1.3);
  std::vector<int32_t> lengths(rows);
  for (auto& l : lengths) l = std::max(1, static_cast<int32_t>(avg * u(rng)));
  const int32_t max_len = *std::max_element(lengths.begin(), lengths.end());
  const int64_t stride = (max_len + 3) / 4 * 4;
  if (stride > logits_stride) {
    std::fprintf(stderr, "%s: logits buffer too small\n", what);
    return -1;
  }
  CHECK_CUDA(cudaMemcpyAsync(lengths_d, lengths.data(), 4 * rows, cudaMemcpyHostToDevice, st),
             "copy lengths");
  FillLogits<<<4 * sms, 256, 0, st>>>(logits, int64_t{rows} * stride, rng());
  CHECK_CUDA(cudaGetLastError(), "fill logits");
  return max_len;
}

// --candidates: candidate-block selection at a source layer (spec section 7: blocks of 8, keep
// 2048) on the same logits, the general path (LaunchCandidateScores + LaunchRadixTopK, as
// DenseTopK runs it) against the cooperative single launch, at 1 / 8 / 64 rows x 32K / 64K /
// 128K average context (lengths 0.7-1.3x). The logits stay in place between steps (as in a
// step, where the logits kernel has just written them, they are partly in L2). Checks that
// both answers agree entry for entry.
int RunCandidates(float* logits, int64_t logits_stride, int sms, cudaStream_t st, cudaEvent_t e0,
                  cudaEvent_t e1, std::mt19937_64& rng, FILE* out, int batches, int per_batch) {
  constexpr int kBlock = 8, kKc = 2048, kMaxRows = 64;
  int32_t *lengths_d, *cand_general, *cand_coop;
  float* scores;
  const int64_t sstride_cap = (logits_stride / kBlock + 4) / 4 * 4;
  CHECK_CUDA(cudaMalloc(&lengths_d, 4 * kMaxRows), "lengths");
  CHECK_CUDA(cudaMalloc(&cand_general, 4 * int64_t{kMaxRows} * kKc), "candidates");
  CHECK_CUDA(cudaMalloc(&cand_coop, 4 * int64_t{kMaxRows} * kKc), "candidates");
  CHECK_CUDA(cudaMalloc(&scores, 4 * int64_t{kMaxRows} * sstride_cap), "scores");
  std::printf("%5s %7s | %10s %10s %7s | %10s\n", "rows", "avg", "general_us", "coop_us", "ratio",
              "mismatch");
  for (int rows : {1, 8, 64}) {
    for (int avg : {32768, 65536, 131072}) {
      const int32_t max_len =
          RandomRows(rows, avg, rng, logits, logits_stride, lengths_d, sms, st, "candidates");
      if (max_len < 0) return 1;
      const int64_t stride = (max_len + 3) / 4 * 4;
      const int32_t max_blocks = (max_len + kBlock - 1) / kBlock;
      const int64_t sstride = (max_blocks + 3) / 4 * 4;
      auto general = [&]() {
        CHECK_OK(dc::LaunchCandidateScores(rows, logits, stride, lengths_d, kBlock, scores, sstride,
                                           static_cast<int32_t>(sstride), st),
                 "candidate scores");
        dc::TopKArgs t;
        t.num_rows = rows;
        t.values = scores;
        t.stride = sstride;
        t.lengths = lengths_d;
        t.length_divisor = kBlock;
        t.k = kKc;
        t.out = cand_general;
        t.max_length = static_cast<int32_t>(sstride);
        CHECK_OK(dc::LaunchRadixTopK(t, sms, st), "candidate top-k");
      };
      auto cooperative = [&]() {
        dc::CooperativeCandidatesArgs a;
        a.num_rows = rows;
        a.logits = logits;
        a.logits_stride = stride;
        a.row_length = lengths_d;
        a.block_size = kBlock;
        a.max_blocks_per_row = max_blocks;
        a.k = kKc;
        a.out = cand_coop;
        CHECK_OK(dc::LaunchCooperativeCandidates(a, st), "cooperative candidates");
      };
      auto time_batches = [&](auto&& step) {
        return TimeBatches(st, e0, e1, batches, per_batch, step);
      };
      const float t_general = time_batches(general);
      const float t_coop = time_batches(cooperative);
      // Again in the other order: the figures are the better of the two (clock ramp).
      const float t_general2 = time_batches(general);
      const float t_coop2 = time_batches(cooperative);
      const float tg = std::min(t_general, t_general2), tc = std::min(t_coop, t_coop2);
      const int64_t n = int64_t{rows} * kKc;
      std::vector<int32_t> a(n), b(n);
      CHECK_CUDA(cudaMemcpyAsync(a.data(), cand_general, 4 * n, cudaMemcpyDeviceToHost, st), "d2h");
      CHECK_CUDA(cudaMemcpyAsync(b.data(), cand_coop, 4 * n, cudaMemcpyDeviceToHost, st), "d2h");
      CHECK_CUDA(cudaStreamSynchronize(st), "sync");
      int64_t mismatch = 0;
      for (int64_t e = 0; e < n; ++e) mismatch += a[e] != b[e];
      std::printf("%5d %7d | %10.2f %10.2f %7.2f | %10lld\n", rows, avg, tg, tc, tg / tc,
                  static_cast<long long>(mismatch));
      std::fprintf(out,
                   "{\"candidates\": true, \"rows\": %d, \"avg\": %d, \"block\": %d, \"k\": %d, "
                   "\"general_us\": %.2f, \"cooperative_us\": %.2f, \"mismatches\": %lld}\n",
                   rows, avg, kBlock, kKc, tg, tc, static_cast<long long>(mismatch));
      std::fflush(out);
      if (mismatch != 0) return 1;
    }
  }
  for (void* p : {static_cast<void*>(lengths_d), static_cast<void*>(cand_general),
                  static_cast<void*>(cand_coop), static_cast<void*>(scores)}) {
    CHECK_CUDA(cudaFree(p), "free");
  }
  return 0;
}

// --coop-topk: the cooperative top-k (TopKArgs::Algo::kCooperative) against the general
// kernels on the same values. Dense: K 2048 at 1 / 8 / 64 rows x 16K / 32K / 64K / 128K
// average length (0.7-1.3x), hash-random values: kGeneral (kAuto's choice before), kCompact,
// kMultiPass, kCooperative at its default cluster and at twice that (more blocks than SMs for
// 33+ rows; "-" where a cluster's shared memory cannot hold the row). Consumer: the v41
// consumer's index-mapped top-k, 64 rows x 16K candidate logits, K 512, through a map of
// increasing positions. Each variant timed twice (interleaved), the lower median kept; every
// answer compared with kGeneral's entry for entry.
int RunCoopTopK(float* logits, int64_t logits_stride, int sms, cudaStream_t st, cudaEvent_t e0,
                cudaEvent_t e1, std::mt19937_64& rng, FILE* out, int batches, int per_batch) {
  constexpr int kMaxRows = 64;
  using Algo = dc::TopKArgs::Algo;
  int32_t *lengths_d, *map_d, *ans, *ref;
  CHECK_CUDA(cudaMalloc(&lengths_d, 4 * kMaxRows), "lengths");
  CHECK_CUDA(cudaMalloc(&ans, 4 * int64_t{kMaxRows} * kTopK), "answers");
  CHECK_CUDA(cudaMalloc(&ref, 4 * int64_t{kMaxRows} * kTopK), "reference");
  constexpr int kConsumerPos = 2048 * 8, kConsumerK = 512;
  CHECK_CUDA(cudaMalloc(&map_d, 4 * int64_t{kMaxRows} * kConsumerPos), "map");
  auto time_batches = [&](auto&& step) {
    return TimeBatches(st, e0, e1, batches, per_batch, step);
  };
  int64_t total_mismatch = 0;
  // One shape: each variant's time (-1: refused), its mismatches against kGeneral.
  auto measure = [&](const dc::TopKArgs& base, int rows, int k, float* t, int64_t* mismatch) {
    struct Variant {
      Algo algo;
      int cluster;
    };
    const int coop_c = rows <= 16 ? 8 : rows <= 32 ? 4 : 2;
    const Variant variants[5] = {{Algo::kGeneral, 0},
                                 {Algo::kCompact, 0},
                                 {Algo::kMultiPass, 0},
                                 {Algo::kCooperative, 0},
                                 {Algo::kCooperative, coop_c < 8 ? 2 * coop_c : 8}};
    auto launch = [&](const Variant& v, int32_t* dst) {
      dc::TopKArgs a = base;
      a.algo = v.algo;
      a.cluster_size = v.cluster;
      a.out = dst;
      return dc::LaunchRadixTopK(a, sms, st);
    };
    CHECK_OK(launch(variants[0], ref), "general top-k");
    float best[5];
    for (int round = 0; round < 2; ++round) {
      for (int v = 0; v < 5; ++v) {
        if (!launch(variants[v], ans).ok()) {
          best[v] = -1.f;
          continue;
        }
        const float tv = time_batches([&] { CHECK_OK(launch(variants[v], ans), "top-k"); });
        best[v] = round == 0 ? tv : std::min(best[v], tv);
      }
    }
    const int64_t n = int64_t{rows} * k;
    std::vector<int32_t> a(n), b(n);
    CHECK_CUDA(cudaMemcpyAsync(a.data(), ref, 4 * n, cudaMemcpyDeviceToHost, st), "d2h");
    for (int v = 0; v < 5; ++v) {
      t[v] = best[v];
      mismatch[v] = 0;
      if (best[v] < 0) continue;
      CHECK_OK(launch(variants[v], ans), "top-k");
      CHECK_CUDA(cudaMemcpyAsync(b.data(), ans, 4 * n, cudaMemcpyDeviceToHost, st), "d2h");
      CHECK_CUDA(cudaStreamSynchronize(st), "sync");
      for (int64_t e = 0; e < n; ++e) mismatch[v] += a[e] != b[e];
      total_mismatch += mismatch[v];
    }
  };
  auto fmt = [](float t) {
    static char buf[5][16];
    static int slot = 0;
    char* b = buf[slot++ % 5];
    if (t < 0) {
      std::snprintf(b, 16, "%s", "-");
    } else {
      std::snprintf(b, 16, "%.2f", t);
    }
    return b;
  };
  std::printf("%5s %7s %5s | %10s %10s %10s %10s %10s | %8s %8s\n", "rows", "avg", "k",
              "general_us", "compact", "multipass", "coop", "coop_2x", "gen/coop", "mismatch");
  auto report = [&](const char* what, int rows, int avg, int k, const float* t, const int64_t* mm) {
    int64_t m = 0;
    for (int v = 0; v < 5; ++v) m += mm[v];
    std::printf("%5d %7d %5d | %10s %10s %10s %10s %10s | %8.2f %8lld  %s\n", rows, avg, k,
                fmt(t[0]), fmt(t[1]), fmt(t[2]), fmt(t[3]), fmt(t[4]), t[3] > 0 ? t[0] / t[3] : 0.0,
                static_cast<long long>(m), what);
    std::fprintf(out,
                 "{\"coop_topk\": \"%s\", \"rows\": %d, \"avg\": %d, \"k\": %d, "
                 "\"general_us\": %.2f, \"compact_us\": %.2f, \"multipass_us\": %.2f, "
                 "\"coop_us\": %.2f, \"coop_2x_us\": %.2f, \"mismatches\": %lld}\n",
                 what, rows, avg, k, t[0], t[1], t[2], t[3], t[4], static_cast<long long>(m));
    std::fflush(out);
  };
  // One shape: rows of `stride` values (lengths in lengths_d, at most max_len), mapped or not.
  auto run_shape = [&](const char* what, int rows, int avg, int k, int64_t stride, int32_t max_len,
                       const int32_t* map) {
    dc::TopKArgs t;
    t.num_rows = rows;
    t.values = logits;
    t.stride = stride;
    t.lengths = lengths_d;
    t.k = k;
    t.index_map = map;
    t.index_map_stride = stride;
    t.max_length = max_len;
    float tv[5];
    int64_t mm[5];
    measure(t, rows, k, tv, mm);
    report(what, rows, avg, k, tv, mm);
  };
  for (int rows : {1, 8, 64}) {
    for (int avg : {16384, 32768, 65536, 131072}) {
      const int32_t max_len =
          RandomRows(rows, avg, rng, logits, logits_stride, lengths_d, sms, st, "coop-topk");
      if (max_len < 0) return 1;
      run_shape("dense", rows, avg, kTopK, (max_len + 3) / 4 * 4, max_len, nullptr);
    }
  }
  {  // The consumer: 64 rows x 16K candidate logits, mapped to increasing positions.
    std::vector<int32_t> map(int64_t{kMaxRows} * kConsumerPos), cnt(kMaxRows, kConsumerPos);
    for (int r = 0; r < kMaxRows; ++r) {
      int32_t at = 0;
      for (int i = 0; i < kConsumerPos; ++i) {
        at += 1 + static_cast<int32_t>(rng() % 4);
        map[int64_t{r} * kConsumerPos + i] = at;
      }
    }
    CHECK_CUDA(cudaMemcpyAsync(map_d, map.data(), 4 * map.size(), cudaMemcpyHostToDevice, st),
               "copy map");
    CHECK_CUDA(cudaMemcpyAsync(lengths_d, cnt.data(), 4 * kMaxRows, cudaMemcpyHostToDevice, st),
               "copy counts");
    FillLogits<<<4 * sms, 256, 0, st>>>(logits, int64_t{kMaxRows} * kConsumerPos, rng());
    CHECK_CUDA(cudaGetLastError(), "fill logits");
    CHECK_CUDA(cudaStreamSynchronize(st), "sync");
    run_shape("consumer", kMaxRows, kConsumerPos, kConsumerK, kConsumerPos, kConsumerPos, map_d);
  }
  for (void* p : {static_cast<void*>(lengths_d), static_cast<void*>(map_d), static_cast<void*>(ans),
                  static_cast<void*>(ref)}) {
    CHECK_CUDA(cudaFree(p), "free");
  }
  return total_mismatch == 0 ? 0 : 1;
}

// One configuration's drawn step: each request's length (avg x U(0.7, 1.3), at least next_n),
// its rows (request b's row j scores lengths[b] - next_n + j + 1 keys), the longest length,
// the page-table stride and the pages the step reads.
struct StepDraw {
  std::vector<int32_t> lengths, row_request, row_length;
  int32_t max_len = 0, stride = 0;
  int64_t pages = 0;
};
StepDraw DrawStep(int requests, int next_n, int avg, std::mt19937_64& rng) {
  StepDraw d;
  std::uniform_real_distribution<double> u(0.7, 1.3);
  d.lengths.resize(requests);
  for (auto& l : d.lengths) l = std::max(next_n, static_cast<int32_t>(avg * u(rng)));
  d.max_len = *std::max_element(d.lengths.begin(), d.lengths.end());
  d.stride = (d.max_len + kPage - 1) / kPage;
  for (int32_t l : d.lengths) d.pages += (l + kPage - 1) / kPage;
  for (int b = 0; b < requests; ++b) {
    for (int j = 0; j < next_n; ++j) {
      d.row_request.push_back(b);
      d.row_length.push_back(d.lengths[b] - next_n + j + 1);
    }
  }
  return d;
}

// A page table for the drawn step: each request's pages taken in order from `perm` at `next`.
std::vector<int32_t> PageTableOf(const StepDraw& d, const std::vector<int32_t>& perm,
                                 int64_t& next) {
  std::vector<int32_t> pt(d.lengths.size() * size_t(d.stride), 0);
  for (size_t b = 0; b < d.lengths.size(); ++b) {
    for (int j = 0; j < (d.lengths[b] + kPage - 1) / kPage; ++j)
      pt[b * d.stride + j] = perm[next++];
  }
  return pt;
}

// The step's rows as the kernels see them (rows_per_request = next_n, as the server sets it:
// decode_schedule.cc).
di::RowBatch StepRows(const StepDraw& d, int next_n, int32_t* row_request, int32_t* row_length,
                      int32_t* page_table) {
  di::RowBatch b;
  b.num_rows = static_cast<int32_t>(d.row_length.size());
  b.row_request = row_request;
  b.row_length = row_length;
  b.page_table = page_table;
  b.page_table_stride = d.stride;
  b.num_requests = static_cast<int32_t>(d.lengths.size());
  b.max_row_length = d.max_len;
  b.rows_per_request = next_n;
  return b;
}

// A shuffled list of a pool's pages.
std::vector<int32_t> ShuffledPages(int64_t pages, std::mt19937_64& rng) {
  std::vector<int32_t> perm(pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  return perm;
}

// Random e2m1 codes (any byte is two valid codes) over a whole FP4 pool, then realistic group
// scales (FillFp4KeyScales) over its scale bytes.
__global__ void FillFp4Codes(uint8_t* pool, int64_t bytes, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < bytes / 8;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint64_t h = (i + seed) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 31;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 29;
    reinterpret_cast<uint64_t*>(pool)[i] = h;
  }
}

// FP4 q of `rows` x 32 heads: random codes, each head's 4 group scales within 3 binades of its
// largest (2^-4 .. 2^3), as quantizing one vector gives them, and weights.
__global__ void FillFp4Q(uint8_t* codes, uint8_t* scales, float* w, int rows, uint64_t seed) {
  const int64_t n = int64_t{rows} * 32;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint64_t h = (i + seed) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 31;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 29;
    for (int k = 0; k < 64; k += 8) {
      uint64_t x = (h + k) * 0xD6E8FEB86659FD93ull;
      x ^= x >> 32;
      *reinterpret_cast<uint64_t*>(codes + i * 64 + k) = x * 0x9E3779B97F4A7C15ull;
    }
    const uint32_t top = 123 + static_cast<uint32_t>(h % 8);
    for (int g = 0; g < 4; ++g) {
      scales[i * 4 + g] =
          static_cast<uint8_t>(g == static_cast<int>((h >> 8) % 4)
                                   ? top
                                   : top - static_cast<uint32_t>((h >> (16 + 2 * g)) % 4));
    }
    w[i] = (static_cast<int>((h >> 40) & 1023) - 512) / 4096.0f;
  }
}

// --fp4: the v41 dense / source layers' logits (MXFP4 cache, 32 heads, top 512) on the FP4
// kernel (the default) and on the sparse tensor-core kernel it replaced (kSparseMmaDense), eager
// and as graph replay, with % of copy for their 68-byte entries; beside them, in the same run and
// at the same drawn lengths, the v32 logits (fp8 kernel, 132-byte entries) and both steps
// (logits + top-k as DenseTopK runs it: top 512 / top 2048), for issue 17's "FP4 step <= 0.6x the
// v32 step". The FP4 kernel's logits are checked against the sparse kernel's bit for bit on the
// first set of each shape.
// Main's step buffers, shared by the modes that time whole steps (RunFp4Dense): logits, top-k,
// row tables of up to 256 rows and a schedule of up to 128 requests.
struct StepBuffers {
  float* logits;
  int32_t* topk;
  int32_t* row_request;
  int32_t* row_length;
  dc::MqaSchedule sched;
};

int RunFp4Dense(uint8_t* pool8, int64_t pool8_pages, const StepBuffers& buf, int sms,
                cudaStream_t st, cudaEvent_t e0, cudaEvent_t e1, std::mt19937_64& rng, FILE* out,
                double copy_gbs, int batches, int per_batch, int only_requests, int only_next_n,
                int only_avg) {
  constexpr int kHeads4 = 32, kTopK4 = 512;
  const di::CacheGeometry geo4{di::CacheFormat::kFp4, 128, kPage};
  const int64_t page4 = geo4.page_bytes();
  const int64_t pool4_pages = (int64_t{3} << 30) / 2 / page4;
  uint8_t* pool4;
  CHECK_CUDA(cudaMalloc(&pool4, pool4_pages * page4), "fp4 pool");
  FillFp4Codes<<<4 * sms, 256, 0, st>>>(pool4, pool4_pages * page4, 777);
  FillFp4KeyScales<<<4 * sms, 256, 0, st>>>(pool4, pool4_pages, page4, kPage, 64, 778);
  CHECK_CUDA(cudaGetLastError(), "fill fp4 pool");
  const int max_rows = 256;
  const int64_t max_ctx = 131072 * 13 / 10 + 64;
  const int64_t lstride_max = (max_ctx + 3) / 4 * 4;
  float* logits_ref;  // the sparse kernel's logits, beside main's
  CHECK_CUDA(cudaMalloc(&logits_ref, sizeof(float) * max_rows * lstride_max), "logits ref");
  float* const logits = buf.logits;
  int32_t* const topk = buf.topk;
  int32_t* const row_request = buf.row_request;
  int32_t* const row_length = buf.row_length;
  const dc::MqaSchedule& sched = buf.sched;
  std::printf(
      "fp4 dense (v41: 32 heads, 68 B entries) beside v32 (64 heads, 132 B), us, graph "
      "(eager)\n%5s %3s %7s | %15s %15s %7s | %15s | %13s %13s %6s\n",
      "req", "n", "avg", "fp4 kernel", "sparse kernel", "%copy", "v32 fp8 logits", "fp4 step",
      "v32 step", "ratio");
  struct Shape {
    int requests, next_n, avg;
  };
  std::vector<Shape> shapes;
  for (int requests : {1, 8, 64, 128}) {
    for (int next_n : {1, 2}) {
      for (int avg : {8192, 32768, 65536, 131072}) shapes.push_back({requests, next_n, avg});
    }
  }
  shapes.push_back({64, 3, 32768});
  shapes.push_back({64, 4, 32768});
  int64_t differ_total = 0;
  for (const Shape& sh : shapes) {
    if (only_requests != 0 &&
        (sh.requests != only_requests || sh.next_n != only_next_n || sh.avg != only_avg)) {
      continue;
    }
    const int requests = sh.requests, next_n = sh.next_n, rows = requests * next_n;
    const StepDraw d = DrawStep(requests, next_n, sh.avg, rng);
    const int32_t max_len = d.max_len;
    const int64_t step_pages = d.pages;
    const double bytes4 = static_cast<double>(step_pages) * page4;
    const double bytes8 = static_cast<double>(step_pages) * kPageBytes;
    const int sets = static_cast<int>(
        std::max<int64_t>(1, std::min<int64_t>({32, pool4_pages / std::max<int64_t>(1, step_pages),
                                                pool8_pages / std::max<int64_t>(1, step_pages),
                                                (int64_t{400} << 20) / int64_t(bytes4) + 1})));
    const std::vector<int32_t>& rl = d.row_length;
    CHECK_CUDA(
        cudaMemcpyAsync(row_request, d.row_request.data(), 4 * rows, cudaMemcpyHostToDevice, st),
        "rr");
    CHECK_CUDA(cudaMemcpyAsync(row_length, rl.data(), 4 * rows, cudaMemcpyHostToDevice, st), "rl");
    struct Set {
      int32_t *pt4, *pt8;
      uint8_t *q4, *qs4, *q8;
      float *w4, *w8;
    };
    std::vector<Set> in(sets);
    const std::vector<int32_t> perm4 = ShuffledPages(pool4_pages, rng),
                               perm8 = ShuffledPages(pool8_pages, rng);
    int64_t next4 = 0, next8 = 0;
    for (Set& s : in) {
      const std::vector<int32_t> pt4 = PageTableOf(d, perm4, next4),
                                 pt8 = PageTableOf(d, perm8, next8);
      for (auto [dst, src] : {std::pair{&s.pt4, &pt4}, std::pair{&s.pt8, &pt8}}) {
        CHECK_CUDA(cudaMalloc(dst, 4 * src->size()), "page table");
        CHECK_CUDA(cudaMemcpyAsync(*dst, src->data(), 4 * src->size(), cudaMemcpyHostToDevice, st),
                   "page table");
      }
      CHECK_CUDA(cudaMalloc(&s.q4, int64_t{rows} * kHeads4 * 64), "q4");
      CHECK_CUDA(cudaMalloc(&s.qs4, int64_t{rows} * kHeads4 * 4), "qs4");
      CHECK_CUDA(cudaMalloc(&s.w4, int64_t{rows} * kHeads4 * 4), "w4");
      FillFp4Q<<<64, 256, 0, st>>>(s.q4, s.qs4, s.w4, rows, rng());
      const int64_t qn = int64_t{rows} * kHeads * 128;
      CHECK_CUDA(cudaMalloc(&s.q8, qn), "q8");
      CHECK_CUDA(cudaMalloc(&s.w8, 4 * int64_t{rows} * kHeads), "w8");
      FillQ<<<256, 256, 0, st>>>(s.q8, qn, s.w8, int64_t{rows} * kHeads, rng());
      CHECK_CUDA(cudaGetLastError(), "fill q");
    }
    CHECK_CUDA(cudaStreamSynchronize(st), "setup");
    const int64_t lstride = (max_len + 3) / 4 * 4;
    auto rows_of = [&](int32_t* pt) { return StepRows(d, next_n, row_request, row_length, pt); };
    // kind 0: the FP4 kernel, 1: the sparse kernel over the dense rows, 2: v32 fp8, 3 + v: the
    // FP4 kernel's variant kAllFp4Variants[v] (fp4_variants.h).
    auto run_logits = [&](int kind, int i, float* dst) {
      const Set& s = in[i % sets];
      dc::PagedLogitsArgs a;
      if (kind == 2) {
        a.cache = {pool8, pool8_pages, {di::CacheFormat::kFp8, 128, kPage}};
        a.rows = rows_of(s.pt8);
        a.q = {s.q8, nullptr, s.w8, kHeads};
        a.math = dc::DenseMqaMath(di::LogitsPrecision::kDefault);
      } else {
        a.cache = {pool4, pool4_pages, geo4};
        a.rows = rows_of(s.pt4);
        a.q = {s.q4, s.qs4, s.w4, kHeads4};
        a.math = kind == 0 ? dc::DenseMqaMath(di::LogitsPrecision::kDefault)
                           : dc::MqaMath::kSparseMmaDense;
      }
      a.schedule = sched;
      a.logits = dst;
      a.logits_stride = lstride;
      if (dc::PagedLogitsNeedsSchedule(a)) {
        CHECK_OK(dc::LaunchMqaSchedule(a.rows, sched, st), "schedule");
      }
      if (kind >= 3) {
        CHECK_OK(dc::LaunchFp4Variant(dc::kAllFp4Variants[kind - 3], a, sms, st), "variant");
        return;
      }
      CHECK_OK(dc::LaunchPagedMqaLogits(a, sms, st), "logits");
    };
    auto run_topk = [&](int k) {
      dc::TopKArgs t;
      t.num_rows = rows;
      t.values = logits;
      t.stride = lstride;
      t.lengths = row_length;
      t.k = k;
      t.out = topk;
      t.max_length = max_len;
      CHECK_OK(dc::LaunchRadixTopK(t, sms, st), "topk");
    };
    // The FP4 kernel's logits against the sparse kernel's, first set, bit for bit.
    int64_t differ = 0;
    {
      const int64_t n = int64_t{rows} * lstride;
      CHECK_CUDA(cudaMemsetAsync(logits, 0xFF, 4 * n, st), "poison");
      CHECK_CUDA(cudaMemsetAsync(logits_ref, 0xFF, 4 * n, st), "poison");
      run_logits(0, 0, logits);
      run_logits(1, 0, logits_ref);
      std::vector<uint32_t> a(n), b(n);
      CHECK_CUDA(cudaMemcpyAsync(a.data(), logits, 4 * n, cudaMemcpyDeviceToHost, st), "d2h");
      CHECK_CUDA(cudaMemcpyAsync(b.data(), logits_ref, 4 * n, cudaMemcpyDeviceToHost, st), "d2h");
      CHECK_CUDA(cudaStreamSynchronize(st), "sync");
      for (int r = 0; r < rows; ++r) {
        for (int32_t t = 0; t < rl[r]; ++t) {
          differ += a[int64_t{r} * lstride + t] != b[int64_t{r} * lstride + t];
        }
      }
      differ_total += differ;
    }
    auto eager = [&](auto&& step) {
      int i = 0;
      return TimeBatches(st, e0, e1, batches, per_batch, [&] { step(i++); });
    };
    auto graph = [&](auto&& step) {
      int i = 0;
      return TimeGraph(st, e0, e1, batches, per_batch, [&] { step(i++); });
    };
    constexpr int kKinds = 3 + std::size(dc::kAllFp4Variants);
    float t[kKinds][2];  // [kind][graph, eager]
    for (int kind = 0; kind < kKinds; ++kind) {
      t[kind][1] = eager([&](int i) { run_logits(kind, i, logits); });
      t[kind][0] = graph([&](int i) { run_logits(kind, i, logits); });
    }
    const float step4 = eager([&](int i) {
      run_logits(0, i, logits);
      run_topk(kTopK4);
    });
    const float step8 = eager([&](int i) {
      run_logits(2, i, logits);
      run_topk(kTopK);
    });
    CHECK_CUDA(cudaGetLastError(), "after timing");
    auto pct = [&](double bytes, float us) { return 100.0 * bytes / (us * 1e-6) / 1e9 / copy_gbs; };
    std::printf(
        "%5d %3d %6dK | %6.1f (%6.1f) %6.1f (%6.1f) %6.1f%% | %6.1f (%6.1f) | %13.1f "
        "%13.1f %6.2f | differ %lld\n",
        requests, next_n, sh.avg / 1024, t[0][0], t[0][1], t[1][0], t[1][1], pct(bytes4, t[0][0]),
        t[2][0], t[2][1], step4, step8, step4 / step8, static_cast<long long>(differ));
    for (int v = 0; v < kKinds - 3; ++v) {
      std::printf("      variant %s: %.1f (%.1f)\n", dc::Fp4VariantName(dc::kAllFp4Variants[v]),
                  t[3 + v][0], t[3 + v][1]);
    }
    std::fprintf(out,
                 "{\"fp4\": true, \"requests\": %d, \"next_n\": %d, \"avg\": %d, "
                 "\"fp4_graph_us\": %.2f, \"fp4_us\": %.2f, \"sparse_graph_us\": %.2f, "
                 "\"sparse_us\": %.2f, \"v32_fp8_graph_us\": %.2f, \"v32_fp8_us\": %.2f, "
                 "\"fp4_step_us\": %.2f, \"v32_step_us\": %.2f, \"fp4_key_bytes\": %.0f, "
                 "\"v32_key_bytes\": %.0f, \"copy_gbs\": %.1f, \"fp4_pct_copy_graph\": %.1f, "
                 "\"v32_pct_copy_graph\": %.1f, \"differ\": %lld, \"sets\": %d, "
                 "\"variants\": {",
                 requests, next_n, sh.avg, t[0][0], t[0][1], t[1][0], t[1][1], t[2][0], t[2][1],
                 step4, step8, bytes4, bytes8, copy_gbs, pct(bytes4, t[0][0]), pct(bytes8, t[2][0]),
                 static_cast<long long>(differ), sets);
    for (int v = 0; v < kKinds - 3; ++v) {
      std::fprintf(out, "%s\"%s\": [%.2f, %.2f]", v > 0 ? ", " : "",
                   dc::Fp4VariantName(dc::kAllFp4Variants[v]), t[3 + v][0], t[3 + v][1]);
    }
    std::fprintf(out, "}}\n");
    std::fflush(out);
    for (Set& s : in) {
      for (void* p : {static_cast<void*>(s.pt4), static_cast<void*>(s.pt8),
                      static_cast<void*>(s.q4), static_cast<void*>(s.qs4), static_cast<void*>(s.q8),
                      static_cast<void*>(s.w4), static_cast<void*>(s.w8)}) {
        CHECK_CUDA(cudaFree(p), "free");
      }
    }
  }
  std::printf("fp4 kernel vs sparse kernel: %lld logits differ\n",
              static_cast<long long>(differ_total));
  CHECK_CUDA(cudaFree(logits_ref), "free");
  CHECK_CUDA(cudaFree(pool4), "free");
  return differ_total == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string out_path = "cuda_bench.json";
  int batches = 7, per_batch = 10;
  int only_requests = 0, only_next_n = 0, only_avg = 0;  // --only R N AVG: one configuration
  bool subset = false;    // --subset: issue 3's headline shapes only (short device sessions)
  bool consumer = false;  // --consumer: time the v41 consumer layer step instead
  // --candidates: candidate-block selection, general path vs the cooperative single launch.
  bool candidates = false;
  // --topk: the top-k shapes of issue 3 (next_n 1), the top-k variants only (no other logits
  // paths): multi-pass vs compact, cluster sizes, the fused threshold-filter histogram.
  bool topk_only = false;
  bool coop_topk = false;  // --coop-topk: the cooperative top-k vs the general kernels
  bool fp4 = false;        // --fp4: the v41 FP4 dense logits beside v32's (RunFp4Dense)
  // --skip-variants: not the exact kernel's comparison variants (their columns read 0): the
  // production kernels, the fp8 v1 variant and the top-k only (shorter device calls).
  bool skip_variants = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf(
          "decode-indexer-bench-cuda [--out PATH] [--batches N] [--subset] [--consumer] "
          "[--candidates] [--topk] [--coop-topk] [--fp4] [--skip-variants] "
          "[--only REQUESTS NEXT_N AVG_CONTEXT]\n");
      return 0;
    }
    if (a == "--version") {
      std::printf("%s\n", decode_indexer::cli::VersionLine().c_str());
      return 0;
    }
    static const char* const kKnown[] = {
        "--out",  "--batches",   "--subset", "--consumer",      "--candidates",
        "--topk", "--coop-topk", "--only",   "--skip-variants", "--fp4"};
    bool known = false;
    for (const char* k : kKnown) known = known || a == k;
    if (!known) {
      std::fprintf(stderr, "decode-indexer-bench-cuda: unknown flag %s (see --help)\n", a.c_str());
      return 2;
    }
    if (a == "--out" && i + 1 < argc) out_path = argv[++i];
    if (a == "--batches" && i + 1 < argc) batches = std::atoi(argv[++i]);
    if (a == "--subset") subset = true;
    if (a == "--consumer") consumer = true;
    if (a == "--candidates") candidates = true;
    if (a == "--topk") topk_only = true;
    if (a == "--coop-topk") coop_topk = true;
    if (a == "--fp4") fp4 = true;
    if (a == "--skip-variants") skip_variants = true;
    if (a == "--only" && i + 3 < argc) {
      only_requests = std::atoi(argv[++i]);
      only_next_n = std::atoi(argv[++i]);
      only_avg = std::atoi(argv[++i]);
    }
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0), "device properties");
  const int sms = prop.multiProcessorCount;
  cudaStream_t st;
  CHECK_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream");
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0), "event");
  CHECK_CUDA(cudaEventCreate(&e1), "event");

  // The copy ceiling: a 2 GiB device-to-device copy, counting bytes read plus written.
  const size_t copy_bytes = size_t{2} << 30;
  void *ca, *cb;
  CHECK_CUDA(cudaMalloc(&ca, copy_bytes), "copy src");
  CHECK_CUDA(cudaMalloc(&cb, copy_bytes), "copy dst");
  CHECK_CUDA(cudaMemsetAsync(ca, 1, copy_bytes, st), "memset");
  std::vector<float> copy_ms;
  for (int i = 0; i < 12; ++i) {
    CHECK_CUDA(cudaEventRecord(e0, st), "record");
    CHECK_CUDA(cudaMemcpyAsync(cb, ca, copy_bytes, cudaMemcpyDeviceToDevice, st), "copy");
    CHECK_CUDA(cudaEventRecord(e1, st), "record");
    CHECK_CUDA(cudaEventSynchronize(e1), "sync");
    float ms;
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1), "elapsed");
    if (i >= 2) copy_ms.push_back(ms);
  }
  const double copy_gbs = 2.0 * copy_bytes / (Median(copy_ms) * 1e-3) / 1e9;
  CHECK_CUDA(cudaFree(ca), "free");
  CHECK_CUDA(cudaFree(cb), "free");
  std::printf("device %s, %d SMs; D2D copy %.0f GB/s (read + write)\n", prop.name, sms, copy_gbs);

  // One pool for every configuration: at least 2.5 GB so that rotated sets never share pages.
  const int64_t pool_pages = (int64_t{3} << 30) / kPageBytes;
  uint8_t* pool;
  CHECK_CUDA(cudaMalloc(&pool, pool_pages * kPageBytes), "pool");
  FillPages<<<4 * sms, 256, 0, st>>>(pool, pool_pages, 12345);
  CHECK_CUDA(cudaGetLastError(), "fill pages");

  const int max_requests = 128, max_rows = 256;
  const int64_t max_ctx = 131072 * 13 / 10 + 64;
  float* logits;
  CHECK_CUDA(cudaMalloc(&logits, sizeof(float) * max_rows * ((max_ctx + 3) / 4 * 4)), "logits");
  int32_t *topk, *sched_ws, *row_request, *row_length;
  CHECK_CUDA(cudaMalloc(&topk, sizeof(int32_t) * max_rows * kTopK), "topk");
  CHECK_CUDA(cudaMalloc(&sched_ws, sizeof(int32_t) * dc::MqaScheduleInts(max_requests)), "ws");
  CHECK_CUDA(cudaMalloc(&row_request, sizeof(int32_t) * max_rows), "rows");
  CHECK_CUDA(cudaMalloc(&row_length, sizeof(int32_t) * max_rows), "lengths");
  const dc::MqaSchedule sched = dc::CarveMqaSchedule(sched_ws, max_requests);
  // The threshold-filter histograms (zero between steps: each top-k that reads them zeroes).
  uint32_t* row_hist;
  CHECK_CUDA(cudaMalloc(&row_hist, sizeof(uint32_t) * max_rows * dc::kTopKBins), "histogram");
  CHECK_CUDA(cudaMemsetAsync(row_hist, 0, sizeof(uint32_t) * max_rows * dc::kTopKBins, st),
             "zero histogram");
  int32_t* topk_ref;  // another answer, to check the top-k variants agree
  CHECK_CUDA(cudaMalloc(&topk_ref, sizeof(int32_t) * max_rows * kTopK), "topk ref");

  std::mt19937_64 rng(2026);
  FILE* out = std::fopen(out_path.c_str(), "w");
  if (out == nullptr) {
    std::perror(out_path.c_str());
    return 1;
  }
  if (consumer) {
    const int rc = RunConsumer(pool, pool_pages * kPageBytes, sms, st, e0, e1, rng, out, copy_gbs);
    std::fclose(out);
    return rc;
  }
  if (fp4) {
    const int rc = RunFp4Dense(pool, pool_pages, {logits, topk, row_request, row_length, sched},
                               sms, st, e0, e1, rng, out, copy_gbs, batches, per_batch,
                               only_requests, only_next_n, only_avg);
    std::fclose(out);
    return rc;
  }
  if (coop_topk) {
    const int rc =
        RunCoopTopK(logits, (max_ctx + 3) / 4 * 4, sms, st, e0, e1, rng, out, batches, per_batch);
    std::fclose(out);
    return rc;
  }
  if (candidates) {
    const int rc =
        RunCandidates(logits, (max_ctx + 3) / 4 * 4, sms, st, e0, e1, rng, out, batches, per_batch);
    std::fclose(out);
    return rc;
  }
  std::printf("%5s %3s %7s | %9s %9s %9s | %8s %6s | %8s | %8s %8s %8s | %8s %8s | %4s\n", "req",
              "n", "avg", "logits_us", "topk_us", "both_us", "GB/s", "%copy", "mmasync", "split",
              "keysM", "bitmove", "pipe", "fused", "sets");
  for (int requests : {1, 8, 64, 128}) {
    for (int next_n : {1, 2, 3, 4}) {
      for (int avg : {8192, 32768, 65536, 131072}) {
        // next_n 3 and 4 (keys read once per request for 1-4 rows): at 64 x 32K only.
        if (next_n > 2 && !(requests == 64 && avg == 32768) && only_requests == 0) continue;
        if (only_requests != 0 &&
            (requests != only_requests || next_n != only_next_n || avg != only_avg)) {
          continue;
        }
        if (subset) {
          const bool pick = (requests == 1 && avg == 131072) || (requests == 8 && avg == 32768) ||
                            (requests == 64 && avg >= 32768) || (requests == 128 && avg == 65536);
          if (!pick) continue;
        }
        if (topk_only) {
          const bool pick =
              next_n == 1 &&
              ((requests == 1 && avg == 131072) || (requests == 8 && avg == 32768) ||
               (requests == 64 && avg >= 32768) || (requests == 128 && avg == 131072));
          if (!pick) continue;
        }
        const StepDraw d = DrawStep(requests, next_n, avg, rng);
        const std::vector<int32_t>& lengths = d.lengths;
        const int32_t max_len = d.max_len;
        const int64_t step_pages = d.pages;
        double key_bytes = 0;
        for (int32_t l : lengths) key_bytes += static_cast<double>(l) * 132;
        // Enough sets that their keys together are several times the 60 MB L2.
        const int sets = static_cast<int>(
            std::min<int64_t>(std::min<int64_t>(32, pool_pages / std::max<int64_t>(1, step_pages)),
                              std::max<int64_t>(1, (int64_t{400} << 20) / int64_t(key_bytes) + 1)));
        const std::vector<int32_t> perm = ShuffledPages(pool_pages, rng);
        const int rows = requests * next_n;
        CHECK_CUDA(cudaMemcpyAsync(row_request, d.row_request.data(), 4 * rows,
                                   cudaMemcpyHostToDevice, st),
                   "copy rows");
        CHECK_CUDA(
            cudaMemcpyAsync(row_length, d.row_length.data(), 4 * rows, cudaMemcpyHostToDevice, st),
            "copy lengths");
        std::vector<InputSet> in(sets);
        int64_t next_page = 0;
        for (auto& s : in) {
          const std::vector<int32_t> pt = PageTableOf(d, perm, next_page);
          CHECK_CUDA(cudaMalloc(&s.page_table, 4 * pt.size()), "page table");
          CHECK_CUDA(
              cudaMemcpyAsync(s.page_table, pt.data(), 4 * pt.size(), cudaMemcpyHostToDevice, st),
              "copy page table");
          const int64_t qn = int64_t{rows} * kHeads * 128;
          CHECK_CUDA(cudaMalloc(&s.q, qn), "q");
          CHECK_CUDA(cudaMalloc(&s.w, 4 * int64_t{rows} * kHeads), "w");
          FillQ<<<256, 256, 0, st>>>(s.q, qn, s.w, int64_t{rows} * kHeads, rng());
          CHECK_CUDA(cudaGetLastError(), "fill q");
        }
        CHECK_CUDA(cudaStreamSynchronize(st), "setup");

        const int64_t lstride = (max_len + 3) / 4 * 4;
        auto rows_of = [&](const InputSet& s) {
          return StepRows(d, next_n, row_request, row_length, s.page_table);
        };
        dc::MqaMath math = dc::PagedLogitsArgs{}.math;
        // A comparison variant (bench/cuda/variants/) instead of `math` when set.
        std::optional<dc::MqaVariant> variant;
        bool with_hist = false;  // logits fill the threshold-filter histogram (keys-M variants)
        auto run_logits = [&](int i) {
          const InputSet& s = in[i % sets];
          dc::PagedLogitsArgs a;
          a.cache = {pool, pool_pages, {di::CacheFormat::kFp8, 128, kPage}};
          a.rows = rows_of(s);
          a.q = {s.q, nullptr, s.w, kHeads};
          a.schedule = sched;
          a.logits = logits;
          a.logits_stride = lstride;
          a.math = math;
          a.row_histogram = with_hist ? row_hist : nullptr;
          if (variant.has_value()) {
            if (dc::MqaVariantNeedsSchedule(*variant, a)) {
              CHECK_OK(dc::LaunchMqaSchedule(a.rows, sched, st), "schedule");
            }
            CHECK_OK(dc::LaunchMqaVariant(*variant, a, sms, st), "logits (variant)");
            return;
          }
          if (dc::PagedLogitsNeedsSchedule(a)) {
            CHECK_OK(dc::LaunchMqaSchedule(a.rows, sched, st), "schedule");
          }
          CHECK_OK(dc::LaunchPagedMqaLogits(a, sms, st), "logits");
        };
        using Algo = dc::TopKArgs::Algo;
        // The default is the backend's own choice (kAuto: cooperative, multi-pass or compact
        // by shape), so the `top-k` and `both` columns are what DenseTopK runs.
        auto run_topk = [&](Algo algo = Algo::kAuto, int cluster = 0, bool hist = false,
                            int32_t* dst = nullptr) {
          dc::TopKArgs t;
          t.num_rows = rows;
          t.values = logits;
          t.stride = lstride;
          t.lengths = row_length;
          t.k = kTopK;
          t.out = dst != nullptr ? dst : topk;
          t.max_length = max_len;
          t.algo = algo;
          t.cluster_size = cluster;
          t.row_histogram = hist ? row_hist : nullptr;
          CHECK_OK(dc::LaunchRadixTopK(t, sms, st), "topk");
        };
        // Each step gets the next index (the next page-table set).
        auto time_batches = [&](auto&& step) {
          int i = 0;
          return TimeBatches(st, e0, e1, batches, per_batch, [&] { step(i++); });
        };
        // The mma.sync kernel and the comparison variants (bench/cuda/variants/), logits only;
        // then the production kernels and the default.
        float t_mma = 0, t_split = 0, t_keysm = 0, t_bitmove = 0, t_pipe = 0, t_fused = 0;
        float t_ws2 = 0, t_ws4 = 0;  // v7: producer warpgroup + 2 / 4 consumer warpgroups
        if (!topk_only && !skip_variants) {
          auto time_math = [&](dc::MqaMath m) {
            math = m;
            return time_batches([&](int i) { run_logits(i); });
          };
          auto time_variant = [&](dc::MqaVariant v) {
            variant = v;
            const float t = time_batches([&](int i) { run_logits(i); });
            variant.reset();
            return t;
          };
          t_mma = time_math(dc::MqaMath::kMmaSync);
          t_split = time_variant(dc::MqaVariant::kWgmmaKeysMSplit);
          t_keysm = time_variant(dc::MqaVariant::kWgmmaKeysM);  // v4, the default until 08:20
          t_bitmove = time_variant(dc::MqaVariant::kWgmmaKeysMBitMove);
          t_pipe = time_math(dc::MqaMath::kWgmmaKeysMPipelined);
          t_fused = time_variant(dc::MqaVariant::kWgmmaKeysMFused);  // the default until 10:30
          t_ws2 = time_variant(dc::MqaVariant::kWgmmaKeysMPipelinedWs2);
          t_ws4 = time_variant(dc::MqaVariant::kWgmmaKeysMPipelinedWs4);
        }
        // The two production kernels (sm90_heuristics.h), eager and as graph replay: exact (v6)
        // and fp8 (keys read once per request, fp8 tensor cores).
        float t_exact = 0, t_exact_graph = 0, t_f8 = 0, t_f8_graph = 0;
        if (!topk_only) {
          auto eager = [&](dc::MqaMath m) {
            math = m;
            return time_batches([&](int i) { run_logits(i); });
          };
          auto graph = [&](dc::MqaMath m) {
            math = m;
            int i = 0;
            return TimeGraph(st, e0, e1, batches, per_batch, [&] { run_logits(i++); });
          };
          t_exact = eager(dc::kExactDenseMqaMath);
          t_exact_graph = graph(dc::kExactDenseMqaMath);
          t_f8 = eager(dc::kFp8DenseMqaMath);
          t_f8_graph = graph(dc::kFp8DenseMqaMath);
        }
        // The fp8 variants (bench/cuda/variants/: the fp8 kernel before the TMA producer and the
        // four-chain epilogue, and the production kernel at other shape choices), eager and
        // graph: the same-run alternatives of the production fp8 kernel.
        constexpr int kFp8Variants = std::size(dc::kFp8MqaVariants);
        float t_fv[kFp8Variants] = {}, t_fv_graph[kFp8Variants] = {};
        if (!topk_only) {
          for (int k = 0; k < kFp8Variants; ++k) {
            variant = dc::kFp8MqaVariants[k];
            t_fv[k] = time_batches([&](int i) { run_logits(i); });
            int i = 0;
            t_fv_graph[k] = TimeGraph(st, e0, e1, batches, per_batch, [&] { run_logits(i++); });
            variant.reset();
          }
        }
        // The default: what DenseTopK runs (DI_LOGITS_PRECISION=exact / fp8 overrides it).
        math = dc::DenseMqaMath(di::LogitsPrecision::kDefault);
        const float t_logits = time_batches([&](int i) { run_logits(i); });
        run_logits(0);
        // Top-k variants on the same logits; they must agree entry for entry.
        int64_t topk_mismatch = 0;
        {
          const int64_t n = int64_t{rows} * kTopK;
          std::vector<int32_t> ref(n), got(n);
          run_topk(Algo::kMultiPass, 0, false, topk_ref);
          CHECK_CUDA(cudaMemcpyAsync(ref.data(), topk_ref, 4 * n, cudaMemcpyDeviceToHost, st),
                     "d2h");
          auto check = [&]() {
            CHECK_CUDA(cudaMemcpyAsync(got.data(), topk, 4 * n, cudaMemcpyDeviceToHost, st), "d2h");
            CHECK_CUDA(cudaStreamSynchronize(st), "sync");
            for (int64_t e = 0; e < n; ++e) topk_mismatch += got[e] != ref[e];
          };
          for (int c : {0, 1, 2, 4, 8}) {
            run_topk(Algo::kCompact, c);
            check();
          }
          run_topk();  // the default (kAuto)
          check();
          // The logits again from keys-M fused (the variant with the hook: the exact kernel's
          // values, not the fp8 default's), now filling the threshold-filter histogram; the
          // reference top-k on those logits first.
          variant = dc::MqaVariant::kWgmmaKeysMFused;
          with_hist = true;
          run_logits(0);
          with_hist = false;
          variant.reset();
          run_topk(Algo::kMultiPass, 0, false, topk_ref);
          CHECK_CUDA(cudaMemcpyAsync(ref.data(), topk_ref, 4 * n, cudaMemcpyDeviceToHost, st),
                     "d2h");
          run_topk(Algo::kCompact, 0, true);
          check();
        }
        const float t_topk_multi = time_batches([&](int) { run_topk(Algo::kMultiPass); });
        float t_topk_c[4] = {0, 0, 0, 0};  // compact, clusters of 1, 2, 4, 8
        for (int ci = 0; ci < 4; ++ci) {
          t_topk_c[ci] = time_batches([&](int) { run_topk(Algo::kCompact, 1 << ci); });
        }
        const float t_topk = time_batches([&](int) { run_topk(); });
        const float t_both = time_batches([&](int i) {
          run_logits(i);
          run_topk();
        });
        const float t_both_multi = time_batches([&](int i) {
          run_logits(i);
          run_topk(Algo::kMultiPass);
        });
        // The threshold filter against the same logits kernel without it (keys-M fused).
        variant = dc::MqaVariant::kWgmmaKeysMFused;
        const float t_logits_kmf = time_batches([&](int i) { run_logits(i); });
        const float t_both_kmf = time_batches([&](int i) {
          run_logits(i);
          run_topk(Algo::kCompact);
        });
        with_hist = true;
        const float t_both_fused = time_batches([&](int i) {
          run_logits(i);
          run_topk(Algo::kCompact, 0, true);
        });
        with_hist = false;
        variant.reset();
        CHECK_CUDA(cudaStreamSynchronize(st), "sync");
        CHECK_CUDA(cudaGetLastError(), "after timing");
        const double gbs = key_bytes / (t_logits * 1e-6) / 1e9;
        std::printf(
            "%5d %3d %6dK | %9.1f %9.1f %9.1f | %8.0f %5.1f%% | %8.1f | %8.1f %8.1f "
            "%8.1f | %8.1f %8.1f | %4d\n",
            requests, next_n, avg / 1024, t_logits, t_topk, t_both, gbs, 100.0 * gbs / copy_gbs,
            t_mma, t_split, t_keysm, t_bitmove, t_pipe, t_fused, sets);
        std::printf(
            "      top-k: multi-pass %.1f | compact c1 %.1f c2 %.1f c4 %.1f c8 %.1f | default %.1f"
            " | both: multi-pass %.1f default %.1f | keys-M fused logits %.1f + compact %.1f,"
            " threshold filter %.1f | mismatches %lld\n",
            t_topk_multi, t_topk_c[0], t_topk_c[1], t_topk_c[2], t_topk_c[3], t_topk, t_both_multi,
            t_both, t_logits_kmf, t_both_kmf, t_both_fused, static_cast<long long>(topk_mismatch));
        std::printf("      logits v7 (setmaxnreg warp specialization): ws2 %.1f ws4 %.1f\n", t_ws2,
                    t_ws4);
        auto pct = [&](float us) { return 100.0 * key_bytes / (us * 1e-6) / 1e9 / copy_gbs; };
        std::printf(
            "      production logits, eager / graph us (%% of copy): exact %.1f / %.1f (%.1f%% / "
            "%.1f%%) | fp8 %.1f / %.1f (%.1f%% / %.1f%%)\n",
            t_exact, t_exact_graph, pct(t_exact), pct(t_exact_graph), t_f8, t_f8_graph, pct(t_f8),
            pct(t_f8_graph));
        for (int k = 0; k < kFp8Variants; ++k) {
          std::printf("      fp8 variant %s: eager / graph %.1f / %.1f us\n",
                      dc::MqaVariantName(dc::kFp8MqaVariants[k]), t_fv[k], t_fv_graph[k]);
        }
        std::fprintf(out,
                     "{\"logits_exact_us\": %.2f, \"logits_exact_graph_us\": %.2f, "
                     "\"logits_fp8_us\": %.2f, \"logits_fp8_graph_us\": %.2f, "
                     "\"default_fp8\": %s, ",
                     t_exact, t_exact_graph, t_f8, t_f8_graph,
                     math == dc::kFp8DenseMqaMath ? "true" : "false");
        std::fprintf(out, "\"fp8_variants\": {");
        for (int k = 0; k < kFp8Variants; ++k) {
          std::fprintf(out, "%s\"%s\": [%.2f, %.2f]", k > 0 ? ", " : "",
                       dc::MqaVariantName(dc::kFp8MqaVariants[k]), t_fv[k], t_fv_graph[k]);
        }
        std::fprintf(out, "}, ");
        std::fprintf(out, "\"logits_keys_m_ws2_us\": %.2f, \"logits_keys_m_ws4_us\": %.2f, ", t_ws2,
                     t_ws4);
        std::fprintf(out,
                     "\"topk_multipass_us\": %.2f, \"topk_compact_c1_us\": %.2f, "
                     "\"topk_compact_c2_us\": %.2f, \"topk_compact_c4_us\": %.2f, "
                     "\"topk_compact_c8_us\": %.2f, \"both_multipass_us\": %.2f, "
                     "\"logits_kmf_us\": %.2f, \"both_kmf_us\": %.2f, "
                     "\"both_fused_us\": %.2f, \"topk_mismatches\": %lld, ",
                     t_topk_multi, t_topk_c[0], t_topk_c[1], t_topk_c[2], t_topk_c[3], t_both_multi,
                     t_logits_kmf, t_both_kmf, t_both_fused, static_cast<long long>(topk_mismatch));
        std::fprintf(out,
                     "\"requests\": %d, \"next_n\": %d, \"avg\": %d, \"logits_us\": %.2f, "
                     "\"topk_us\": %.2f, \"both_us\": %.2f, \"key_bytes\": %.0f, "
                     "\"key_gbs\": %.1f, \"copy_gbs\": %.1f, \"sets\": %d, "
                     "\"logits_mma_sync_us\": %.2f, \"logits_keys_m_split_us\": %.2f, "
                     "\"logits_keys_m_us\": %.2f, \"logits_keys_m_bitmove_us\": %.2f, "
                     "\"logits_keys_m_pipelined_us\": %.2f, \"logits_keys_m_fused_us\": %.2f, "
                     "\"lengths\": [",
                     requests, next_n, avg, t_logits, t_topk, t_both, key_bytes, gbs, copy_gbs,
                     sets, t_mma, t_split, t_keysm, t_bitmove, t_pipe, t_fused);
        for (int b = 0; b < requests; ++b) std::fprintf(out, "%s%d", b ? ", " : "", lengths[b]);
        std::fprintf(out, "]}\n");
        std::fflush(out);
        for (auto& s : in) {
          CHECK_CUDA(cudaFree(s.page_table), "free");
          CHECK_CUDA(cudaFree(s.q), "free");
          CHECK_CUDA(cudaFree(s.w), "free");
        }
      }
    }
  }
  std::fclose(out);
  return 0;
}
