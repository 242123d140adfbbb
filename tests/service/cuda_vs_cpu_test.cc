// A --backend=cuda server against a cpu one and the independent reference, through the API.
// What is compared is printed and checked:
//  - CudaServerMatchesReference (any GPU count): the CPU server and the CUDA server (1 rank)
//    each against the reference (di_reference) by the spec's section-6 rule (the CPU within
//    fp32 rounding, 4 fp32 ulps of the row's largest logit; CUDA within kCudaUlps),
//    candidate blocks included; lengths equal.
//  - CudaRanksAgree (2+ GPUs only; skipped, saying so, with fewer): 1 rank vs 2 ranks
//    bit-identical (spec section 6: same backend, any rank count), and 2 ranks against the
//    reference.
// Skips visibly where there is no CUDA backend.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <random>

#include "decode_indexer/kernels/backend.h"
#include "tests/service/service_harness.h"
#include "tests/test_seed.h"

namespace decode_indexer::testing {
namespace {

constexpr int64_t kPages = 1024;
// The CUDA backend's near-tie tolerance in fp32 ulps of a row's largest logit: its fp32 sums
// in another order differ from the exact logits by up to ~5 ulps (gpu_test measures it).
constexpr double kCudaUlps = 16.0;

// Runs v41-tiny's plan at the CUDA geometry and v32 on every session in `sessions` (the
// first is the CPU server) and calls check(step label, request, answers, reference).
template <typename Check>
void RunSteps(const std::vector<exec::ExecutorOptions>& options, uint64_t seed, Check check,
              bool fp8_bounds = false) {
  // The CUDA kernels take 64-entry pages of 128 dims (a CUDA server refuses v41-tiny's
  // 16-entry pages at start-up), so this test runs v41-tiny's plan at that geometry.
  // v32 rows reach 3 K = 6144 entries: 4 sequences need ~300 of its 64-entry pages.
  const std::string tiny_cuda = TestProfilePath("v41-tiny-cuda.toml");
  for (const std::string& name : {tiny_cuda, std::string("v32")}) {
    SCOPED_TRACE(name);
    const config::Profile p = LoadOrDie(name);
    std::vector<std::unique_ptr<Session>> sessions;
    for (const exec::ExecutorOptions& o : options) {
      sessions.push_back(StartSession(p, o));
      ASSERT_TRUE(sessions.back()) << o.backend << " x" << o.ranks;
    }
    ServiceOracle oracle(p, kPages, seed);
    oracle.set_fp8_bounds(fp8_bounds);
    const std::vector<uint64_t> ids = {1, 2, 3, 4};
    std::vector<int64_t> lengths = {int64_t(p.topk / 3), int64_t(p.topk + 5),
                                    int64_t(2 * p.topk + seed % 100), int64_t(3 * p.topk)};
    std::vector<int> layers;
    for (int l = 0; l < static_cast<int>(p.layers.size()) && l < 5; ++l) layers.push_back(l);
    for (size_t i = 0; i < sessions.size(); ++i) {
      Gen gen(seed + 1);
      ServiceOracle scratch(p, kPages, seed);
      Prefill(*sessions[i], i == 0 ? oracle : scratch, gen, ids, lengths, layers);
    }
    for (int step = 0; step < 3; ++step) {
      for (int layer : layers) {
        std::vector<int64_t> before;
        for (uint64_t id : ids) before.push_back(oracle.Length(id, p.layers[layer].cache_layer));
        Gen gen(seed * 7 + step * 100 + layer);
        v1::DecodeStepRequest req = MakeStep(gen, p, layer, ids, before, 1 + step,
                                             static_cast<QForm>(step % 4), KeyForm::kF32, step);
        const std::string what = absl::StrCat(name, " step ", step, " layer ", layer);
        std::vector<client::StepAnswer> answers;
        for (auto& s : sessions) {
          absl::StatusOr<client::StepAnswer> a = s->client->DecodeStep(req);
          ASSERT_TRUE(a.ok()) << what << ": " << a.status();
          answers.push_back(*std::move(a));
        }
        absl::StatusOr<OracleAnswer> want = oracle.Step(req);
        ASSERT_TRUE(want.ok()) << what << ": " << want.status();
        check(what, req, answers, *want);
        // Later consumers score the CPU server's candidate blocks (each checked above).
        if (req.return_candidates()) oracle.AdoptCandidates(req, answers[0].candidates);
      }
    }
  }
}

TEST(CudaVsCpuTest, CudaServerMatchesReference) {
  if (!kernels::CudaBackendAvailable()) {
    GTEST_SKIP() << "kernels::CudaBackendAvailable() is false: this build has no CUDA backend "
                    "or the machine has no usable GPU";
  }
  const uint64_t seed = TestSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (DI_TEST_SEED replays it)");
  std::cout << "comparing: CPU server vs reference, CUDA server (1 rank) vs reference "
               "(spec section 6: 4 / 16 fp32 ulps of each row's largest logit), over "
            << kernels::CudaDeviceCount() << " visible GPU(s)\n";
  exec::ExecutorOptions cuda = CpuOptions(1, kPages);
  cuda.backend = "cuda";
  // Held to the exact mode's tolerance: asked for by name, whatever DI_LOGITS_PRECISION says
  // (the fp8 kernel is CudaFp8ServerMatchesReference's).
  cuda.logits_precision = "exact";
  int64_t rows = 0, cuda_differs_from_cpu = 0;
  RunSteps({CpuOptions(1, kPages), cuda}, seed,
           [&](const std::string& what, const v1::DecodeStepRequest& req,
               const std::vector<client::StepAnswer>& a, const OracleAnswer& want) {
             const bool cand = req.return_candidates();
             EXPECT_TRUE(want.Matches(a[0].topk, cand ? a[0].candidates : std::vector<int32_t>{}))
                 << what << ": cpu server vs reference";
             EXPECT_TRUE(want.Matches(a[1].topk, cand ? a[1].candidates : std::vector<int32_t>{},
                                      kCudaUlps))
                 << what << ": cuda server vs reference";
             EXPECT_EQ(a[1].lengths, want.lengths) << what;
             EXPECT_EQ(a[0].lengths, want.lengths) << what;
             if (cand) {
               // The consumers score the CPU server's blocks: the CUDA server must have
               // chosen the same (block scores are maxima of random logits: no near-ties).
               EXPECT_EQ(a[1].candidates, a[0].candidates) << what << ": candidate blocks";
             }
             for (int r = 0; r < want.rows; ++r) {
               ++rows;
               const auto x = a[0].Row(r), y = a[1].Row(r);
               cuda_differs_from_cpu += !std::equal(x.begin(), x.end(), y.begin(), y.end());
             }
           });
  std::cout << "checked " << rows << " rows; CUDA differs from CPU (near-ties) in "
            << cuda_differs_from_cpu << "\n";
  EXPECT_GT(rows, 0);
}

// The product's default on the GPU: the fp8 tensor-core logits (--logits-precision fp8, asked
// for by name so that DI_LOGITS_PRECISION=exact in the device script does not change it), end
// to end through the API: every row of the CUDA server within spec section 6's fp8 rule of the
// reference (twice the row's largest fp8-accumulation bound plus the ulps; the rows of kernels
// that stay exact, such as the 32-head and FP4 layers, at the exact tolerance), lengths equal.
// A wrong swizzle, scale or row mapping in the fp8 kernel moves logits by tens of per cent of
// their scale and top-k sets with them; the bound is a few per cent (printed).
TEST(CudaVsCpuTest, CudaFp8ServerMatchesReference) {
  if (!kernels::CudaBackendAvailable()) {
    GTEST_SKIP() << "kernels::CudaBackendAvailable() is false: this build has no CUDA backend "
                    "or the machine has no usable GPU";
  }
  const uint64_t seed = TestSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (DI_TEST_SEED replays it)");
  std::cout << "comparing: CUDA server (1 rank, --logits-precision fp8) vs reference at the "
               "fp8-accumulation tolerance (spec section 6)\n";
  exec::ExecutorOptions cuda = CpuOptions(1, kPages);
  cuda.backend = "cuda";
  cuda.logits_precision = "fp8";
  int64_t rows = 0, fp8_rows = 0, differs_from_cpu = 0;
  double widest = 0.0;  // the largest fp8 tolerance / the row's largest |logit|
  RunSteps(
      {CpuOptions(1, kPages), cuda}, seed,
      [&](const std::string& what, const v1::DecodeStepRequest& req,
          const std::vector<client::StepAnswer>& a, const OracleAnswer& want) {
        const bool cand = req.return_candidates();
        EXPECT_TRUE(want.Matches(a[0].topk, cand ? a[0].candidates : std::vector<int32_t>{}))
            << what << ": cpu server vs reference";
        EXPECT_TRUE(want.Matches(a[1].topk, cand ? a[1].candidates : std::vector<int32_t>{},
                                 kCudaUlps, /*fp8=*/true))
            << what << ": cuda server (fp8) vs reference";
        EXPECT_EQ(a[1].lengths, want.lengths) << what;
        for (int r = 0; r < want.rows; ++r) {
          ++rows;
          const auto x = a[0].Row(r), y = a[1].Row(r);
          differs_from_cpu += !std::equal(x.begin(), x.end(), y.begin(), y.end());
          if (want.fp8_bound[r] > 0) {
            ++fp8_rows;
            double row_max = 0.0;
            for (double v : want.logits[r]) row_max = std::max(row_max, std::fabs(v));
            if (row_max > 0)
              widest = std::max(widest, want.RowTolerance(r, kCudaUlps, true) / row_max);
          }
        }
      },
      /*fp8_bounds=*/true);
  std::cout << "checked " << rows << " rows (" << fp8_rows << " at the fp8 tolerance, widest "
            << widest << " of the row's largest |logit|); CUDA differs from CPU in "
            << differs_from_cpu << "\n";
  EXPECT_GT(fp8_rows, 0) << "no row ran at the fp8 tolerance: the test checks nothing of fp8";
}

TEST(CudaVsCpuTest, CudaRanksAgree) {
  if (!kernels::CudaBackendAvailable()) {
    GTEST_SKIP() << "kernels::CudaBackendAvailable() is false: this build has no CUDA backend "
                    "or the machine has no usable GPU";
  }
  if (kernels::CudaDeviceCount() < 2) {
    GTEST_SKIP() << "fewer than 2 GPUs visible (" << kernels::CudaDeviceCount()
                 << "): the CUDA 1-rank vs 2-rank comparison needs two";
  }
  const uint64_t seed = TestSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (DI_TEST_SEED replays it)");
  std::cout << "comparing: CUDA server 1 rank vs 2 ranks (bit-identical), 2 ranks vs reference\n";
  exec::ExecutorOptions one = CpuOptions(1, kPages), two = CpuOptions(2, kPages);
  one.backend = two.backend = "cuda";
  RunSteps({CpuOptions(1, kPages), one, two}, seed,
           [&](const std::string& what, const v1::DecodeStepRequest& req,
               const std::vector<client::StepAnswer>& a, const OracleAnswer& want) {
             EXPECT_EQ(a[1].topk, a[2].topk) << what << ": cuda 1 rank vs 2";
             EXPECT_EQ(a[1].candidates, a[2].candidates) << what << ": cuda 1 rank vs 2";
             EXPECT_TRUE(want.Matches(
                 a[2].topk, req.return_candidates() ? a[2].candidates : std::vector<int32_t>{},
                 kCudaUlps))
                 << what << ": cuda 2 ranks vs reference";
           });
}

}  // namespace
}  // namespace decode_indexer::testing
