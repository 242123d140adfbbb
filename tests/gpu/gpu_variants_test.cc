// The comparison variants of the dense logits (bench/cuda/variants/, built only with the
// benchmarks) against the production exact kernel (MqaMath::kWgmmaKeysMPipelined): every entry
// bit for bit, on grids of 1, 3 and all SMs, nothing written past a row's length; and the keys-M
// variant's threshold-filter histogram against the logits it wrote. These are the bit-equality
// checks that used to live in gpu_test beside the variants when they were in the product.
//
// Skipped (visibly) where no GPU is visible, as in CI.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include "bench/cuda/variants/fp4_variants.h"
#include "bench/cuda/variants/mqa_variants.h"
#include "bench/cuda/variants/sparse_logits_variants.h"
#include "gtest/gtest.h"
#include "kernels/cuda/sm90_launchers.h"
#include "kernels/cuda/sm90_tile_config.h"
#include "kernels/cuda/sm90_topk_bucket.cuh"
#include "tests/gpu/gpu_test_util.h"
#include "tests/kernels/kernel_test_util.h"

namespace decode_indexer::testing {
namespace {

using namespace gpu;  // NOLINT: the shared fixture and scene helpers (gpu_test_util.h)
using kernels::cuda::MqaMath;
using kernels::cuda::MqaVariant;
using kernels::cuda::SparseLogitsMath;
using kernels::cuda::SparseVariant;

std::vector<float> VariantLogits(GpuTest* t, DeviceScene& ds, int64_t stride, int num_sms,
                                 MqaVariant v) {
  return GpuLogitsWith(
      t, ds, stride, num_sms,
      [&](kernels::cuda::PagedLogitsArgs& a) {
        return kernels::cuda::MqaVariantNeedsSchedule(v, a);
      },
      [&](const kernels::cuda::PagedLogitsArgs& a, int sms) {
        return kernels::cuda::LaunchMqaVariant(v, a, sms, nullptr);
      });
}

// `full` (next_n rows a request, a request's rows adjacent) with request b keeping only its
// last keep(b) rows (0: none); every request keeps its keys.
template <typename Keep>
Scene KeepLastRows(const Scene& full, int32_t next_n, Keep&& keep) {
  Scene s = full;
  s.row_request.clear();
  s.row_length.clear();
  s.q_codes.clear();
  s.weights.clear();
  const int64_t qrow = 64 * 128;
  for (int32_t r = 0; r < full.num_rows(); ++r) {
    const int32_t b = full.row_request[r], j = r % next_n;
    if (j < next_n - keep(b)) continue;
    s.row_request.push_back(b);
    s.row_length.push_back(full.row_length[r]);
    s.q_codes.insert(s.q_codes.end(), full.q_codes.begin() + r * qrow,
                     full.q_codes.begin() + (r + 1) * qrow);
    s.weights.insert(s.weights.end(), full.weights.begin() + r * 64,
                     full.weights.begin() + (r + 1) * 64);
  }
  return s;
}

// A rank's slice of a sharded step (gpu_test's RankSliceWithRowsPerRequestHint): 64 requests
// named, rows of requests 32-63 only with uneven counts (one request none), the host hint set.
Scene RankSlice(int32_t next_n, int32_t* most) {
  Scene full = MakeScene(Spec(CacheFormat::kFp8, 64, Lengths(64, 2500), next_n));
  Scene s = KeepLastRows(full, next_n, [&](int32_t b) {
    return b < 32 || b == 40 ? 0 : b % 5 == 1 ? 1 : b % 5 == 2 ? next_n - 1 : next_n;
  });
  *most = MostRows(s);
  return s;
}

// Request b keeps its last next_n - (b % next_n) rows, request 1 none.
Scene Thin(const Scene& full, int32_t next_n) {
  return KeepLastRows(full, next_n, [&](int32_t b) { return b == 1 ? 0 : next_n - (b % next_n); });
}

// The fp8 variants against the production fp8 kernel: kFp8V1 (its earlier consumer and
// producer: the same wgmmas) equals it up to the epilogue's fp32 summation order (a few ulps of
// the entry's head sum; a wrong swizzle, scale or weight slot would be off by the entry's own
// size), the shape-choice variants bit for bit; nothing written past a row's length, each
// variant's bits the same on every grid.
TEST_F(GpuTest, Fp8VariantsMatchTheProductionFp8Kernel) {
  struct Case {
    std::vector<int32_t> lengths;
    int32_t next_n;
    bool uneven;
  };
  const std::vector<Case> cases = {
      {Lengths(5, 20000), 1, false}, {{7000, 64, 65, 2, 13000}, 2, false},
      {Lengths(3, 9000), 3, false},  {Lengths(2, 7000), 4, false},
      {Lengths(4, 6000), 2, true},   {{100, 2047, 2048, 2049, 5000}, 1, false},
      {Lengths(300, 150), 2, false},
  };
  for (const Case& c : cases) {
    Scene s = MakeScene(Spec(CacheFormat::kFp8, 64, c.lengths, c.next_n));
    if (c.uneven) MakeUneven(s);
    auto ds = UploadScene(this, s);
    const int32_t rows = s.num_rows();
    const int64_t stride = (ds->rows.max_row_length + 3) / 4 * 4;
    const std::vector<float> ref =
        GpuLogits(this, *ds, stride, NumSms(), MqaMath::kWgmmaKeysMPipelinedFp8);
    for (const MqaVariant v : kernels::cuda::kFp8MqaVariants) {
      std::vector<float> first;
      for (const int num_sms : {1, 3, NumSms()}) {
        SCOPED_TRACE(::testing::Message()
                     << "requests " << s.num_requests() << " rows " << rows << " next_n "
                     << c.next_n << " uneven " << c.uneven << " variant "
                     << kernels::cuda::MqaVariantName(v) << " sms " << num_sms);
        // Printed before the launch: a variant that hangs is named in the log (a trace
        // prints only on a failure, which a hang never reaches).
        std::fprintf(stderr, "[ variant  ] %s, requests %d, next_n %d, sms %d\n",
                     kernels::cuda::MqaVariantName(v), s.num_requests(), c.next_n, num_sms);
        const std::vector<float> got = VariantLogits(this, *ds, stride, num_sms, v);
        int64_t off = 0, past = 0, checked = 0;
        for (int32_t r = 0; r < rows; ++r) {
          float row_max = 0.f;
          for (int32_t t = 0; t < s.row_length[r]; ++t) {
            row_max = std::max(row_max, std::fabs(ref[r * stride + t]));
          }
          for (int32_t t = 0; t < s.row_length[r]; ++t) {
            const int64_t i = r * stride + t;
            ++checked;
            off += !(std::fabs(got[i] - ref[i]) <= 1e-5f * row_max);
          }
          for (int64_t t = s.row_length[r]; t < stride; ++t) {
            past += !std::isnan(got[r * stride + t]);
          }
        }
        EXPECT_GT(checked, 0);
        EXPECT_EQ(off, 0) << "entries off the production fp8 kernel's by more than 1e-5 of the "
                             "row's largest";
        if (kernels::cuda::MqaVariantSameBitsAsFp8(v)) {
          int64_t diff = 0;
          for (int32_t r = 0; r < rows; ++r) {
            for (int32_t t = 0; t < s.row_length[r]; ++t) {
              diff += std::memcmp(&got[r * stride + t], &ref[r * stride + t], sizeof(float)) != 0;
            }
          }
          EXPECT_EQ(diff, 0) << "a shape choice changed a logit bit";
        }
        EXPECT_EQ(past, 0) << "entries written past the row's length";
        if (first.empty()) {
          first = got;
        } else {
          EXPECT_EQ(std::memcmp(first.data(), got.data(), sizeof(float) * got.size()), 0)
              << "the variant's bits depend on the grid";
        }
      }
    }
  }
}

// The fp8 kernel's wide block (kFp8Wide: four warpgroups sharing a request's q, where the host
// hint says 1-4 rows a request) against the production fp8 kernel, bit for bit, where the wide
// block's bookkeeping can go wrong: requests with fewer rows than the hint (zero q rows in a pair),
// a request without rows, requests of one to three tiles (warpgroups skip whole requests and must
// still release their q stages), page boundaries, one long row, more requests than the in-block
// schedule takes, grids of 1, 3 and all SMs; NaN-poisoned outputs stay NaN past every length.
TEST_F(GpuTest, Fp8WideVariantEqualsTheProductionKernel) {
  struct Case {
    std::vector<int32_t> lengths;
    int32_t next_n;
    bool thin;  // request b keeps next_n - (b % next_n) rows, request 1 none
  };
  const std::vector<Case> cases = {
      {Lengths(5, 20000), 1, false},
      {{7000, 64, 65, 2, 13000}, 2, false},
      {Lengths(3, 9000), 3, false},
      {Lengths(2, 7000), 4, false},
      {Lengths(9, 5000), 4, true},
      {Lengths(7, 3000), 2, true},
      {{100, 2047, 2048, 2049, 5000}, 1, false},
      {{131072 + 77}, 1, false},
      {Lengths(40, 64), 2, false},
      {Lengths(61, 150), 3, true},
      {Lengths(300, 150), 1, false},
      {Lengths(300, 150), 2, false},
  };
  for (const Case& c : cases) {
    Scene s = MakeScene(Spec(CacheFormat::kFp8, 64, c.lengths, c.next_n));
    if (c.thin) s = Thin(s, c.next_n);
    auto ds = UploadScene(this, s);
    const int32_t rows = s.num_rows();
    const int64_t stride = (ds->rows.max_row_length + 3) / 4 * 4;
    ds->rows.rows_per_request = MostRows(s);
    ASSERT_TRUE(kernels::cuda::Fp8WideTakes(ds->rows)) << "the case would not reach the wide block";
    const std::vector<float> one =
        GpuLogits(this, *ds, stride, NumSms(), MqaMath::kWgmmaKeysMPipelinedFp8);
    for (const int num_sms : {NumSms(), 1, 3}) {
      SCOPED_TRACE(::testing::Message()
                   << "requests " << s.num_requests() << " rows " << rows << " next_n " << c.next_n
                   << " thin " << c.thin << " sms " << num_sms);
      const std::vector<float> wide =
          VariantLogits(this, *ds, stride, num_sms, MqaVariant::kFp8Wide);
      int64_t diff = 0, unwritten = 0, past = 0;
      for (int32_t r = 0; r < rows; ++r) {
        for (int32_t t = 0; t < s.row_length[r]; ++t) {
          const int64_t i = r * stride + t;
          diff += std::memcmp(&wide[i], &one[i], sizeof(float)) != 0;
          unwritten += std::isnan(wide[i]);
        }
        for (int64_t t = s.row_length[r]; t < stride; ++t)
          past += !std::isnan(wide[r * stride + t]);
      }
      EXPECT_EQ(unwritten, 0) << "entries the wide block did not write";
      EXPECT_EQ(diff, 0) << "entries not bit-identical to the production fp8 kernel";
      EXPECT_EQ(past, 0) << "entries written past the row's length";
    }
  }
}

// The production fp8 kernel's run-ordered loop (one request's run of tiles at a time, a run scored
// once per pass with its pages produced again, one logit stored per lane) against the kernel it
// replaced (kFp8PerPage: per-page bookkeeping, every row's epilogue behind its own checks), bit
// for bit, where the run-ordered bookkeeping can go wrong: several passes (the host hint below
// the rows of a request, or no hint with uneven rows: the run produced and scored again, q
// reloaded per pass), requests without rows or with fewer rows than a pass (a lane whose row
// is past the request's stores nothing), runs of one to three tiles and runs cut by the block's
// range (grids of 1, 3 and all SMs), a long row, more requests than the in-block schedule
// takes; NaN-poisoned outputs written at every position of every row and nowhere past it.
TEST_F(GpuTest, Fp8PerPageVariantEqualsTheProductionKernel) {
  struct Case {
    std::vector<int32_t> lengths;
    int32_t next_n;
    bool thin;     // request b keeps next_n - (b % next_n) rows, request 1 none
    bool uneven;   // request 0 takes most rows (MakeUneven): several passes without a hint
    int32_t hint;  // RowBatch::rows_per_request (0: none)
  };
  const std::vector<Case> cases = {
      {Lengths(5, 20000), 1, false, false, 0},
      {{7000, 64, 65, 2, 13000}, 2, false, false, 0},
      {Lengths(3, 9000), 3, false, false, 0},
      {Lengths(2, 7000), 4, false, false, 0},
      {Lengths(9, 5000), 4, true, false, 0},
      {Lengths(7, 3000), 2, true, false, 2},
      {Lengths(4, 6000), 2, false, true, 0},
      {Lengths(6, 4000), 3, false, false, 1},  // three passes of one row
      {Lengths(5, 3000), 4, true, false, 2},   // two passes of two, some requests thin
      {Lengths(3, 2500), 3, false, true, 2},   // uneven: up to four passes of two
      {{100, 2047, 2048, 2049, 5000}, 1, false, false, 0},
      {{131072 + 77}, 1, false, false, 0},
      {Lengths(40, 64), 2, false, false, 0},
      {Lengths(61, 150), 3, true, false, 0},
      {Lengths(300, 150), 1, false, false, 0},
      {Lengths(300, 150), 2, true, false, 1},  // the global schedule, two passes
  };
  for (const Case& c : cases) {
    Scene s = MakeScene(Spec(CacheFormat::kFp8, 64, c.lengths, c.next_n));
    if (c.thin) s = Thin(s, c.next_n);
    if (c.uneven) MakeUneven(s);
    auto ds = UploadScene(this, s);
    const int32_t rows = s.num_rows();
    const int64_t stride = (ds->rows.max_row_length + 3) / 4 * 4;
    ds->rows.rows_per_request = c.hint;
    const std::vector<float> one =
        GpuLogits(this, *ds, stride, NumSms(), MqaMath::kWgmmaKeysMPipelinedFp8);
    for (const MqaVariant v : {MqaVariant::kFp8PerPage}) {
      for (const int num_sms : {NumSms(), 1, 3}) {
        SCOPED_TRACE(::testing::Message()
                     << "requests " << s.num_requests() << " rows " << rows << " next_n "
                     << c.next_n << " thin " << c.thin << " uneven " << c.uneven << " hint "
                     << c.hint << " sms " << num_sms);
        std::fprintf(stderr, "[ variant  ] %s, requests %d, next_n %d, hint %d, sms %d\n",
                     kernels::cuda::MqaVariantName(v), s.num_requests(), c.next_n, c.hint, num_sms);
        const std::vector<float> per_page = VariantLogits(this, *ds, stride, num_sms, v);
        int64_t diff = 0, unwritten = 0, past = 0;
        for (int32_t r = 0; r < rows; ++r) {
          for (int32_t t = 0; t < s.row_length[r]; ++t) {
            const int64_t i = r * stride + t;
            diff += std::memcmp(&per_page[i], &one[i], sizeof(float)) != 0;
            unwritten += std::isnan(per_page[i]);
          }
          for (int64_t t = s.row_length[r]; t < stride; ++t)
            past += !std::isnan(per_page[r * stride + t]);
        }
        EXPECT_EQ(unwritten, 0) << "entries the per-page kernel did not write";
        EXPECT_EQ(diff, 0) << "entries not bit-identical to the production fp8 kernel";
        EXPECT_EQ(past, 0) << "entries written past the row's length";
      }
    }
  }
}

// At the shape where the fp8 logits + top-k answered differently between runs on an H100
// (gpu_test's DenseTopKBitIdenticalAcrossRuns, session 16: 8 requests x ~20000, next_n 2), the
// production fp8 kernel and the per-page kernel it replaced, five launches each on fresh
// NaN-poisoned outputs: every launch writes every position of every row, the same bits each
// time and the same bits as the other kernel. Session 17: the run-ordered kernel differed in 11
// of 50 launches, the per-page one in none, until both released a ring slot only after its
// logits were stored (sm90_paged_mqa_logits_fp8.cuh, score_page); it stays as the guard.
// The FP4 kernel's variants (fp4_variants.h: other blocks per SM, the group wgmmas in two
// rounds) give the production FP4 kernel's logits bit for bit: next_n 1-4 and 5 (two passes),
// rows shorter and longer than K, more requests than the kernel schedules itself, a row whose q
// scales do not fold, grids of every SM, 1 and 3 blocks' worth.
TEST_F(GpuTest, Fp4VariantsEqualTheProductionKernel) {
  for (const Fp4Case& c : Fp4KernelCases()) {
    Scene s = MakeScene(Spec(CacheFormat::kFp4, 32, c.lengths, c.next_n));
    uint8_t& b = s.q_scales[(int64_t{0} * 32 + 5) * 4 + 2];  // row 0 does not fold
    b = static_cast<uint8_t>(b > 127 ? b - 12 : b + 12);
    auto ds = UploadScene(this, s);
    const int32_t rows = s.num_rows();
    const int64_t stride = (ds->rows.max_row_length + 3) / 4 * 4;
    const std::vector<float> production = GpuLogits(this, *ds, stride, NumSms());
    for (const kernels::cuda::Fp4Variant v : kernels::cuda::kAllFp4Variants) {
      for (const int num_sms : {NumSms(), 1, 3}) {
        SCOPED_TRACE(::testing::Message()
                     << kernels::cuda::Fp4VariantName(v) << " next_n " << c.next_n << " requests "
                     << s.num_requests() << " sms " << num_sms);
        const std::vector<float> got = GpuLogitsWith(
            this, *ds, stride, num_sms,
            [](kernels::cuda::PagedLogitsArgs& a) {
              return kernels::cuda::PagedLogitsNeedsSchedule(a);
            },
            [&](const kernels::cuda::PagedLogitsArgs& a, int sms) {
              return kernels::cuda::LaunchFp4Variant(v, a, sms, nullptr);
            });
        int64_t diff = 0, past = 0;
        for (int32_t r = 0; r < rows; ++r) {
          for (int32_t t = 0; t < s.row_length[r]; ++t) {
            const int64_t i = r * stride + t;
            diff += std::memcmp(&got[i], &production[i], sizeof(float)) != 0;
          }
          for (int64_t t = s.row_length[r]; t < stride; ++t)
            past += !std::isnan(got[r * stride + t]);
        }
        EXPECT_EQ(diff, 0) << "logits not the production FP4 kernel's bits";
        EXPECT_EQ(past, 0) << "written past a row's length";
      }
    }
  }
}

TEST_F(GpuTest, Fp8KernelsRepeatAtTheDenseTopKShape) {
  Scene s = MakeScene(Spec(CacheFormat::kFp8, 64, Lengths(8, 20000), 2));
  auto ds = UploadScene(this, s);
  const int64_t stride = (ds->rows.max_row_length + 3) / 4 * 4;
  const std::vector<float> first =
      GpuLogits(this, *ds, stride, NumSms(), MqaMath::kWgmmaKeysMPipelinedFp8);
  for (int run = 0; run < 5; ++run) {
    for (const bool per_page : {false, true}) {
      SCOPED_TRACE(::testing::Message()
                   << (per_page ? "per-page kernel" : "production kernel") << ", run " << run);
      const std::vector<float> got =
          per_page ? VariantLogits(this, *ds, stride, NumSms(), MqaVariant::kFp8PerPage)
                   : GpuLogits(this, *ds, stride, NumSms(), MqaMath::kWgmmaKeysMPipelinedFp8);
      const LogitsDiff d = CompareLogits(s, stride, first, got);
      EXPECT_EQ(d.unwritten, 0) << "entries not written";
      EXPECT_EQ(d.differ, 0) << "entries that differ from the production kernel's first launch:"
                             << d.first;
    }
  }
}

// Every variant gives the exact kernel's logits bit for bit: next_n 1-4, uneven row counts
// (several passes, empty second rows of a pair), a long row, more requests than the in-block
// schedule takes, a rank slice with and without the rows-per-request hint.
TEST_F(GpuTest, VariantsBitIdenticalToTheExactKernel) {
  struct Case {
    std::vector<int32_t> lengths;
    int32_t next_n;
    bool uneven;
    bool rank_slice;
  };
  const std::vector<Case> cases = {
      {Lengths(5, 20000), 1, false, false},
      {{7000, 64, 65, 2, 13000}, 2, false, false},
      {Lengths(3, 9000), 3, false, false},
      {Lengths(2, 7000), 4, false, false},
      {Lengths(4, 6000), 2, true, false},
      {Lengths(3, 5000), 3, true, false},
      {{100, 2047, 2048, 2049, 5000}, 1, false, false},
      {{131072 + 77}, 1, false, false},
      {Lengths(300, 150), 1, false, false},
      {Lengths(300, 150), 2, false, false},
      {{}, 2, false, true},
      {{}, 4, false, true},
  };
  for (const Case& c : cases) {
    int32_t most = 0;
    Scene s = c.rank_slice ? RankSlice(c.next_n, &most)
                           : MakeScene(Spec(CacheFormat::kFp8, 64, c.lengths, c.next_n));
    if (c.uneven) MakeUneven(s);
    auto ds = UploadScene(this, s);
    const int32_t rows = s.num_rows();
    const int64_t stride = (ds->rows.max_row_length + 3) / 4 * 4;
    for (const int32_t hint : c.rank_slice ? std::vector<int32_t>{most, 0} : std::vector{0}) {
      ds->rows.rows_per_request = hint;
      const std::vector<float> ref =
          GpuLogits(this, *ds, stride, NumSms(), MqaMath::kWgmmaKeysMPipelined);
      for (const MqaVariant v : kernels::cuda::kAllMqaVariants) {
        for (const int num_sms : {1, 3, NumSms()}) {
          SCOPED_TRACE(::testing::Message()
                       << "requests " << s.num_requests() << " rows " << rows << " next_n "
                       << c.next_n << " uneven " << c.uneven << " rank slice " << c.rank_slice
                       << " hint " << hint << " variant " << kernels::cuda::MqaVariantName(v)
                       << " sms " << num_sms);
          const std::vector<float> got = VariantLogits(this, *ds, stride, num_sms, v);
          int64_t diff = 0, past = 0;
          for (int32_t r = 0; r < rows; ++r) {
            for (int32_t t = 0; t < s.row_length[r]; ++t) {
              const int64_t i = r * stride + t;
              diff += std::memcmp(&got[i], &ref[i], sizeof(float)) != 0;
            }
            for (int64_t t = s.row_length[r]; t < stride; ++t) {
              past += !std::isnan(got[r * stride + t]);
            }
          }
          EXPECT_EQ(diff, 0) << "entries not bit-identical to the exact kernel";
          EXPECT_EQ(past, 0) << "entries written past the row's length";
        }
      }
    }
  }
}

// The keys-M variant's threshold filter: the histogram its epilogue builds equals the histogram
// of the sample of the logits it wrote (every grid size). Cases: one row per request, 2 and 3
// rows per pass, a request with more rows than a pass holds (its later rows count straight into
// global memory), and a long row on a tiny grid (blocks of > 1023 tiles flush their 16-bit
// counts early).
TEST_F(GpuTest, KeysMEpilogueHistogramMatchesItsLogits) {
  for (const HistogramCase& c : HistogramCases()) {
    SCOPED_TRACE(Describe(c));
    Scene s = MakeHistogramScene(c);
    auto ds = UploadScene(this, s);
    const int32_t rows = s.num_rows();
    const int64_t stride = (ds->rows.max_row_length + 3) / 4 * 4;
    const int64_t bins = kernels::cuda::kTopKBins;
    DeviceBuffer dlog = Poisoned<float>(rows * stride, NAN);
    DeviceBuffer dhist = Upload(std::vector<uint32_t>(rows * bins, 0u));
    kernels::cuda::PagedLogitsArgs la;
    la.cache = ds->cache;
    la.rows = ds->rows;
    la.q = ds->q;
    la.logits = dlog.as<float>();
    la.logits_stride = stride;
    la.row_histogram = dhist.as<uint32_t>();
    const MqaVariant v = MqaVariant::kWgmmaKeysMFused;  // the variant with the hook
    ASSERT_TRUE(kernels::cuda::MqaVariantFillsHistogram(v));
    ASSERT_FALSE(kernels::cuda::MqaVariantNeedsSchedule(v, la));
    ASSERT_TRUE(backend_->Synchronize().ok());
    ASSERT_TRUE(kernels::cuda::LaunchMqaVariant(v, la, c.num_sms, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<float> logits = Download<float>(dlog, rows * stride);
    const std::vector<uint32_t> hist = Download<uint32_t>(dhist, rows * bins);
    for (int32_t r = 0; r < rows; ++r) {
      std::vector<uint32_t> want(bins, 0u);
      for (int32_t t = 0; t < s.row_length[r]; t += kernels::cuda::kTopKSampleStride) {
        ++want[kernels::cuda::TopKBucket(HostOrderedKey(logits[r * stride + t]))];
      }
      EXPECT_TRUE(std::equal(want.begin(), want.end(), hist.begin() + r * bins)) << "row " << r;
    }
  }
}

// Variants take FP8 / 64 heads only.
TEST_F(GpuTest, VariantsRefuseOtherShapes) {
  Scene s = MakeScene(Spec(CacheFormat::kFp4, 32, {3000}, 1));
  auto ds = UploadScene(this, s);
  kernels::cuda::PagedLogitsArgs a;
  a.cache = ds->cache;
  a.rows = ds->rows;
  a.q = ds->q;
  for (const MqaVariant v : kernels::cuda::kAllMqaVariants) {
    EXPECT_EQ(kernels::cuda::LaunchMqaVariant(v, a, NumSms(), nullptr).code(),
              absl::StatusCode::kInvalidArgument)
        << kernels::cuda::MqaVariantName(v);
  }
}

// The tensor-core sparse kernel's production kMmaPairLeanOcc and its comparison variants
// (bench/cuda/variants/sparse_logits_variants.h) against the CPU and kMma: FP4 32 heads (the
// consumer's shape), 20 heads (padded n-tile), 48 heads (wide), and FP8 64 heads (which every
// variant runs with kMma's kernel: bit-identical to it). kMmaPair, kMmaQShared,
// kMmaPairLeanCopy, kMmaPairLean and kMmaPairLeanOcc compute kMma's sums in kMma's order:
// bit-identical to it everywhere; the folded ones (kMmaFolded, kMmaFoldedPair) within the
// tolerance. About 1 in 6 cache slots gets one group
// scale lowered so that the key's groups lie 23 (still folded, the edge), 24 (not folded) or 18-30
// binades apart: those keys take the group-scaled path inside a tile of folded keys. Row 1 has q
// scales kMma does not fold (the row runs kMma's unfolded path). Shuffled page tables, candidate
// blocks of 8, counts shorter and longer than K, poisoned outputs; a logit depends only on (row,
// position): across runs, list orders and other rows' counts.
TEST_F(GpuTest, SparseLogitsMmaVariantsMatchCpuAndMma) {
  using kernels::cuda::SparseLogitsMath;
  struct Case {
    CacheFormat format;
    int32_t heads;
  };
  for (const Case c : {Case{CacheFormat::kFp4, 32}, Case{CacheFormat::kFp8, 64},
                       Case{CacheFormat::kFp4, 20}, Case{CacheFormat::kFp4, 48}}) {
    SCOPED_TRACE(::testing::Message()
                 << "format " << static_cast<int>(c.format) << " heads " << c.heads);
    Scene s = MakeScene(Spec(c.format, c.heads, {15000, 300, 6000}, 2));
    const bool fp4 = c.format == CacheFormat::kFp4;
    const kernels::CacheGeometry& geo = s.geometry;
    // Which slots' keys fold (FP4): all 4 group scale bytes in [1, 254], at most 23 apart.
    std::vector<uint8_t> slot_folds(s.num_pages * geo.page_size, 1);
    if (fp4) {
      uint8_t& b = s.q_scales[(int64_t{1} * c.heads + c.heads / 2) * 4 + 3];
      b = b > 127 ? b - 24 : b + 24;
      std::uniform_int_distribution<int> pick(0, 5), grp(0, 3), spread(18, 30), mode(0, 2);
      for (int64_t page = 0; page < s.num_pages; ++page) {
        for (int32_t o = 0; o < geo.page_size; ++o) {
          uint8_t* sc = s.pool.data() + page * geo.page_bytes() +
                        int64_t{geo.page_size} * geo.value_bytes() + int64_t{o} * 4;
          if (pick(Rng()) == 0) {
            const uint8_t top = *std::max_element(sc, sc + 4);
            const int m = mode(Rng());
            const int d = m == 0 ? 23 : m == 1 ? 24 : spread(Rng());
            if (top - d >= 1) sc[grp(Rng())] = static_cast<uint8_t>(top - d);
          }
          const uint8_t top = *std::max_element(sc, sc + 4), low = *std::min_element(sc, sc + 4);
          slot_folds[page * geo.page_size + o] = low >= 1 && top <= 254 && top - low <= 23;
        }
      }
    }
    auto ds = UploadScene(this, s);
    const int32_t rows = s.num_rows();
    const CandidatePositions cp = MakeCandidatePositions(s, /*bs=*/8, /*nb=*/2048);
    const int32_t maxp = cp.maxp;
    const std::vector<int32_t>&pos = cp.pos, &shuf = cp.shuf, &cnt = cp.cnt;
    int64_t folded = 0, unfolded = 0;  // listed positions whose keys fold / do not
    for (int32_t r = 0; r < rows; ++r) {
      for (int32_t i = 0; i < cnt[r]; ++i) {
        const int32_t p = pos[int64_t{r} * maxp + i];
        const int32_t page = s.page_table[int64_t{s.row_request[r]} * s.stride + p / geo.page_size];
        (slot_folds[int64_t{page} * geo.page_size + p % geo.page_size] ? folded : unfolded)++;
      }
    }
    ASSERT_LT(cnt[2], 512);
    ASSERT_GT(cnt[0], 512);
    if (fp4) {
      ASSERT_GT(unfolded, 100) << "the test needs keys that do not fold";
      ASSERT_GT(folded, 4 * unfolded);  // about 8% do not fold
    }
    DeviceBuffer dpos = Upload(pos), dshuf = Upload(shuf), dcnt = Upload(cnt);
    const std::vector<float> mma =
        GpuSparseLogits(this, *ds, dpos, dcnt, maxp, SparseLogitsMath::kMma);
    std::vector<std::vector<float>> cpu(rows);
    for (int32_t r = 0; r < rows; ++r) {
      cpu[r].resize(cnt[r]);
      kernels::cpu::RowLogitsAt(s.cache(), s.rows(), s.q(), r, pos.data() + int64_t{r} * maxp,
                                cnt[r], cpu[r].data());
    }
    // Production kMmaPairLeanOcc first, then every variant.
    struct Kind {
      const char* name;
      SparseLaunch launch;
      bool same_bits;
    };
    std::vector<Kind> kinds = {
        {"kMmaPairLeanOcc", ProductionSparse(SparseLogitsMath::kMmaPairLeanOcc), true}};
    for (const SparseVariant v : kernels::cuda::kAllSparseVariants) {
      kinds.push_back(
          {kernels::cuda::SparseVariantName(v),
           [v](const DeviceScene& d, const int32_t* p, const int32_t* n, int32_t m, float* out) {
             return kernels::cuda::LaunchSparseLogitsVariant(v, d.cache, d.rows, d.q, p, n, m, out,
                                                             nullptr);
           },
           kernels::cuda::SparseVariantSameBitsAsMma(v)});
    }
    for (const Kind& kind : kinds) {
      SCOPED_TRACE(::testing::Message() << "kind " << kind.name);
      const std::vector<float> got = GpuSparseLogits(this, *ds, dpos, dcnt, maxp, kind.launch);
      if (!fp4 || kind.same_bits) {
        EXPECT_EQ(0, std::memcmp(got.data(), mma.data(), 4 * got.size()))
            << "kMma's sums in kMma's order: bit-identical";
      }
      double worst = 0.0;
      for (int32_t r = 0; r < rows; ++r) {
        const int64_t o = int64_t{r} * maxp;
        const double tol = RowTol(cpu[r]);
        int64_t bad = 0, written_past = 0;
        for (int32_t i = 0; i < cnt[r]; ++i) {
          const double err = std::fabs(double{got[o + i]} - cpu[r][i]);
          if (!(err <= tol)) ++bad;  // NaN (unwritten) counts as bad
          if (!(std::fabs(double{got[o + i]} - mma[o + i]) <= 2 * tol)) ++bad;
          worst = std::max(worst, err / (tol / kLogitRelTol));
        }
        for (int32_t i = cnt[r]; i < maxp; ++i) written_past += !std::isnan(got[o + i]);
        EXPECT_EQ(bad, 0) << "row " << r << " count " << cnt[r];
        EXPECT_EQ(written_past, 0) << "row " << r << ": written past its count";
      }
      std::printf(
          "  [sparse mma %s] format %d heads %d: max |got-cpu| / row max = %.3g "
          "(%lld folded, %lld unfolded keys listed)\n",
          kind.name, static_cast<int>(c.format), c.heads, worst, static_cast<long long>(folded),
          static_cast<long long>(unfolded));
      ExpectLogitsDependOnlyOnRowAndPosition(this, *ds, s, pos, shuf, cnt, dpos, dshuf, dcnt, maxp,
                                             kind.launch, got, 533);
    }
  }
}

}  // namespace
}  // namespace decode_indexer::testing
