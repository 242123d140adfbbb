// The CPU backend through the Backend interface: equal to the free functions, bit-identical
// whatever the thread count or batch composition.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include "absl/strings/str_cat.h"
#include "decode_indexer/kernels/backend.h"
#include "decode_indexer/kernels/cpu_reference.h"
#include "decode_indexer/kernels/value_check.h"
#include "gtest/gtest.h"
#include "tests/kernels/kernel_test_util.h"
#include "tests/kernels/topk_check.h"
#include "tests/test_seed.h"

namespace decode_indexer::testing {
namespace {

using namespace kernels;

constexpr int32_t kBlocks = 32;
constexpr int32_t kBs = 8;

// A host vector mirrored in backend memory.
template <typename T>
T* Upload(Backend& backend, const std::vector<T>& host) {
  auto ptr = backend.Allocate(std::max<size_t>(1, host.size()) * sizeof(T));
  EXPECT_TRUE(ptr.ok());
  EXPECT_TRUE(backend.CopyToDevice(*ptr, host.data(), host.size() * sizeof(T)).ok());
  return static_cast<T*>(*ptr);
}

template <typename T>
std::vector<T> Download(Backend& backend, const T* ptr, size_t n) {
  std::vector<T> host(n);
  EXPECT_TRUE(backend.CopyToHost(host.data(), ptr, n * sizeof(T)).ok());
  EXPECT_TRUE(backend.Synchronize().ok());
  return host;
}

struct StepOutputs {
  std::vector<int32_t> topk, candidates, positions, counts, sparse, masked;
  bool operator==(const StepOutputs&) const = default;
};

// Rows [row_begin, row_end) of a scene, as a source step and a consumer step (the consumer
// reuses the source's q: enough to exercise the kernels).
// With `slotted`, the page table is read as the server's resident tables are (a row per slot,
// RowBatch::request_slot).
StepOutputs RunOnBackend(Backend& backend, Scene& s, int32_t topk, int32_t row_begin,
                         int32_t row_end, const SlottedTable* slotted = nullptr) {
  std::vector<void*> allocations;
  auto keep = [&](auto* p) {
    allocations.push_back(p);
    return p;
  };
  const int32_t rows = row_end - row_begin;
  const int32_t h = s.spec.heads;
  const int32_t vb = s.geometry.value_bytes();
  CacheView cache{keep(Upload(backend, s.pool)), s.num_pages, s.geometry};
  RowBatch batch = s.rows();
  batch.num_rows = rows;
  batch.row_request = keep(Upload(backend, std::vector<int32_t>(s.row_request.begin() + row_begin,
                                                                s.row_request.begin() + row_end)));
  batch.row_length = keep(Upload(backend, std::vector<int32_t>(s.row_length.begin() + row_begin,
                                                               s.row_length.begin() + row_end)));
  batch.page_table = keep(Upload(backend, slotted != nullptr ? slotted->table : s.page_table));
  if (slotted != nullptr) batch.request_slot = keep(Upload(backend, slotted->slots));
  QView q;
  q.num_heads = h;
  q.codes =
      keep(Upload(backend, std::vector<uint8_t>(s.q_codes.begin() + int64_t{row_begin} * h * vb,
                                                s.q_codes.begin() + int64_t{row_end} * h * vb)));
  q.scales = keep(Upload(
      backend,
      std::vector<uint8_t>(s.q_scales.begin() + int64_t{row_begin} * h * (s.spec.head_dim / 32),
                           s.q_scales.begin() + int64_t{row_end} * h * (s.spec.head_dim / 32))));
  q.weights = keep(Upload(backend, std::vector<float>(s.weights.begin() + int64_t{row_begin} * h,
                                                      s.weights.begin() + int64_t{row_end} * h)));
  int32_t* topk_out = keep(Upload(backend, std::vector<int32_t>(rows * topk)));
  int32_t* cand = keep(Upload(backend, std::vector<int32_t>(rows * kBlocks)));
  int32_t* positions = keep(Upload(backend, std::vector<int32_t>(rows * kBlocks * kBs)));
  int32_t* counts = keep(Upload(backend, std::vector<int32_t>(rows)));
  int32_t* sparse_out = keep(Upload(backend, std::vector<int32_t>(rows * topk)));
  int32_t* masked_out = keep(Upload(backend, std::vector<int32_t>(rows * topk)));

  DenseArgs dense{cache, batch, q, topk, topk_out, cand, kBlocks, kBs};
  EXPECT_TRUE(backend.DenseTopK(dense).ok());
  ExpandArgs expand{rows, cand, batch.row_length, kBlocks, kBs, {positions, counts, kBlocks * kBs}};
  EXPECT_TRUE(backend.ForkExpand(expand).ok());
  EXPECT_TRUE(backend.JoinExpand().ok());
  SparseArgs sparse{cache, batch, q, positions, counts, kBlocks * kBs, topk, sparse_out};
  EXPECT_TRUE(backend.SparseTopK(sparse).ok());
  MaskedArgs masked{cache, batch, q, cand, kBlocks, kBs, topk, masked_out};
  EXPECT_TRUE(backend.MaskedTopK(masked).ok());

  StepOutputs out;
  out.topk = Download(backend, topk_out, rows * topk);
  out.candidates = Download(backend, cand, rows * kBlocks);
  out.positions = Download(backend, positions, rows * kBlocks * kBs);
  out.counts = Download(backend, counts, rows);
  out.sparse = Download(backend, sparse_out, rows * topk);
  out.masked = Download(backend, masked_out, rows * topk);
  for (void* p : allocations) backend.Free(p);
  return out;
}

StepOutputs RunFree(Scene& s, int32_t topk) {
  const int32_t rows = s.num_rows();
  StepOutputs out;
  out.topk.resize(rows * topk);
  out.candidates.resize(rows * kBlocks);
  out.positions.resize(rows * kBlocks * kBs);
  out.counts.resize(rows);
  out.sparse.resize(rows * topk);
  out.masked.resize(rows * topk);
  EXPECT_TRUE(cpu::DenseTopK({s.cache(), s.rows(), s.q(), topk, out.topk.data(),
                              out.candidates.data(), kBlocks, kBs})
                  .ok());
  EXPECT_TRUE(cpu::ExpandCandidates({rows,
                                     out.candidates.data(),
                                     s.row_length.data(),
                                     kBlocks,
                                     kBs,
                                     {out.positions.data(), out.counts.data(), kBlocks * kBs}})
                  .ok());
  EXPECT_TRUE(cpu::SparseTopK({s.cache(), s.rows(), s.q(), out.positions.data(), out.counts.data(),
                               kBlocks * kBs, topk, out.sparse.data()})
                  .ok());
  EXPECT_TRUE(cpu::MaskedTopK({s.cache(), s.rows(), s.q(), out.candidates.data(), kBlocks, kBs,
                               topk, out.masked.data()})
                  .ok());
  return out;
}

BackendLimits LimitsFor(const Scene& s, int32_t topk) {
  BackendLimits limits;
  limits.max_rows = s.num_rows();
  limits.max_requests = s.num_requests();
  limits.max_context = *std::max_element(s.row_length.begin(), s.row_length.end());
  limits.num_heads = s.spec.heads;
  limits.head_dim = s.spec.head_dim;
  limits.max_topk = topk;
  limits.max_candidate_positions = kBlocks * kBs;
  return limits;
}

struct BackendCase {
  CacheFormat format;
  int32_t next_n;
  std::vector<int32_t> lengths;
};

class CpuBackendTest : public ::testing::TestWithParam<BackendCase> {
 protected:
  Scene MakeCaseScene() {
    const BackendCase& c = GetParam();
    SceneSpec spec;
    spec.format = c.format;
    spec.heads = 6;
    spec.next_n = c.next_n;
    spec.lengths = c.lengths;
    return MakeScene(spec);
  }
};

TEST_P(CpuBackendTest, EqualsTheFreeFunctionsAndTheOracle) {
  Scene s = MakeCaseScene();
  constexpr int32_t kTopK = 100;
  const StepOutputs want = RunFree(s, kTopK);
  std::unique_ptr<Backend> backend = MakeCpuBackend(LimitsFor(s, kTopK), 4);
  EXPECT_EQ(backend->name(), "cpu");
  EXPECT_EQ(backend->description(), "cpu (4 threads)");
  const StepOutputs got = RunOnBackend(*backend, s, kTopK, 0, s.num_rows());
  EXPECT_TRUE(got == want);
  EXPECT_EQ(got.sparse, got.masked);
  for (int32_t r = 0; r < s.num_rows(); ++r) {
    const std::vector<double> exact = OracleRow(s, r);
    EXPECT_TRUE(CheckTopKRow(got.topk.data() + r * kTopK, kTopK, exact, TopKTolerance(exact)));
  }
}

TEST_P(CpuBackendTest, ResidentTablesAnswerAsThePerCallTable) {
  Scene s = MakeCaseScene();
  constexpr int32_t kTopK = 100;
  std::unique_ptr<Backend> backend = MakeCpuBackend(LimitsFor(s, kTopK), 2);
  std::mt19937_64& rng = PerTestRng();
  const SlottedTable slotted = MakeSlottedTable(s, rng);
  const StepOutputs want = RunOnBackend(*backend, s, kTopK, 0, s.num_rows());
  const StepOutputs got = RunOnBackend(*backend, s, kTopK, 0, s.num_rows(), &slotted);
  EXPECT_TRUE(got == want);
}

TEST_P(CpuBackendTest, ThreadCountAndBatchCompositionDoNotChangeTheAnswer) {
  Scene s = MakeCaseScene();
  constexpr int32_t kTopK = 64;
  std::unique_ptr<Backend> one = MakeCpuBackend(LimitsFor(s, kTopK), 1);
  std::unique_ptr<Backend> four = MakeCpuBackend(LimitsFor(s, kTopK), 4);
  const StepOutputs a = RunOnBackend(*one, s, kTopK, 0, s.num_rows());
  const StepOutputs b = RunOnBackend(*four, s, kTopK, 0, s.num_rows());
  EXPECT_TRUE(a == b);
  // Each request's rows alone (a row shard, or a different batch) answer the same rows.
  const int32_t n = GetParam().next_n;
  for (int32_t req = 0; req < s.num_requests(); ++req) {
    const StepOutputs part = RunOnBackend(*four, s, kTopK, req * n, (req + 1) * n);
    EXPECT_TRUE(std::equal(part.topk.begin(), part.topk.end(), a.topk.begin() + req * n * kTopK));
    EXPECT_TRUE(std::equal(part.candidates.begin(), part.candidates.end(),
                           a.candidates.begin() + req * n * kBlocks));
    EXPECT_TRUE(
        std::equal(part.sparse.begin(), part.sparse.end(), a.sparse.begin() + req * n * kTopK));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Steps, CpuBackendTest,
    ::testing::Values(BackendCase{CacheFormat::kFp8, 1, {300, 45, 1, 130, 64, 200}},
                      BackendCase{CacheFormat::kFp8, 2, {2500}},  // one long row pair
                      BackendCase{CacheFormat::kFp4, 3, {90, 400, 17}},
                      BackendCase{CacheFormat::kFp4, 4, {1200, 33}}),
    [](const ::testing::TestParamInfo<BackendCase>& info) {
      return absl::StrCat(FormatName(info.param.format), "_next", info.param.next_n, "_requests",
                          info.param.lengths.size());
    });

TEST(CpuBackend, PreparationMatchesTheFreeFunctions) {
  SceneSpec spec;
  spec.lengths = {10};
  Scene s = MakeScene(spec);
  std::unique_ptr<Backend> backend = MakeCpuBackend(LimitsFor(s, 16), 2);
  std::mt19937_64& rng = PerTestRng();
  for (CacheFormat format : {CacheFormat::kFp8, CacheFormat::kFp4}) {
    const CacheGeometry g{format, 128, 64};
    std::vector<uint8_t> host_pool(4 * g.page_bytes(), 0);
    uint8_t* pool = Upload(*backend, host_pool);
    std::vector<float> keys(50 * 128);
    FillVectors(rng, 50, 128, keys.data());
    std::vector<int64_t> slots(50);
    for (int i = 0; i < 50; ++i) slots[i] = (i * 97 + 3) % 256;
    float* dev_keys = Upload(*backend, keys);
    int64_t* dev_slots = Upload(*backend, slots);
    KeyInsertArgs insert;
    insert.cache = {pool, 4, g};
    insert.num_keys = 50;
    insert.keys = dev_keys;
    insert.slots = dev_slots;
    insert.hadamard = true;
    ASSERT_TRUE(backend->InsertKeys(insert).ok());
    insert.cache.base = host_pool.data();
    insert.keys = keys.data();
    insert.slots = slots.data();
    ASSERT_TRUE(cpu::InsertKeys(insert).ok());
    EXPECT_EQ(Download(*backend, pool, host_pool.size()), host_pool);
    backend->Free(pool);
    backend->Free(dev_keys);
    backend->Free(dev_slots);
  }
}

TEST(CpuBackend, AllocatesZeroedAlignedMemoryAndCopiesRows) {
  BackendLimits limits;
  std::unique_ptr<Backend> backend = MakeCpuBackend(limits, 0);
  auto mem = backend->Allocate(1000);
  ASSERT_TRUE(mem.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(*mem) % 64, 0u);
  const uint8_t* bytes = static_cast<const uint8_t*>(*mem);
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(bytes[i], 0);
  backend->Free(*mem);

  std::mt19937_64& rng = PerTestRng();
  std::vector<int32_t> src(6 * 5);
  for (int32_t& v : src) v = static_cast<int32_t>(rng() % 1000);
  std::vector<int32_t> dst(4 * 5, -7), src_index = {5, 0, 3}, dst_index = {2, 0, 3};
  CopyRowsArgs args{3,
                    5,
                    Upload(*backend, dst),
                    Upload(*backend, dst_index),
                    Upload(*backend, src),
                    Upload(*backend, src_index)};
  ASSERT_TRUE(backend->CopyRows(args).ok());
  const std::vector<int32_t> got = Download(*backend, args.dst, dst.size());
  for (int i = 0; i < 3; ++i) {
    for (int e = 0; e < 5; ++e) EXPECT_EQ(got[dst_index[i] * 5 + e], src[src_index[i] * 5 + e]);
  }
  for (int e = 0; e < 5; ++e) EXPECT_EQ(got[1 * 5 + e], -7);  // untouched row
  backend->Free(args.dst);
  backend->Free(const_cast<int32_t*>(args.dst_index));
  backend->Free(const_cast<int32_t*>(args.src));
  backend->Free(const_cast<int32_t*>(args.src_index));
}

// The host check (the CPU backend's CheckValues, and the edge's scan) against the per-element
// rule IsBadValue: every type, lengths around the scan's 16- and 64-byte steps and 256-byte
// chunks, tensors starting 0-3 bytes past an aligned address (the request's bytes are where
// protobuf put them), one bad element planted at the first, last, step-edge and random
// positions; a clean tensor sets nothing.
TEST(CpuBackend, CheckValuesFlagsABadElementWhereverItIs) {
  struct Case {
    ElemType type;
    bool positive;
  };
  const Case cases[] = {{ElemType::kF32, false},
                        {ElemType::kF32, true},
                        {ElemType::kBF16, false},
                        {ElemType::kFp8E4M3, false},
                        {ElemType::kUE8M0, false}};
  BackendLimits limits;
  std::unique_ptr<Backend> backend = MakeCpuBackend(limits, 0);
  std::mt19937_64& rng = PerTestRng();
  for (const Case& c : cases) {
    const int32_t eb = CheckedElemBytes(c.type);
    for (const int64_t n : {1,  2,  3,  4,   5,   7,   8,   15,  16,  17,   31,  33,
                            63, 64, 65, 127, 128, 129, 255, 256, 257, 1000, 4099}) {
      for (const size_t skew : {size_t{0}, size_t{1}, size_t{3}}) {
        SCOPED_TRACE(absl::StrCat("type ", static_cast<int>(c.type), " positive ", c.positive,
                                  " n ", n, " skew ", skew));
        std::vector<uint8_t> storage(static_cast<size_t>(n * eb) + 16);
        // Starts `skew` bytes past a 16-byte boundary.
        uint8_t* const base =
            storage.data() + (16 - reinterpret_cast<uintptr_t>(storage.data()) % 16) % 16;
        std::span<uint8_t> data(base + skew, static_cast<size_t>(n * eb));
        auto bits_at = [&](int64_t i) {
          uint32_t bits = 0;
          std::memcpy(&bits, data.data() + i * eb, static_cast<size_t>(eb));
          return bits;
        };
        auto set_bits = [&](int64_t i, uint32_t bits) {
          std::memcpy(data.data() + i * eb, &bits, static_cast<size_t>(eb));
        };
        const uint32_t mask = eb == 4 ? 0xFFFFFFFFu : (1u << (8 * eb)) - 1;
        for (int64_t i = 0; i < n; ++i) {  // random good elements
          uint32_t bits;
          do bits = static_cast<uint32_t>(rng()) & mask;
          while (IsBadValue(c.type, bits, c.positive));
          set_bits(i, bits);
        }
        // Bad elements of this type: NaN / Inf codes, and for positive scales 0, -0, negatives.
        std::vector<uint32_t> bads;
        while (bads.size() < 64) {
          const uint32_t bits = static_cast<uint32_t>(rng()) & mask;
          if (IsBadValue(c.type, bits, c.positive)) bads.push_back(bits);
        }
        for (uint32_t forced : {0x7F800000u, 0x80000000u, 0u, 0xBF800000u}) {
          if (eb == 4 && IsBadValue(c.type, forced, c.positive)) bads.push_back(forced);
        }
        // The flag words as their mask (bit w: word w set), from words holding `start`'s mask.
        auto check = [&](bool accumulate, uint32_t start) {
          uint32_t words[kValueFlagWords];
          for (int w = 0; w < kValueFlagWords; ++w) words[w] = (start >> w) & 1u ? 7u : 0u;
          ValueCheckArgs args;
          args.checks[0] = {data.data(), n, c.type, 4u, c.positive};
          args.num_checks = 1;
          args.flags = words;
          args.accumulate = accumulate;
          EXPECT_TRUE(backend->CheckValues(args).ok());
          return ValueFlagsMask(words);
        };
        EXPECT_EQ(check(false, 0xFFu), 0u);
        EXPECT_EQ(check(true, 1u), 1u);
        std::vector<int64_t> where = {0, n - 1};
        for (int64_t edge : {16 / eb, 64 / eb, 256 / eb}) {
          where.push_back(std::min<int64_t>(n - 1, edge - 1));
          where.push_back(std::min<int64_t>(n - 1, edge));
        }
        for (int r = 0; r < 4; ++r) where.push_back(static_cast<int64_t>(rng() % n));
        for (const int64_t i : where) {
          const uint32_t good = bits_at(i);
          // Every 7th random bad one, and every forced one (the last few).
          for (size_t b = 0; b < bads.size();
               b = b + 7 < 64 ? b + 7 : std::max<size_t>(b + 1, 64)) {
            set_bits(i, bads[b]);
            EXPECT_EQ(check(false, 0u), 4u) << "bad bits " << bads[b] << " at " << i;
            EXPECT_EQ(check(true, 1u), 5u);
          }
          set_bits(i, good);
        }
      }
    }
  }
}

TEST(CpuBackend, RejectsPagesOutsideThePool) {
  SceneSpec spec;
  spec.lengths = {100, 50};
  Scene s = MakeScene(spec);
  s.page_table[1] = static_cast<int32_t>(s.num_pages);  // request 0, page 1
  std::vector<int32_t> out(2 * 16);
  const absl::Status st = cpu::DenseTopK({s.cache(), s.rows(), s.q(), 16, out.data()});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
}

TEST(CudaEntryPoints, ErrorWithoutAUsableGpu) {
  if (CudaBackendAvailable()) GTEST_SKIP() << "a GPU is present";
  BackendLimits limits;
  EXPECT_FALSE(MakeCudaBackend(limits, 0).ok());
}

}  // namespace
}  // namespace decode_indexer::testing
