// What the GPU test binaries share (gpu_test: the production kernels; gpu_variants_test: the
// comparison variants under bench/cuda/variants/): the fixture with a CUDA backend, device
// buffers, random scenes uploaded to the device, the CPU's logits of a row and the paged logits
// of a launcher into a NaN-poisoned workspace.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "decode_indexer/kernels/backend.h"
#include "decode_indexer/kernels/cpu_reference.h"
#include "gtest/gtest.h"
#include "kernels/cuda/sm90_launchers.h"
#include "tests/kernels/kernel_test_util.h"
#include "tests/test_seed.h"

namespace decode_indexer::testing::gpu {

using kernels::Backend;
using kernels::CacheFormat;

inline constexpr int32_t kPoisonI32 = 0x5A5A5A5A;

// Tolerance on a GPU logit vs the CPU one, relative to the row's largest |logit|: the tensor
// cores sum the 128-term dot in fp32 and the head sum runs in float in another order. Seen on
// the H200: <= 1.8e-7 (about 3 float ulps); 1e-5 leaves room for longer sums without letting
// a wrong key, head or scale through. The tests print the largest error seen.
inline constexpr double kLogitRelTol = 1e-5;
inline int NumSms() {
  int n = 0;
  EXPECT_EQ(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  return n;
}

// Seeded per test (tests/test_seed.h): a failing test prints its seed; DI_TEST_SEED replays.
inline std::mt19937_64& Rng() { return ::decode_indexer::testing::PerTestRng(); }

// A buffer in the backend's (device) memory.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Backend* b, size_t bytes) : backend_(b), bytes_(bytes) {
    auto p = b->Allocate(bytes);
    EXPECT_TRUE(p.ok()) << p.status();
    ptr_ = p.ok() ? *p : nullptr;
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(backend_, o.backend_);
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) backend_->Free(ptr_);
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  Backend* backend_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

class GpuTest : public ::testing::Test {
 public:
  void SetUp() override {
    if (!kernels::CudaBackendAvailable()) {
      GTEST_SKIP() << "no CUDA GPU visible: the CUDA backend tests are skipped here";
    }
    auto b = MakeBackend();
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = std::move(*b);
  }

  // A CUDA backend of the suite's limits (room for the > 256-request dense case), its dense
  // logits at `precision` (backend_ is at the default).
  static absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(
      kernels::LogitsPrecision precision = kernels::LogitsPrecision::kDefault) {
    kernels::BackendLimits limits;
    limits.max_rows = 320;
    limits.max_requests = 320;
    limits.max_context = 1 << 20;
    limits.num_heads = 64;
    limits.head_dim = 128;
    limits.max_topk = 2048;
    limits.max_candidate_positions = 2048 * 8;
    limits.logits_precision = precision;
    return kernels::MakeCudaBackend(limits, 0);
  }

  template <typename T>
  DeviceBuffer Upload(const std::vector<T>& host) {
    DeviceBuffer d(backend_.get(), std::max<size_t>(1, host.size() * sizeof(T)));
    EXPECT_TRUE(backend_->CopyToDevice(d.as<void>(), host.data(), host.size() * sizeof(T)).ok());
    return d;
  }
  template <typename T>
  DeviceBuffer Poisoned(size_t n, T poison) {
    return Upload(std::vector<T>(n, poison));
  }
  template <typename T>
  std::vector<T> Download(const DeviceBuffer& d, size_t n) {
    std::vector<T> host(n);
    EXPECT_TRUE(backend_->CopyToHost(host.data(), d.as<void>(), n * sizeof(T)).ok());
    EXPECT_TRUE(backend_->Synchronize().ok());
    return host;
  }

  std::unique_ptr<Backend> backend_;
};

// A scene's buffers in device memory, and the views over them.
struct DeviceScene {
  DeviceBuffer pool, page_table, row_request, row_length, q_codes, q_scales, weights;
  kernels::CacheView cache;
  kernels::RowBatch rows;
  kernels::QView q;
};

inline std::unique_ptr<DeviceScene> UploadScene(GpuTest* t, Scene& s,
                                                std::unique_ptr<DeviceScene> ds = nullptr) {
  if (ds == nullptr) ds = std::make_unique<DeviceScene>();
  ds->pool = t->Upload(s.pool);
  ds->page_table = t->Upload(s.page_table);
  ds->row_request = t->Upload(s.row_request);
  ds->row_length = t->Upload(s.row_length);
  ds->q_codes = t->Upload(s.q_codes);
  ds->q_scales = t->Upload(s.q_scales);
  ds->weights = t->Upload(s.weights);
  ds->cache = s.cache();
  ds->cache.base = ds->pool.as<uint8_t>();
  ds->rows = s.rows();
  ds->rows.page_table = ds->page_table.as<int32_t>();
  ds->rows.row_request = ds->row_request.as<int32_t>();
  ds->rows.row_length = ds->row_length.as<int32_t>();
  ds->q = s.q();
  ds->q.codes = ds->q_codes.as<uint8_t>();
  ds->q.scales = s.spec.format == CacheFormat::kFp4 ? ds->q_scales.as<uint8_t>() : nullptr;
  ds->q.weights = ds->weights.as<float>();
  return ds;
}

// CPU logits of one row, split over threads (RowLogitsAt is bit-identical to RowLogits).
inline std::vector<float> CpuRowLogits(Scene& s, int32_t r) {
  const int32_t len = s.row_length[r];
  std::vector<float> out(len);
  const std::vector<int32_t> pos = Iota(len);
  const int threads = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  const int32_t chunk = (len + threads - 1) / threads;
  std::vector<std::thread> pool;
  const kernels::CacheView cache = s.cache();
  const kernels::RowBatch rows = s.rows();
  const kernels::QView q = s.q();
  for (int i = 0; i < threads; ++i) {
    const int32_t lo = i * chunk, hi = std::min(len, lo + chunk);
    if (lo >= hi) break;
    pool.emplace_back([&, lo, hi] {
      kernels::cpu::RowLogitsAt(cache, rows, q, r, pos.data() + lo, hi - lo, out.data() + lo);
    });
  }
  for (auto& th : pool) th.join();
  return out;
}

inline std::vector<double> ToDouble(const std::vector<float>& v) { return {v.begin(), v.end()}; }

inline double RowTol(const std::vector<float>& cpu) {
  double m = 0.0;
  for (float v : cpu) m = std::max(m, std::fabs(double{v}));
  return kLogitRelTol * m + 1e-30;
}

// Random lengths around `avg` (0.7x - 1.3x).
inline std::vector<int32_t> Lengths(int n, int32_t avg) {
  std::uniform_real_distribution<double> u(0.7, 1.3);
  std::vector<int32_t> v(n);
  for (auto& l : v) l = std::max(1, static_cast<int32_t>(avg * u(Rng())));
  return v;
}

// The FP4 kernel's shapes (gpu_test, gpu_variants_test): next_n 1-4 and 5 (a request with more
// rows than a pass), rows shorter and longer than K, and more requests than the kernel
// schedules itself.
struct Fp4Case {
  std::vector<int32_t> lengths;
  int32_t next_n;
};
inline std::vector<Fp4Case> Fp4KernelCases() {
  return {{{9000, 300, 513, 70000}, 1}, {{5000, 20000, 64}, 2}, {{4000, 3000}, 3},
          {{3000, 129, 2049}, 4},       {Lengths(300, 150), 1}, {{6000, 700}, 5}};
}

// `got` against `want` ([rows, stride] logits of scene `s`) over each row's positions below its
// length: the entries whose bits differ, those left NaN in `got` (not written), and the first
// few differing ones as text (row, position, key tile, both values).
struct LogitsDiff {
  int64_t differ = 0;
  int64_t unwritten = 0;
  std::string first;
};
inline LogitsDiff CompareLogits(const Scene& s, int64_t stride, const std::vector<float>& want,
                                const std::vector<float>& got) {
  LogitsDiff d;
  for (int32_t r = 0; r < s.num_rows(); ++r) {
    for (int32_t t = 0; t < s.row_length[r]; ++t) {
      const float a = want[r * stride + t], b = got[r * stride + t];
      d.unwritten += std::isnan(b);
      if (std::memcmp(&a, &b, sizeof(float)) == 0) continue;
      if (++d.differ <= 8) {
        d.first += " [row " + std::to_string(r) + " pos " + std::to_string(t) + " tile " +
                   std::to_string(t / 64) + ": " + std::to_string(a) + " vs " + std::to_string(b) +
                   "]";
      }
    }
  }
  return d;
}

inline SceneSpec Spec(CacheFormat f, int32_t heads, std::vector<int32_t> lengths, int32_t next_n) {
  SceneSpec sp;
  sp.format = f;
  sp.heads = heads;
  sp.lengths = std::move(lengths);
  sp.next_n = next_n;
  sp.seed = Rng()();
  return sp;
}

// Runs a paged logits launcher into a NaN-poisoned workspace; returns [rows, stride].
// needs_schedule(args) says whether to launch the schedule kernel first (a poisoned schedule
// otherwise: a kernel that derives its own must not read it); launch(args, num_sms) the kernel.
template <typename NeedsSchedule, typename Launch>
std::vector<float> GpuLogitsWith(GpuTest* t, DeviceScene& ds, int64_t stride, int num_sms,
                                 NeedsSchedule&& needs_schedule, Launch&& launch) {
  const int32_t rows = ds.rows.num_rows;
  DeviceBuffer out = t->Poisoned<float>(rows * stride, NAN);
  DeviceBuffer sched(t->backend_.get(), 4 * kernels::cuda::MqaScheduleInts(ds.rows.num_requests));
  const auto s = kernels::cuda::CarveMqaSchedule(sched.as<int32_t>(), ds.rows.num_requests);
  kernels::cuda::PagedLogitsArgs a;
  a.cache = ds.cache;
  a.rows = ds.rows;
  a.q = ds.q;
  a.schedule = s;
  a.logits = out.as<float>();
  a.logits_stride = stride;
  // A variant that derives its own schedule must not read this one: poison it (-1 everywhere).
  EXPECT_EQ(cudaMemset(sched.as<int32_t>(), 0xFF,
                       4 * kernels::cuda::MqaScheduleInts(ds.rows.num_requests)),
            cudaSuccess);
  EXPECT_TRUE(t->backend_->Synchronize().ok());
  if (needs_schedule(a)) {
    EXPECT_TRUE(kernels::cuda::LaunchMqaSchedule(ds.rows, s, nullptr).ok());
  }
  EXPECT_TRUE(launch(a, num_sms).ok());
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return t->Download<float>(out, rows * stride);
}

// The production launcher (LaunchPagedMqaLogits) with `math`.
inline std::vector<float> GpuLogits(
    GpuTest* t, DeviceScene& ds, int64_t stride, int num_sms,
    kernels::cuda::MqaMath math = kernels::cuda::PagedLogitsArgs{}.math) {
  return GpuLogitsWith(
      t, ds, stride, num_sms,
      [&](kernels::cuda::PagedLogitsArgs& a) {
        a.math = math;
        return kernels::cuda::PagedLogitsNeedsSchedule(a);
      },
      [&](const kernels::cuda::PagedLogitsArgs& a, int sms) {
        return kernels::cuda::LaunchPagedMqaLogits(a, sms, nullptr);
      });
}

// A sparse logits launch into `out` ([rows, maxp]) for a scene: the production launcher at a
// SparseLogitsMath (ProductionSparse), or a comparison variant's.
using SparseLaunch = std::function<absl::Status(const DeviceScene& ds, const int32_t* positions,
                                                const int32_t* counts, int32_t maxp, float* out)>;
inline SparseLaunch ProductionSparse(kernels::cuda::SparseLogitsMath math) {
  return [math](const DeviceScene& ds, const int32_t* positions, const int32_t* counts,
                int32_t maxp, float* out) {
    return kernels::cuda::LaunchSparseLogits(ds.cache, ds.rows, ds.q, positions, counts, maxp, out,
                                             nullptr, math);
  };
}

// Runs a sparse logits launch into a NaN-poisoned [rows, maxp] buffer.
inline std::vector<float> GpuSparseLogits(GpuTest* t, DeviceScene& ds,
                                          const DeviceBuffer& positions, const DeviceBuffer& counts,
                                          int32_t maxp, const SparseLaunch& launch) {
  const int32_t rows = ds.rows.num_rows;
  DeviceBuffer out = t->Poisoned<float>(int64_t{rows} * maxp, NAN);
  EXPECT_TRUE(t->backend_->Synchronize().ok());  // uploads ran on the backend's stream
  EXPECT_TRUE(
      launch(ds, positions.as<int32_t>(), counts.as<int32_t>(), maxp, out.as<float>()).ok());
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return t->Download<float>(out, int64_t{rows} * maxp);
}
inline std::vector<float> GpuSparseLogits(GpuTest* t, DeviceScene& ds,
                                          const DeviceBuffer& positions, const DeviceBuffer& counts,
                                          int32_t maxp, kernels::cuda::SparseLogitsMath math) {
  return GpuSparseLogits(t, ds, positions, counts, maxp, ProductionSparse(math));
}

// A sparse logit depends only on (row, position), checked for `launch` whose logits are `got`:
// the same bits on a second run; when each row lists its positions in another order (dshuf
// holds the positions of `pos` permuted by `shuf`: other tile slots and chunks); and when
// other rows' counts change (row 2 scores nothing, row 0 a prefix cut `cut` short, mid-chunk).
// Entries past a row's count stay poisoned.
inline void ExpectLogitsDependOnlyOnRowAndPosition(
    GpuTest* t, DeviceScene& ds, const Scene& s, const std::vector<int32_t>& pos,
    const std::vector<int32_t>& shuf, const std::vector<int32_t>& cnt, const DeviceBuffer& dpos,
    const DeviceBuffer& dshuf, const DeviceBuffer& dcnt, int32_t maxp, const SparseLaunch& math,
    const std::vector<float>& got, int32_t cut) {
  const int32_t rows = ds.rows.num_rows;
  EXPECT_EQ(0, std::memcmp(GpuSparseLogits(t, ds, dpos, dcnt, maxp, math).data(), got.data(),
                           got.size() * 4))
      << "not bit-identical across runs";
  const std::vector<float> moved = GpuSparseLogits(t, ds, dshuf, dcnt, maxp, math);
  int64_t slot_diff = 0;
  for (int32_t r = 0; r < rows; ++r) {
    const int64_t o = int64_t{r} * maxp;
    std::vector<float> by_pos(s.row_length[r], NAN);
    for (int32_t i = 0; i < cnt[r]; ++i) by_pos[pos[o + i]] = got[o + i];
    for (int32_t i = 0; i < cnt[r]; ++i) {
      slot_diff += std::memcmp(&by_pos[shuf[o + i]], &moved[o + i], 4) != 0;
    }
  }
  EXPECT_EQ(slot_diff, 0) << "a logit changed with its position's slot in the list";
  std::vector<int32_t> cnt2 = cnt;
  cnt2[2] = 0;
  cnt2[0] = cnt[0] - cut;
  DeviceBuffer dcnt2 = t->Upload(cnt2);
  const std::vector<float> other = GpuSparseLogits(t, ds, dpos, dcnt2, maxp, math);
  for (int32_t r = 0; r < rows; ++r) {
    const int64_t o = int64_t{r} * maxp;
    EXPECT_EQ(0, std::memcmp(other.data() + o, got.data() + o, 4 * int64_t{cnt2[r]}))
        << "row " << r << " moved when other rows' counts changed";
    EXPECT_TRUE(std::all_of(other.begin() + o + cnt2[r], other.begin() + o + maxp,
                            [](float v) { return std::isnan(v); }))
        << "row " << r << ": written past its count";
  }
}

// Candidate-block positions as the v41 expansion lists them: each row takes random distinct
// blocks of `bs` entries (about 3/4 of its blocks, at most nb), ascending, expanded below the
// row's length: pos[r * maxp + i] for i < cnt[r] (-1 past it, maxp = nb * bs); shuf holds each
// row's same positions shuffled (other tile slots and chunks).
struct CandidatePositions {
  int32_t maxp = 0;
  std::vector<int32_t> pos, shuf, cnt;
};
inline CandidatePositions MakeCandidatePositions(const Scene& s, int32_t bs, int32_t nb) {
  const int32_t rows = s.num_rows();
  CandidatePositions c;
  c.maxp = nb * bs;
  c.pos.assign(int64_t{rows} * c.maxp, -1);
  c.shuf.assign(c.pos.size(), -1);
  c.cnt.assign(rows, 0);
  for (int32_t r = 0; r < rows; ++r) {
    const int32_t len = s.row_length[r], blocks = (len + bs - 1) / bs;
    std::vector<int32_t> ids(blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), Rng());
    const int32_t take = std::min(nb, blocks * 3 / 4 + 1);
    std::sort(ids.begin(), ids.begin() + take);
    const int64_t row = int64_t{r} * c.maxp;
    int32_t n = 0;
    for (int32_t j = 0; j < take; ++j) {
      for (int32_t o = 0; o < bs && ids[j] * bs + o < len; ++o) c.pos[row + n++] = ids[j] * bs + o;
    }
    c.cnt[r] = n;
    std::copy_n(c.pos.begin() + row, n, c.shuf.begin() + row);
    std::shuffle(c.shuf.begin() + row, c.shuf.begin() + row + n, Rng());
  }
  return c;
}

// The most rows any request of the scene has (RowBatch::rows_per_request, as the server sets
// it: rows of a request are adjacent).
inline int32_t MostRows(const Scene& s) {
  int32_t most = 0;
  for (size_t r = 0, run = 0; r < s.row_request.size(); ++r) {
    run = r > 0 && s.row_request[r] == s.row_request[r - 1] ? run + 1 : 1;
    most = std::max(most, static_cast<int32_t>(run));
  }
  return most;
}

// Request 0 takes all but one row of each other request (rows stay grouped by request: request
// 0 gets 1 + (n - 1) * B rows, the others one), its lengths counting down from its own: several
// passes over each tile, the second row of a row pair empty.
inline void MakeUneven(Scene& s) {
  const int32_t b_count = s.num_requests(), rows = s.num_rows();
  const int32_t first_rows = rows - (b_count - 1);
  for (int32_t r = 0; r < rows; ++r) {
    const int32_t b = r < first_rows ? 0 : r - first_rows + 1;
    s.row_request[r] = b;
    s.row_length[r] =
        b == 0 ? std::max(1, s.spec.lengths[0] - (first_rows - 1 - r)) : s.spec.lengths[b];
  }
}

// The top-k radix key of a float on the host (what the kernels' ordered key does: -0 as +0,
// negatives flipped), for building a row's sample histogram here.
inline uint32_t HostOrderedKey(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if ((u << 1) == 0u) u = 0u;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The threshold filter's histogram scenes (the keys-M epilogue's histogram in
// gpu_variants_test, top-k from a given histogram in gpu_test): one row per request, 2 and 3
// rows per pass, a request with more rows than a pass holds, and a long row on a tiny grid.
struct HistogramCase {
  std::vector<int32_t> lengths;
  int32_t next_n;
  int num_sms;
  bool uneven;  // rebuild as {request 0: 4 rows, request 1: 2 rows}: 3 rows per pass
};
inline std::vector<HistogramCase> HistogramCases() {
  return {{Lengths(5, 9000), 1, 132, false},
          {Lengths(3, 7000), 2, 132, false},
          {Lengths(2, 5000), 3, 5, false},
          {{9000, 3000}, 2, 132, true},
          {{300000}, 1, 1, false}};
}
inline std::string Describe(const HistogramCase& c) {
  return (::testing::Message() << "first length " << c.lengths[0] << " next_n " << c.next_n
                               << " sms " << c.num_sms << " uneven " << c.uneven)
      .GetString();
}
// The FP8, 64-head scene of a case (rebuilt as 4 + 2 rows where the case is uneven).
inline Scene MakeHistogramScene(const HistogramCase& c) {
  Scene s = MakeScene(Spec(CacheFormat::kFp8, 64, c.lengths, c.next_n));
  if (c.uneven) {  // 6 rows over 2 requests: rows per pass 3, request 0 needs 2 passes
    s.row_request = {0, 0, 0, 0, 1, 1};
    const int32_t l0 = s.spec.lengths[0], l1 = s.spec.lengths[1];
    s.row_length = {l0 - 3, l0 - 2, l0 - 1, l0, l1 - 1, l1};
    const int64_t qrow = int64_t{64} * 128;
    std::vector<uint8_t> qc(6 * qrow);
    std::vector<float> w(6 * 64);
    for (int r = 0; r < 6; ++r) {
      std::copy_n(s.q_codes.begin() + (r % 4) * qrow, qrow, qc.begin() + r * qrow);
      std::copy_n(s.weights.begin() + (r % 4) * 64, 64, w.begin() + r * 64);
    }
    s.q_codes = qc;
    s.weights = w;
    s.q_scales.assign(6 * 64 * 4, 0);
  }
  return s;
}

}  // namespace decode_indexer::testing::gpu
