// Session 18: the host value scan (kernels::HostAnyBadValue) on one 64-row v32 step's q (FP8
// [64, 64, 128]) and weights (fp32 [64, 64]), hot in cache; built against the tree's header:
//   g++ -std=c++20 -O3 -I kernels/include docs/results/raw/s18/scan_bench.cc -labsl_status
#include <chrono>
#include <cstdio>
#include <vector>
#include "decode_indexer/kernels/value_check.h"
using namespace decode_indexer::kernels;
int main() {
  std::vector<uint8_t> q(64 * 64 * 128, 0x33);
  std::vector<float> w(64 * 64, 1.0f);
  volatile bool sink = false;
  for (int rep = 0; rep < 3; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    const int N = 2000;
    for (int i = 0; i < N; ++i) {
      sink = sink ^ HostAnyBadValue(ElemType::kFp8E4M3, q.data(), (int64_t)q.size(), false);
      sink = sink ^ HostAnyBadValue(ElemType::kF32, w.data(), (int64_t)w.size(), false);
    }
    auto t1 = std::chrono::steady_clock::now();
    double us = std::chrono::duration<double, std::micro>(t1 - t0).count() / N;
    std::printf("%.2f us per step (%.1f GB/s)\n", us, (q.size() + w.size() * 4) / us / 1e3);
  }
}
