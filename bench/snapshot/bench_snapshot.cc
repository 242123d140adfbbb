// decode-indexer-bench-snapshot: how long --snapshot-dir takes to write every sequence on a
// drain and to restore them on start (not a test; figures go to
// docs/results/snapshot.md).
//
//   decode-indexer-bench-snapshot [--profile v32] [--sequences 8] [--length 32768]
//                                 [--dir /tmp/di-bench-snapshot] [--ranks 1] [--backend cpu]
//                                 [--malloc-keep-mb 64]
//
// Fills `sequences` sequences with `length` pre-quantized random keys in every cache of the
// profile, writes the snapshot (as Server::Shutdown does), drops the file from the page cache
// (posix_fadvise DONTNEED: the restore reads it from the disk, as after a restart), restores it
// into a fresh executor (as Server::Start does) and checks every restored length.
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "common/cli.h"
#include "common/malloc_tuning.h"
#include "server/config/profile.h"
#include "server/exec/executor.h"
#include "server/service/snapshot.h"
#include "spdlog/spdlog.h"

namespace di = decode_indexer;

int main(int argc, char** argv) {
  std::string profile_name = "v32", dir = "/tmp/di-bench-snapshot", backend = "cpu";
  int64_t sequences = 8, length = 32768;
  int ranks = 1;
  int64_t malloc_keep_mb = 64;
  CLI::App app{"decode-indexer-bench-snapshot: time writing and restoring a --snapshot-dir "
               "snapshot"};
  app.add_option("--profile", profile_name, "built-in profile or file")->capture_default_str();
  app.add_option("--sequences", sequences, "sequences to fill")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--length", length, "keys in every cache of each sequence")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--dir", dir, "snapshot directory")->capture_default_str();
  app.add_option("--ranks", ranks, "ranks")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--backend", backend, "cpu or cuda")->capture_default_str();
  app.add_option("--malloc-keep-mb", malloc_keep_mb,
                 "freed heap kept for reuse, as decode-indexer-server's default "
                 "(common/malloc_tuning.h; 0: glibc's defaults)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  di::cli::AddVersion(app);
  DI_CLI_PARSE(app, argc, argv);
  if (malloc_keep_mb > 0) di::KeepFreedMemory(malloc_keep_mb);
  spdlog::set_level(spdlog::level::warn);
  absl::StatusOr<di::config::Profile> profile = di::config::LoadProfile(profile_name);
  if (!profile.ok()) {
    std::fprintf(stderr, "%s\n", profile.status().ToString().c_str());
    return 2;
  }
  di::exec::ExecutorOptions o;
  o.backend = backend;
  o.ranks = ranks;
  o.max_sequences = sequences;
  o.cache_pages = sequences * ((length + profile->page_size - 1) / profile->page_size);
  std::filesystem::create_directories(dir);
  const std::vector<int32_t> cache_layers = profile->CacheLayers();
  int64_t cache_bytes = 0;
  using Clock = std::chrono::steady_clock;
  auto seconds = [](Clock::time_point a) {
    return std::chrono::duration<double>(Clock::now() - a).count();
  };
  {
    auto executor = di::exec::Executor::Create(*profile, o);
    if (!executor.ok()) {
      std::fprintf(stderr, "%s\n", executor.status().ToString().c_str());
      return 1;
    }
    // One chunk of random FP8 / FP4 codes and scales, appended over and over.
    const int64_t chunk = std::min<int64_t>(length, 4096);
    const int32_t D = profile->head_dim;
    std::mt19937_64 rng(1);
    std::vector<uint8_t> fp8(size_t(chunk) * D), fp4(size_t(chunk) * D / 2),
        ue8m0(size_t(chunk) * D / 32);
    std::vector<float> scales(chunk);
    for (auto& b : fp8) b = uint8_t(rng() % 0x7E);
    for (auto& b : fp4) b = uint8_t(rng());
    for (auto& b : ue8m0) b = uint8_t(120 + rng() % 8);
    for (auto& s : scales) s = std::ldexp(1.0f, -int(rng() % 8));
    const Clock::time_point fill = Clock::now();
    for (int64_t s = 0; s < sequences; ++s) {
      if (auto st = (*executor)->CreateSequence(s + 1); !st.ok()) return 1;
      for (int32_t layer : cache_layers) {
        const bool is_fp8 = profile->layers[layer].cache_format == di::kernels::CacheFormat::kFp8;
        for (int64_t done = 0; done < length; done += chunk) {
          di::exec::KeysInput k;
          k.type = is_fp8 ? di::kernels::ElemType::kFp8E4M3 : di::kernels::ElemType::kFp4E2M1;
          k.count = static_cast<int32_t>(std::min(chunk, length - done));
          k.keys = is_fp8 ? static_cast<const void*>(fp8.data()) : fp4.data();
          k.scales = is_fp8 ? static_cast<const void*>(scales.data()) : ue8m0.data();
          auto got = (*executor)->AppendKeys(s + 1, layer, k);
          if (!got.ok()) {
            std::fprintf(stderr, "append: %s\n", got.status().ToString().c_str());
            return 1;
          }
        }
        const di::kernels::CacheGeometry g{profile->layers[layer].cache_format, D,
                                           profile->page_size};
        cache_bytes += length * g.entry_bytes();
      }
    }
    std::printf(
        "filled %lld sequences x %lld entries x %zu caches (%.2f GB of entries) in %.1f s\n",
        (long long)sequences, (long long)length, cache_layers.size(), cache_bytes / 1e9,
        seconds(fill));
    const Clock::time_point write = Clock::now();
    auto info = di::service::WriteSnapshot(**executor, dir, "bench");
    if (!info.ok()) {
      std::fprintf(stderr, "write: %s\n", info.status().ToString().c_str());
      return 1;
    }
    std::printf("write: %.2f GB in %.2f s (%.2f GB/s), fsync and rename included\n",
                info->bytes / 1e9, seconds(write), info->bytes / 1e9 / seconds(write));
  }
  {
    const std::string path = dir + "/snapshot.bin";
    const int fd = ::open(path.c_str(), O_RDONLY);
    if (fd >= 0) {
      ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
      ::close(fd);
    }
  }
  auto fresh = di::exec::Executor::Create(*profile, o);
  if (!fresh.ok()) return 1;
  const Clock::time_point restore = Clock::now();
  auto restored = di::service::RestoreSnapshot(**fresh, dir);
  const double restore_s = seconds(restore);
  if (!restored.ok() || !restored->has_value()) {
    std::fprintf(stderr, "restore: %s\n",
                 restored.ok() ? "no snapshot" : restored.status().ToString().c_str());
    return 1;
  }
  std::printf("restore: %lld sequences, %.2f GB in %.2f s (%.2f GB/s), every rank written\n",
              (long long)(*restored)->sequences, (*restored)->bytes / 1e9, restore_s,
              (*restored)->bytes / 1e9 / restore_s);
  for (int64_t s = 0; s < sequences; ++s) {
    auto seq = (*fresh)->GetSequence(s + 1);
    if (!seq.ok()) return 1;
    for (const auto& c : seq->caches) {
      if (c.length != length) {
        std::fprintf(stderr, "sequence %lld: length %lld after restore\n", (long long)s + 1,
                     (long long)c.length);
        return 1;
      }
    }
  }
  std::printf("lengths checked: %lld sequences x %zu caches\n", (long long)sequences,
              cache_layers.size());
  return 0;
}
