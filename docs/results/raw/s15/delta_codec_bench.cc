// Scratch timing of the delta answer codec (server EncodeTopkDelta, client DecodeTopkDelta) on a
// 64 x 2048 answer drawn from 32K positions, best of 200 calls. Built against the repository:
//   P=build/gen/decode_indexer/v1; g++ -O3 -DNDEBUG -std=c++20 -I. -Ibuild/gen THIS.cc \
//     server/service/data_plane.cc $P/indexer.pb.cc -lprotobuf -labsl_statusor -labsl_status \
//     -labsl_strings -labsl_str_format_internal -labsl_cord -labsl_raw_logging_internal -lpthread
#include <chrono>
#include <cstdio>
#include <random>
#include <span>
#include <string>
#include <vector>
#include <algorithm>
#include <cstdint>
#include "client/tensor.h"
namespace decode_indexer::service { void EncodeTopkDelta(std::span<const int32_t> topk, int32_t rows, int32_t k, std::string& out); }
int main() {
  const int rows = 64, k = 2048, ctx = 32768;
  std::mt19937 rng(1);
  std::vector<int32_t> topk(rows * k);
  for (int r = 0; r < rows; ++r) {
    std::vector<int32_t> all(ctx); for (int i = 0; i < ctx; ++i) all[i] = i;
    std::shuffle(all.begin(), all.end(), rng);
    std::sort(all.begin(), all.begin() + k);
    std::copy(all.begin(), all.begin() + k, topk.begin() + r * k);
  }
  std::string out;
  for (int rep = 0; rep < 3; ++rep) {
    double best_e = 1e9, best_d = 1e9;
    for (int it = 0; it < 200; ++it) {
      out.clear();
      auto a = std::chrono::steady_clock::now();
      decode_indexer::service::EncodeTopkDelta(topk, rows, k, out);
      auto b = std::chrono::steady_clock::now();
      auto d = decode_indexer::client::DecodeTopkDelta(out, rows, k);
      auto c = std::chrono::steady_clock::now();
      if (!d.ok() || *d != topk) { printf("mismatch\n"); return 1; }
      best_e = std::min(best_e, std::chrono::duration<double, std::micro>(b - a).count());
      best_d = std::min(best_d, std::chrono::duration<double, std::micro>(c - b).count());
    }
    printf("bytes %zu encode %.1f us decode %.1f us\n", out.size(), best_e, best_d);
  }
}
