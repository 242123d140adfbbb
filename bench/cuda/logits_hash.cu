// decode-indexer-logits-hash: one FNV-1a hash per (shape, kernel, grid) of the paged logits
// the production dense kernels write for fixed-seed inputs (a tool, not a test or a timing).
//
// Why: a refactor of the kernels that must not change a single logit bit (moving experiments
// out of the product, sharing a producer warp) is checked by building this against the tree
// before and after the change and diffing the two outputs in one GPU call. It uses only the
// launcher interface (PagedLogitsArgs, LaunchPagedMqaLogits and the MqaMath values both trees
// have), so the same source builds against either. The whole [rows, stride] buffer is hashed
// (NaN-poisoned first), so an entry written past a row's length changes the hash too.
//
// usage: decode-indexer-logits-hash   (prints "shape math grid hash" lines, then "done")
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cuda/sm90_launchers.h"

namespace di = decode_indexer::kernels;
namespace dc = decode_indexer::kernels::cuda;

namespace {

#define CHECK_CUDA(x)                                                                   \
  do {                                                                                  \
    cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "%s: %s (line %d)\n", #x, cudaGetErrorString(e_), __LINE__); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

template <typename T>
T* Upload(const std::vector<T>& v) {
  void* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, std::max<size_t>(1, v.size() * sizeof(T))));
  CHECK_CUDA(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return static_cast<T*>(d);
}

uint64_t Fnv(const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

// A finite e4m3 code (|code| < 0x78) or any e2m1 byte.
uint8_t Code(std::mt19937_64& rng, bool fp4) {
  const uint32_t x = static_cast<uint32_t>(rng());
  return fp4 ? static_cast<uint8_t>(x) : static_cast<uint8_t>((x & 0x80u) | (x % 0x78u));
}

struct Shape {
  const char* name;
  di::CacheFormat format;
  int32_t heads;
  int32_t requests;
  int32_t next_n;
  int32_t avg_len;
  bool hint;  // RowBatch::rows_per_request = next_n
};

void RunShape(const Shape& sh, uint64_t seed, int all_sms) {
  std::mt19937_64 rng(seed);
  const bool fp4 = sh.format == di::CacheFormat::kFp4;
  const di::CacheGeometry geo{sh.format, 128, 64};
  std::vector<int32_t> lengths(sh.requests);
  std::uniform_real_distribution<double> u(0.7, 1.3);
  int32_t max_len = 0;
  for (auto& l : lengths) {
    l = std::max(sh.next_n, static_cast<int32_t>(sh.avg_len * u(rng)));
    max_len = std::max(max_len, l);
  }
  const int32_t stride_pages = (max_len + 63) / 64;
  int64_t pages = 0;
  for (int32_t l : lengths) pages += (l + 63) / 64;
  // Shuffled page table over a pool with a few spare pages.
  std::vector<int32_t> perm(pages + 3);
  for (size_t i = 0; i < perm.size(); ++i) perm[i] = static_cast<int32_t>(i);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> table(int64_t{sh.requests} * stride_pages, 0);
  int64_t next = 0;
  for (int b = 0; b < sh.requests; ++b) {
    for (int j = 0; j < (lengths[b] + 63) / 64; ++j)
      table[int64_t{b} * stride_pages + j] = perm[next++];
  }
  const int64_t pool_pages = static_cast<int64_t>(perm.size());
  std::vector<uint8_t> pool(pool_pages * geo.page_bytes());
  for (int64_t p = 0; p < pool_pages; ++p) {
    uint8_t* page = pool.data() + p * geo.page_bytes();
    const int64_t values = int64_t{64} * geo.value_bytes();
    for (int64_t i = 0; i < values; ++i) page[i] = Code(rng, fp4);
    if (fp4) {
      for (int64_t i = values; i < geo.page_bytes(); ++i) page[i] = 120 + rng() % 14;  // ue8m0
    } else {
      float* s = reinterpret_cast<float*>(page + values);
      for (int k = 0; k < 64; ++k)
        s[k] = std::ldexp(1.0f + (rng() % 8) / 8.0f, -10 + int(rng() % 6));
    }
  }
  std::vector<int32_t> row_request, row_length;
  for (int b = 0; b < sh.requests; ++b) {
    for (int j = 0; j < sh.next_n; ++j) {
      row_request.push_back(b);
      row_length.push_back(lengths[b] - sh.next_n + j + 1);
    }
  }
  const int32_t rows = static_cast<int32_t>(row_request.size());
  const int64_t q_bytes = int64_t{rows} * sh.heads * (fp4 ? 64 : 128);
  std::vector<uint8_t> q_codes(q_bytes), q_scales(fp4 ? int64_t{rows} * sh.heads * 4 : 0);
  for (auto& c : q_codes) c = Code(rng, fp4);
  for (auto& s : q_scales) s = 120 + rng() % 14;
  std::vector<float> weights(int64_t{rows} * sh.heads);
  for (auto& w : weights) w = std::ldexp(static_cast<float>(rng() % 2001) / 1000.f - 1.f, -3);

  uint8_t* d_pool = Upload(pool);
  int32_t* d_table = Upload(table);
  int32_t* d_req = Upload(row_request);
  int32_t* d_len = Upload(row_length);
  uint8_t* d_q = Upload(q_codes);
  uint8_t* d_qs = fp4 ? Upload(q_scales) : nullptr;
  float* d_w = Upload(weights);
  const int64_t lstride = (max_len + 3) / 4 * 4;
  float* d_logits = nullptr;
  CHECK_CUDA(cudaMalloc(&d_logits, 4 * int64_t{rows} * lstride));
  int32_t* d_sched = nullptr;
  CHECK_CUDA(cudaMalloc(&d_sched, 4 * dc::MqaScheduleInts(sh.requests)));
  const dc::MqaSchedule sched = dc::CarveMqaSchedule(d_sched, sh.requests);
  std::vector<float> host(int64_t{rows} * lstride);

  struct M {
    const char* name;
    dc::MqaMath math;
  };
  const M maths[] = {{"exact", dc::MqaMath::kWgmmaKeysMPipelined},
                     {"fp8", dc::MqaMath::kWgmmaKeysMPipelinedFp8},
                     {"mma_sync", dc::MqaMath::kMmaSync}};
  for (const M& m : maths) {
    for (const int sms : {1, 3, all_sms}) {
      dc::PagedLogitsArgs a;
      a.cache = {d_pool, pool_pages, geo};
      a.rows.num_rows = rows;
      a.rows.row_request = d_req;
      a.rows.row_length = d_len;
      a.rows.page_table = d_table;
      a.rows.page_table_stride = stride_pages;
      a.rows.num_requests = sh.requests;
      a.rows.max_row_length = max_len;
      a.rows.rows_per_request = sh.hint ? sh.next_n : 0;
      a.q = {d_q, d_qs, d_w, sh.heads};
      a.schedule = sched;
      a.logits = d_logits;
      a.logits_stride = lstride;
      a.math = m.math;
      std::vector<float> nan(host.size(), NAN);
      CHECK_CUDA(cudaMemcpy(d_logits, nan.data(), 4 * nan.size(), cudaMemcpyHostToDevice));
      CHECK_CUDA(cudaMemset(d_sched, 0xFF, 4 * dc::MqaScheduleInts(sh.requests)));
      if (dc::PagedLogitsNeedsSchedule(a)) {
        const absl::Status s = dc::LaunchMqaSchedule(a.rows, sched, nullptr);
        if (!s.ok())
          std::printf("%s %s %d schedule error %s\n", sh.name, m.name, sms, s.ToString().c_str());
      }
      const absl::Status s = dc::LaunchPagedMqaLogits(a, sms, nullptr);
      CHECK_CUDA(cudaDeviceSynchronize());
      if (!s.ok()) {
        std::printf("%s %s %d error %s\n", sh.name, m.name, sms, s.ToString().c_str());
        continue;
      }
      CHECK_CUDA(cudaMemcpy(host.data(), d_logits, 4 * host.size(), cudaMemcpyDeviceToHost));
      int64_t unwritten = 0;
      for (int32_t r = 0; r < rows; ++r) {
        for (int32_t t = 0; t < row_length[r]; ++t) unwritten += std::isnan(host[r * lstride + t]);
      }
      std::printf("%s %s %d %016llx unwritten=%lld\n", sh.name, m.name, sms,
                  static_cast<unsigned long long>(Fnv(host.data(), 4 * host.size())),
                  static_cast<long long>(unwritten));
    }
  }
  for (void* p :
       {static_cast<void*>(d_pool), static_cast<void*>(d_table), static_cast<void*>(d_req),
        static_cast<void*>(d_len), static_cast<void*>(d_q), static_cast<void*>(d_qs),
        static_cast<void*>(d_w), static_cast<void*>(d_logits), static_cast<void*>(d_sched)}) {
    if (p != nullptr) CHECK_CUDA(cudaFree(p));
  }
}

}  // namespace

int main() {
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const Shape shapes[] = {
      {"fp8h64_5x20000_n1", di::CacheFormat::kFp8, 64, 5, 1, 20000, false},
      {"fp8h64_6x12000_n2", di::CacheFormat::kFp8, 64, 6, 2, 12000, false},
      {"fp8h64_3x4000_n3", di::CacheFormat::kFp8, 64, 3, 3, 4000, false},
      {"fp8h64_4x3000_n4", di::CacheFormat::kFp8, 64, 4, 4, 3000, false},
      {"fp8h64_1x131149_n1", di::CacheFormat::kFp8, 64, 1, 1, 131149, false},
      {"fp8h64_300x150_n1", di::CacheFormat::kFp8, 64, 300, 1, 150, false},
      {"fp8h64_300x150_n2", di::CacheFormat::kFp8, 64, 300, 2, 150, false},
      {"fp8h64_64x2500_n2_hint", di::CacheFormat::kFp8, 64, 64, 2, 2500, true},
      {"fp8h64_64x8000_n1", di::CacheFormat::kFp8, 64, 64, 1, 8000, false},
      {"fp8h64_16x4000_n4_hint", di::CacheFormat::kFp8, 64, 16, 4, 4000, true},
      {"fp8h32_3x3000_n1", di::CacheFormat::kFp8, 32, 3, 1, 3000, false},
      {"fp4h32_5x9000_n2", di::CacheFormat::kFp4, 32, 5, 2, 9000, false},
      {"fp4h64_3x5000_n2", di::CacheFormat::kFp4, 64, 3, 2, 5000, false},
  };
  uint64_t seed = 17;
  for (const Shape& s : shapes) RunShape(s, seed++, sms);
  std::printf("done\n");
  return 0;
}
