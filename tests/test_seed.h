// Seeds of the randomized tests. Each test draws its seed once (the first TestSeed() call in
// it; later calls in the same test answer the same seed): DI_TEST_SEED=N replays a run with
// seed N, otherwise it is fresh. A failing test prints its seed and the variable that replays it
// (a gtest listener installed by this header), so every random failure can be reproduced:
//   DI_TEST_SEED=1234 build/tests/server/executor_test --gtest_filter=Executor.X
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

#include "gtest/gtest.h"

namespace decode_indexer::testing {

namespace seed_internal {

struct State {
  const ::testing::TestInfo* test = nullptr;
  uint64_t base = 0;
  uint64_t draws = 0;
  bool printed = false;
};

inline State& Current() {
  static State s;
  return s;
}

// Listeners run with gtest's UnitTest mutex held (a failure is reported under it), so this
// one must not call back into UnitTest (current_test_info() would deadlock): it tracks the
// running test itself.
class Printer : public ::testing::EmptyTestEventListener {
  const ::testing::TestInfo* running_ = nullptr;
  void OnTestStart(const ::testing::TestInfo& info) override { running_ = &info; }
  void OnTestEnd(const ::testing::TestInfo&) override { running_ = nullptr; }
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    State& s = Current();
    if (!r.failed() || s.draws == 0 || s.printed || s.test != running_) return;
    s.printed = true;
    std::printf("[   SEED   ] this test's seed is %llu: DI_TEST_SEED=%llu replays it\n",
                static_cast<unsigned long long>(s.base), static_cast<unsigned long long>(s.base));
    std::fflush(stdout);
  }
};

inline const bool kPrinterInstalled = [] {
  ::testing::UnitTest::GetInstance()->listeners().Append(new Printer);
  return true;
}();

}  // namespace seed_internal

// The current test's seed (drawn, or read from DI_TEST_SEED, at the first call in a test).
inline uint64_t TestSeed() {
  (void)seed_internal::kPrinterInstalled;
  seed_internal::State& s = seed_internal::Current();
  const ::testing::TestInfo* now = ::testing::UnitTest::GetInstance()->current_test_info();
  if (s.test != now || s.draws == 0) {
    s = {};
    s.test = now;
    const char* env = std::getenv("DI_TEST_SEED");
    s.base = env != nullptr && *env
                 ? std::strtoull(env, nullptr, 10)
                 : (uint64_t{std::random_device{}()} << 32) ^ std::random_device{}();
  }
  ++s.draws;
  return s.base;
}

// A generator seeded from TestSeed() at the start of every test (for suites that share one).
inline std::mt19937_64& PerTestRng() {
  static std::mt19937_64 rng;
  static const ::testing::TestInfo* owner = nullptr;
  static bool seeded = false;
  const ::testing::TestInfo* now = ::testing::UnitTest::GetInstance()->current_test_info();
  if (!seeded || owner != now) {
    owner = now;
    seeded = true;
    rng.seed(TestSeed());
  }
  return rng;
}

}  // namespace decode_indexer::testing
