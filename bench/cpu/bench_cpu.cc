// Times the CPU backend's decode step: v32 (H 64, D 128, K 2048, FP8) and a v41-like FP4
// candidate source (H 32, K 512, 2048 blocks of 8), 8 sequences x 8K context by default, with
// random non-zero data in a shuffled page table. Prints the median ms per step.
//
//   decode-indexer-bench-cpu [--threads N] [--reps N] [--seqs N] [--context N] [--next-n N]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "common/cli.h"
#include "decode_indexer/kernels/backend.h"
#include "decode_indexer/kernels/cpu_reference.h"

namespace {

using namespace decode_indexer::kernels;

struct Options {
  int threads = 0;
  int reps = 5;
  int seqs = 8;
  int context = 8192;
  int next_n = 1;
};

struct Case {
  const char* name;
  CacheFormat format;
  int heads;
  int topk;
  int candidate_blocks;  // 0: a plain dense layer
};

void Check(const absl::Status& st, const char* what) {
  if (!st.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, st.ToString().c_str());
    std::exit(1);
  }
}

template <typename T>
T* Alloc(Backend& backend, size_t count) {
  auto ptr = backend.Allocate(count * sizeof(T));
  Check(ptr.status(), "Allocate");
  return static_cast<T*>(*ptr);
}

void RunCase(const Case& c, const Options& opt) {
  constexpr int kD = 128;
  constexpr int kPage = 64;
  const int rows = opt.seqs * opt.next_n;
  BackendLimits limits;
  limits.max_rows = rows;
  limits.max_requests = opt.seqs;
  limits.max_context = opt.context;
  limits.num_heads = c.heads;
  limits.head_dim = kD;
  limits.max_topk = c.topk;
  limits.max_candidate_positions = std::max(1, c.candidate_blocks * 8);
  std::unique_ptr<Backend> backend = MakeCpuBackend(limits, opt.threads);

  std::mt19937_64 rng(1234);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int pages_per_seq = (opt.context + kPage - 1) / kPage;
  const int num_pages = opt.seqs * pages_per_seq;
  CacheView cache;
  cache.geometry = {c.format, kD, kPage};
  cache.num_pages = num_pages;
  cache.base = Alloc<uint8_t>(*backend, num_pages * cache.geometry.page_bytes());

  // A shuffled page table: pages scattered across the pool.
  std::vector<int32_t> perm(num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  int32_t* table = Alloc<int32_t>(*backend, num_pages);
  std::memcpy(table, perm.data(), sizeof(int32_t) * num_pages);

  // Keys: every position of every sequence, inserted through the backend.
  const int64_t keys = int64_t{opt.seqs} * opt.context;
  std::vector<float> key_values(keys * kD);
  for (float& v : key_values) v = normal(rng);
  std::vector<int64_t> slots(keys);
  for (int s = 0; s < opt.seqs; ++s) {
    for (int p = 0; p < opt.context; ++p) {
      slots[int64_t{s} * opt.context + p] =
          int64_t{perm[s * pages_per_seq + p / kPage]} * kPage + p % kPage;
    }
  }
  KeyInsertArgs insert;
  insert.cache = cache;
  insert.num_keys = static_cast<int32_t>(keys);
  insert.keys = key_values.data();
  insert.slots = slots.data();
  Check(backend->InsertKeys(insert), "InsertKeys");

  // q and weights, quantized and folded through the backend.
  std::vector<float> q(int64_t{rows} * c.heads * kD), w(int64_t{rows} * c.heads);
  for (float& v : q) v = normal(rng);
  for (float& v : w) v = normal(rng);
  const int value_bytes = c.format == CacheFormat::kFp8 ? kD : kD / 2;
  uint8_t* q_codes = Alloc<uint8_t>(*backend, int64_t{rows} * c.heads * value_bytes);
  uint8_t* q_scales = Alloc<uint8_t>(*backend, int64_t{rows} * c.heads * (kD / 32));
  float* weights = Alloc<float>(*backend, int64_t{rows} * c.heads);
  QPrepArgs prep;
  prep.num_rows = rows;
  prep.num_heads = c.heads;
  prep.head_dim = kD;
  prep.q = q.data();
  prep.weights_raw = w.data();
  prep.format = c.format;
  prep.q_codes = q_codes;
  prep.q_scales = q_scales;
  prep.weights_out = weights;
  Check(backend->RopeQuantQ(prep), "RopeQuantQ");

  int32_t* row_request = Alloc<int32_t>(*backend, rows);
  int32_t* row_length = Alloc<int32_t>(*backend, rows);
  for (int r = 0; r < rows; ++r) {
    row_request[r] = r / opt.next_n;
    row_length[r] = opt.context - opt.next_n + r % opt.next_n + 1;
  }
  int32_t* topk_out = Alloc<int32_t>(*backend, int64_t{rows} * c.topk);
  int32_t* candidates =
      c.candidate_blocks ? Alloc<int32_t>(*backend, int64_t{rows} * c.candidate_blocks) : nullptr;
  DenseArgs dense;
  dense.cache = cache;
  dense.rows = {rows, row_request, row_length, table, pages_per_seq, opt.seqs, opt.context};
  dense.q = {q_codes, c.format == CacheFormat::kFp4 ? q_scales : nullptr, weights, c.heads};
  dense.topk = c.topk;
  dense.topk_out = topk_out;
  dense.candidates_out = candidates;
  dense.num_candidate_blocks = c.candidate_blocks;
  dense.candidate_block_size = c.candidate_blocks ? 8 : 0;

  Check(backend->DenseTopK(dense), "DenseTopK (warm-up)");
  std::vector<double> ms;
  for (int i = 0; i < opt.reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    Check(backend->DenseTopK(dense), "DenseTopK");
    Check(backend->Synchronize(), "Synchronize");
    const auto t1 = std::chrono::steady_clock::now();
    ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  std::printf(
      "%-28s %s: %d seqs x %d ctx, next_n %d, H %d, K %d: median %.2f ms/step "
      "(min %.2f, max %.2f, %d reps)\n",
      c.name, backend->description().c_str(), opt.seqs, opt.context, opt.next_n, c.heads, c.topk,
      ms[ms.size() / 2], ms.front(), ms.back(), opt.reps);
  for (void* p :
       {static_cast<void*>(cache.base), static_cast<void*>(table), static_cast<void*>(q_codes),
        static_cast<void*>(q_scales), static_cast<void*>(weights), static_cast<void*>(row_request),
        static_cast<void*>(row_length), static_cast<void*>(topk_out),
        static_cast<void*>(candidates)}) {
    backend->Free(p);
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  CLI::App app{
      "decode-indexer-bench-cpu: times the CPU backend's decode step (v32 dense FP8, "
      "then a v41-like FP4 source step)"};
  app.add_option("--threads", opt.threads, "backend threads (0: hardware threads)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--reps", opt.reps, "timed repetitions")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--seqs", opt.seqs, "sequences in the step")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--context", opt.context, "keys per sequence")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--next-n", opt.next_n, "rows per sequence")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  decode_indexer::cli::AddVersion(app);
  DI_CLI_PARSE(app, argc, argv);
  opt.context = std::max(opt.next_n, opt.context);
  RunCase({"v32 dense (FP8)", CacheFormat::kFp8, 64, 2048, 0}, opt);
  RunCase({"v41-like source (FP4)", CacheFormat::kFp4, 32, 512, 2048}, opt);
  return 0;
}
