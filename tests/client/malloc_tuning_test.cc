// common/malloc_tuning.h: with the server's and the clients' default (64 MB kept), a step's
// message pattern (two 1 MiB blocks written and freed, call after call) reuses warm pages;
// with glibc's defaults the same pattern faults every page in again each time. The default
// side runs in a forked child, so that the check of the setting sees a process that has not
// applied it yet.
#include "common/malloc_tuning.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DI_UNDER_ASAN 1
#endif
#endif

namespace {

long MinorFaults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

constexpr int kRounds = 100;
constexpr size_t kBlock = size_t{1} << 20;
constexpr long kPagesARound = 2 * long(kBlock / 4096);

// The minor page faults of `rounds` rounds of: two 1 MiB blocks allocated, written, freed.
long FaultsOfMessageRounds(int rounds) {
  const long before = MinorFaults();
  for (int i = 0; i < rounds; ++i) {
    char* a = static_cast<char*>(std::malloc(kBlock));
    char* b = static_cast<char*>(std::malloc(kBlock));
    std::memset(a, i, kBlock);
    std::memset(b, i + 1, kBlock);
    asm volatile("" : : "r"(a), "r"(b) : "memory");  // the blocks and their writes stay
    std::free(b);
    std::free(a);
  }
  return MinorFaults() - before;
}

TEST(MallocTuningTest, NothingToApplyAtZero) { EXPECT_FALSE(decode_indexer::KeepFreedMemory(0)); }

TEST(MallocTuningTest, KeptMemoryStopsTheFaultsOfEveryCall) {
#if !defined(__GLIBC__)
  GTEST_SKIP() << "not glibc";
#endif
  // glibc's defaults, in a child: the pattern must fault (else this test proves nothing).
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    FaultsOfMessageRounds(3);
    const long faults = FaultsOfMessageRounds(kRounds);
    _exit(write(pipefd[1], &faults, sizeof(faults)) == sizeof(faults) ? 0 : 1);
  }
  long default_faults = -1;
  ASSERT_EQ(read(pipefd[0], &default_faults, sizeof(default_faults)), long(sizeof(long)));
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  close(pipefd[0]);
  close(pipefd[1]);
#if defined(__SANITIZE_ADDRESS__) || defined(DI_UNDER_ASAN)
  // The sanitizer's allocator answers mallopt with 0: the call must say it changed nothing.
  EXPECT_FALSE(decode_indexer::KeepFreedMemory(64));
  return;
#endif
  ASSERT_TRUE(decode_indexer::KeepFreedMemory(64));
  EXPECT_GE(default_faults, kRounds * kPagesARound / 2)
      << "glibc's defaults should fault the pattern's pages in every round";
  FaultsOfMessageRounds(3);
  const long kept_faults = FaultsOfMessageRounds(kRounds);
  EXPECT_LE(kept_faults, kRounds * kPagesARound / 50)
      << "with 64 MB kept the rounds should reuse warm pages (defaults: " << default_faults << ")";
}

}  // namespace
