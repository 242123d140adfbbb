// decode-indexer-load and decode-indexer-health, run as a user runs them: as processes,
// against a fake server whose answers the test controls (the verifier and the error
// accounting must notice what is wrong) and against the real CPU server (where --verify must
// find every answer exact).
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "decode_indexer/v1/indexer.grpc.pb.h"
#include "fake_server.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "process.h"
#include "tests/test_seed.h"

namespace decode_indexer::load_test {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

class LoadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = std::filesystem::temp_directory_path() /
           ("di-load-test-" + std::to_string(getpid()) + "-" + info->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override {
    if (!HasFailure()) std::filesystem::remove_all(dir_);
  }

  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  // Runs decode-indexer-load with `args`; answers its exit code (-999 if it hung).
  int RunLoad(const std::vector<std::string>& args) {
    std::vector<std::string> argv = {DI_LOAD_BINARY, "--progress", "off"};
    argv.insert(argv.end(), args.begin(), args.end());
    auto rc = RunProcess(argv, Path("load.log"), seconds(90));
    return rc.value_or(-999);
  }

  nlohmann::json ReadJson(const std::string& name) const {
    return nlohmann::json::parse(ReadText(Path(name)));  // throws (fails the test) if bad
  }

  std::string Log() const { return ReadText(Path("load.log")); }

  // A fresh seed per run: the payloads differ every time the test runs.
  static std::string Seed() { return std::to_string(::decode_indexer::testing::TestSeed() | 1u); }

  // Four verified unary steps of a v41-tiny server over one path (defined below RealServer).
  void VerifyV41UnaryPath(const std::string& path_flag, const std::vector<std::string>& extra_args,
                          const std::function<void(const nlohmann::json&)>& check);

  std::filesystem::path dir_;
};

TEST_F(LoadTest, HealthProbeFollowsServingStatus) {
  FakeServer server(0);
  EXPECT_EQ(RunProcess({DI_HEALTH_BINARY, "--addr", server.target()}, Path("h.log"), seconds(10)),
            0)
      << ReadText(Path("h.log"));
  server.SetServing(false);
  EXPECT_EQ(RunProcess({DI_HEALTH_BINARY, "--addr", server.target()}, Path("h.log"), seconds(10)),
            1)
      << ReadText(Path("h.log"));
  server.SetServing(true);
  EXPECT_EQ(RunProcess({DI_HEALTH_BINARY, "--addr", server.target()}, Path("h.log"), seconds(10)),
            0);
  // Nobody listens on a port just found free: the probe fails within its timeout.
  const int port = PickFreePort();
  ASSERT_GT(port, 0);
  EXPECT_EQ(RunProcess({DI_HEALTH_BINARY, "--addr", "127.0.0.1:" + std::to_string(port),
                        "--timeout", "0.5"},
                       Path("h.log"), seconds(10)),
            1);
  // The address may come from the environment (a container's fixed HEALTHCHECK command);
  // the flag wins over it.
  setenv("DI_HEALTH_ADDR", server.target().c_str(), 1);
  EXPECT_EQ(RunProcess({DI_HEALTH_BINARY, "--quiet"}, Path("h.log"), seconds(10)), 0)
      << ReadText(Path("h.log"));
  EXPECT_EQ(RunProcess({DI_HEALTH_BINARY, "--addr", "127.0.0.1:" + std::to_string(port),
                        "--timeout", "0.5"},
                       Path("h.log"), seconds(10)),
            1);
  unsetenv("DI_HEALTH_ADDR");
}

TEST_F(LoadTest, VerifyCatchesWrongAnswers) {
  FakeServer server(0);
  const int rc = RunLoad({"--target", server.target(), "--concurrency", "2", "--requests-per-step",
                          "3", "--next-n", "2", "--context", "200", "--steps", "4", "--verify",
                          "--verify-sequences", "3", "--seed", Seed(), "--json", Path("r.json")});
  EXPECT_EQ(rc, 1) << Log();
  const nlohmann::json report = ReadJson("r.json");
  // Every row is longer than K, so the fake's "first K positions" is wrong on each one.
  const uint64_t checked = report["verify"]["rows_checked"];
  EXPECT_GT(checked, 0u);
  EXPECT_EQ(report["verify"]["rows_mismatched"].get<uint64_t>(), checked);
  EXPECT_FALSE(report["verify"]["first_mismatches"].empty());
  EXPECT_EQ(report["steps"]["ok"].get<uint64_t>(), 4u);
}

TEST_F(LoadTest, ErrorsAreCountedByStatusCode) {
  std::mt19937 rng(static_cast<uint32_t>(::decode_indexer::testing::TestSeed()));
  const int fail_every = 2 + static_cast<int>(rng() % 4);
  FakeServer server(fail_every);
  const std::vector<std::string> args = {"--target",
                                         server.target(),
                                         "--concurrency",
                                         "2",
                                         "--requests-per-step",
                                         "2",
                                         "--context",
                                         "64",
                                         "--steps",
                                         "9",
                                         "--warmup-steps",
                                         "0",
                                         "--seed",
                                         Seed(),
                                         "--json",
                                         Path("r.json")};
  EXPECT_EQ(RunLoad(args), 1) << Log();  // an RPC failed and errors were not allowed
  nlohmann::json report = ReadJson("r.json");
  const int64_t failures = server.indexer().steps() / fail_every;
  ASSERT_GT(failures, 0);
  EXPECT_EQ(report["errors"]["RESOURCE_EXHAUSTED"].get<int64_t>(), failures);
  EXPECT_EQ(report["rpcs"]["failed"].get<int64_t>(), failures);
  EXPECT_EQ(report["steps"]["failed"].get<int64_t>(), failures);
  EXPECT_EQ(report["steps"]["count"].get<int64_t>(), 9);
  EXPECT_EQ(report["rpcs"]["ok"].get<int64_t>() + failures, server.indexer().steps());

  std::vector<std::string> allowed = args;
  allowed.push_back("--allow-errors");
  EXPECT_EQ(RunLoad(allowed), 0) << Log();
}

TEST_F(LoadTest, OpenLoopWritesJsonAndCsv) {
  FakeServer server(0);
  const int rc = RunLoad({"--target", server.target(), "--rate", "400", "--arrival", "poisson",
                          "--concurrency", "3", "--steps", "12", "--context", "50", "--seed",
                          Seed(), "--streaming", "--json", Path("r.json"), "--csv", Path("r.csv")});
  ASSERT_EQ(rc, 0) << Log();
  const nlohmann::json report = ReadJson("r.json");
  EXPECT_EQ(report["steps"]["ok"].get<int>(), 12);
  EXPECT_GT(report["config"]["rate"].get<double>(), 0);
  EXPECT_TRUE(report.contains("open_loop"));
  const auto& latency = report["steps"]["latency_ms"];
  EXPECT_GT(latency["p50"].get<double>(), 0);
  EXPECT_LE(latency["p50"].get<double>(), latency["p99"].get<double>());
  EXPECT_LE(latency["p99"].get<double>(), latency["max"].get<double>());
  // Each step visits both layers.
  EXPECT_EQ(report["rpcs"]["ok"].get<int>(), 12 * FakeIndexer::kLayers);

  const std::string csv = ReadText(Path("r.csv"));
  const size_t newline = csv.find('\n');
  ASSERT_NE(newline, std::string::npos);
  const std::string header = csv.substr(0, newline), values = csv.substr(newline + 1);
  EXPECT_EQ(std::count(header.begin(), header.end(), ','),
            std::count(values.begin(), values.end(), ','));
  EXPECT_NE(header.find("step_p99_ms"), std::string::npos);
  // A timestamp and the latency histogram in the JSON: every measured step in one bucket.
  EXPECT_EQ(report["started_at"].get<std::string>().back(), 'Z');
  EXPECT_GT(report["started_unix_s"].get<double>(), 1.6e9);
  uint64_t in_buckets = 0;
  for (const auto& c : report["steps"]["histogram"]["counts"]) in_buckets += c.get<uint64_t>();
  EXPECT_EQ(in_buckets, 12u);
  EXPECT_EQ(report["steps"]["histogram"]["counts"].size(),
            report["steps"]["histogram"]["bounds_ms"].size() + 1);
  // A second run appends its row under the same header.
  ASSERT_EQ(RunLoad({"--target", server.target(), "--concurrency", "1", "--steps", "2", "--context",
                     "50", "--seed", Seed(), "--csv", Path("r.csv")}),
            0)
      << Log();
  const std::string twice = ReadText(Path("r.csv"));
  EXPECT_EQ(std::count(twice.begin(), twice.end(), '\n'), 3) << twice;
  EXPECT_EQ(twice.rfind(header, 0), 0u);
}

// A server that fails every step: workers back off (exponentially, with jitter) instead of
// hammering it. Each wait is at least half of --backoff-initial-ms, so over the run's
// measured wall time a worker fails at most once per 50 ms (plus its first failure); without
// backoff it would fail thousands of times.
TEST_F(LoadTest, FailuresBackOff) {
  FakeServer server(1);
  const auto start = std::chrono::steady_clock::now();
  const int rc = RunLoad({"--target",
                          server.target(),
                          "--concurrency",
                          "2",
                          "--requests-per-step",
                          "1",
                          "--context",
                          "32",
                          "--duration",
                          "1",
                          "--warmup-steps",
                          "0",
                          "--backoff-initial-ms",
                          "100",
                          "--backoff-max-ms",
                          "100",
                          "--allow-errors",
                          "--seed",
                          Seed(),
                          "--json",
                          Path("r.json")});
  const double elapsed_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  ASSERT_EQ(rc, 0) << Log();
  const nlohmann::json report = ReadJson("r.json");
  const int64_t failed = report["steps"]["failed"].get<int64_t>();
  EXPECT_GT(failed, 0);
  EXPECT_EQ(report["steps"]["ok"].get<int64_t>(), 0);
  EXPECT_LE(server.indexer().steps(), 2 * (1 + int64_t(elapsed_ms / 50))) << elapsed_ms;
  EXPECT_GT(report["backoff"]["waits"].get<int64_t>(), 0);
}

// The region holds the answer as int32: asking for delta answers there is a usage error.
TEST_F(LoadTest, DeltaAnswersWithSharedMemoryIsAUsageError) {
  FakeServer server(0);
  EXPECT_EQ(RunLoad({"--target", server.target(), "--shared-memory", "--answer-encoding", "delta",
                     "--steps", "1"}),
            2)
      << Log();
  EXPECT_NE(Log().find("--shared-memory"), std::string::npos) << Log();
}

#ifdef DI_SERVER_BINARY

// A real CPU server on a free loopback port, stopped with SIGTERM.
class RealServer {
 public:
  RealServer(const std::string& profile, const std::string& log) {
    port_ = PickFreePort();
    process_ = Process::Spawn(
        {DI_SERVER_BINARY, "--listen", target(), "--backend", "cpu", "--profile", profile,
         "--cache-pages", "1024", "--drain-seconds", "2", "--log-level", "warn", "--shm-socket",
         "/tmp/di-load-test-" + std::to_string(getpid()) + "-" + std::to_string(port_) + ".sock"},
        log);
  }
  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }

  // Waits until GetServerInfo answers; `info` gets the answer.
  bool WaitReady(v1::ServerInfo* info = nullptr) {
    v1::ServerInfo scratch;
    if (info == nullptr) info = &scratch;
    const auto end = std::chrono::steady_clock::now() + seconds(30);
    while (std::chrono::steady_clock::now() < end) {
      if (!process_ || !process_->running()) return false;
      // A fresh channel with its own subchannel each try: a refused first connection would
      // otherwise put the shared subchannel into reconnect backoff (a second or more).
      grpc::ChannelArguments args;
      args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
      auto stub = v1::DecodeIndexer::NewStub(
          grpc::CreateCustomChannel(target(), grpc::InsecureChannelCredentials(), args));
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + milliseconds(500));
      if (stub->GetServerInfo(&context, v1::GetServerInfoRequest(), info).ok()) return true;
      std::this_thread::sleep_for(milliseconds(50));
    }
    return false;
  }

  std::optional<int> Stop() {
    process_->Signal(SIGTERM);
    return process_->Wait(seconds(20));
  }

 private:
  int port_ = 0;
  std::optional<Process> process_;
};

void ExpectCleanVerifiedRun(const nlohmann::json& report, int steps) {
  EXPECT_EQ(report["steps"]["ok"].get<int>(), steps);
  EXPECT_EQ(report["steps"]["failed"].get<int>(), 0);
  EXPECT_TRUE(report["errors"].empty());
  EXPECT_GT(report["verify"]["rows_checked"].get<int>(), 0);
  EXPECT_EQ(report["verify"]["rows_mismatched"].get<int>(), 0);
  // The CPU server is the oracle's own code: not even near-tie differences are allowed.
  EXPECT_EQ(report["verify"]["rows_near_tie"].get<int>(), 0);
  EXPECT_EQ(report["verify"]["groups_abandoned"].get<int>(), 0);
  EXPECT_GT(report["split_us_per_rpc"]["server_compute"].get<double>(), 0);
  EXPECT_GE(report["split_us_per_rpc"]["client"].get<double>(),
            report["split_us_per_rpc"]["server_compute"].get<double>());
}

TEST_F(LoadTest, RealServerCandidateProfileVerifies) {
  RealServer server(std::string(DI_LOAD_TEST_DIR) + "/v41-tiny.toml", Path("server.log"));
  ASSERT_TRUE(server.WaitReady()) << ReadText(Path("server.log"));
  const int rc = RunLoad({"--target",
                          server.target(),
                          "--concurrency",
                          "2",
                          "--requests-per-step",
                          "2",
                          "--next-n",
                          "2",
                          "--context",
                          "300",
                          "--steps",
                          "4",
                          "--verify",
                          "--verify-sequences",
                          "4",
                          "--verify-tolerance",
                          "0",
                          "--seed",
                          Seed(),
                          "--json",
                          Path("r.json")});
  EXPECT_EQ(rc, 0) << Log() << ReadText(Path("server.log"));
  const nlohmann::json report = ReadJson("r.json");
  ExpectCleanVerifiedRun(report, 4);
  EXPECT_GT(report["verify"]["candidate_rows_checked"].get<int>(), 0);
  EXPECT_EQ(report["verify"]["candidate_rows_mismatched"].get<int>(), 0);
  for (const char* role : {"dense", "source", "consumer"}) {
    EXPECT_TRUE(report["rpcs"]["by_role"].contains(role)) << role;
  }
  EXPECT_EQ(report["server"]["layers"].get<int>(), 4);
  // The container health check's probe agrees that the real server is serving.
  EXPECT_EQ(RunProcess({DI_HEALTH_BINARY, "--addr", server.target()}, Path("h.log"), seconds(10)),
            0)
      << ReadText(Path("h.log"));
  const std::optional<int> stopped = server.Stop();
  ASSERT_TRUE(stopped.has_value()) << "server ignored SIGTERM";
  EXPECT_EQ(*stopped, 0) << ReadText(Path("server.log"));
}

// Speculative mode: next_n 3, half the drafts rejected and rolled back by position in every
// cache (the v41 source and its consumers included); the verifier's mirror follows the
// rollbacks, and every checked row still matches the reference exactly.
TEST_F(LoadTest, RealServerSpeculativeRollbackVerifies) {
  RealServer server(std::string(DI_LOAD_TEST_DIR) + "/v41-tiny.toml", Path("server.log"));
  ASSERT_TRUE(server.WaitReady()) << ReadText(Path("server.log"));
  const int rc = RunLoad({"--target",
                          server.target(),
                          "--concurrency",
                          "2",
                          "--requests-per-step",
                          "2",
                          "--next-n",
                          "3",
                          "--draft-reject",
                          "0.5",
                          "--context",
                          "300",
                          "--steps",
                          "6",
                          "--verify",
                          "--verify-sequences",
                          "4",
                          "--verify-tolerance",
                          "0",
                          "--seed",
                          Seed(),
                          "--json",
                          Path("r.json")});
  EXPECT_EQ(rc, 0) << Log() << ReadText(Path("server.log"));
  const nlohmann::json report = ReadJson("r.json");
  ExpectCleanVerifiedRun(report, 6);
  EXPECT_GT(report["speculative"]["drafts"].get<int>(), 0);
  EXPECT_GT(report["speculative"]["drafts_rejected"].get<int>(), 0) << "nothing rolled back";
  EXPECT_EQ(report["verify"]["candidate_rows_mismatched"].get<int>(), 0);
  EXPECT_TRUE(server.Stop().has_value());
}

// --columnar: the same speculative run (rollbacks by new_keys_positions in every cache, the
// v41 source and its consumers), unary and streaming, fp32 and pre-quantized keys, each
// step sent in the columnar form; every checked row still matches the reference exactly.
TEST_F(LoadTest, RealServerColumnarStepsVerify) {
  RealServer server(std::string(DI_LOAD_TEST_DIR) + "/v41-tiny.toml", Path("server.log"));
  ASSERT_TRUE(server.WaitReady()) << ReadText(Path("server.log"));
  for (const bool streaming : {false, true}) {
    std::vector<std::string> args = {"--target",
                                     server.target(),
                                     "--columnar",
                                     "--concurrency",
                                     "2",
                                     "--requests-per-step",
                                     "3",
                                     "--next-n",
                                     "2",
                                     "--draft-reject",
                                     "0.5",
                                     "--context",
                                     "300",
                                     "--steps",
                                     "5",
                                     "--key-format",
                                     streaming ? "fp32" : "quantized",
                                     "--verify",
                                     "--verify-sequences",
                                     "4",
                                     "--verify-tolerance",
                                     "0",
                                     "--seed",
                                     Seed(),
                                     "--json",
                                     Path("r.json")};
    if (streaming) args.push_back("--streaming");
    const int rc = RunLoad(args);
    EXPECT_EQ(rc, 0) << Log() << ReadText(Path("server.log"));
    const nlohmann::json report = ReadJson("r.json");
    EXPECT_EQ(report["config"]["request_form"].get<std::string>(), "columnar");
    ExpectCleanVerifiedRun(report, 5);
    EXPECT_GT(report["speculative"]["drafts_rejected"].get<int>(), 0) << "nothing rolled back";
    EXPECT_EQ(report["verify"]["candidate_rows_mismatched"].get<int>(), 0);
  }
  EXPECT_TRUE(server.Stop().has_value());
}

TEST_F(LoadTest, RealServerDenseStreamingFp32Verifies) {
  RealServer server(std::string(DI_LOAD_TEST_DIR) + "/v32-tiny.toml", Path("server.log"));
  ASSERT_TRUE(server.WaitReady()) << ReadText(Path("server.log"));
  const int rc = RunLoad({"--target",
                          server.target(),
                          "--streaming",
                          "--rate",
                          "100",
                          "--concurrency",
                          "2",
                          "--requests-per-step",
                          "3",
                          "--context",
                          "250",
                          "--q-format",
                          "fp32",
                          "--key-format",
                          "fp32",
                          "--steps",
                          "5",
                          "--verify",
                          "--verify-sequences",
                          "3",
                          "--verify-tolerance",
                          "0",
                          "--seed",
                          Seed(),
                          "--json",
                          Path("r.json")});
  EXPECT_EQ(rc, 0) << Log() << ReadText(Path("server.log"));
  ExpectCleanVerifiedRun(ReadJson("r.json"), 5);
  EXPECT_TRUE(server.Stop().has_value());
}

// Mean bytes a successful RPC put on the wire each way.
double RequestBytesPerRpc(const nlohmann::json& report) {
  return report["throughput"]["request_bytes"].get<double>() / report["rpcs"]["ok"].get<double>();
}
double ResponseBytesPerRpc(const nlohmann::json& report) {
  return report["throughput"]["response_bytes"].get<double>() / report["rpcs"]["ok"].get<double>();
}
// Bytes of one step's int32 answer sent raw: rows x K x 4.
double RawAnswerBytes(const nlohmann::json& report) {
  return report["config"]["requests_per_step"].get<double>() *
         report["config"]["next_n"].get<double>() * report["server"]["topk"].get<double>() * 4;
}

// Four verified unary steps of a v41-tiny server (two workers, two requests of two rows a
// step) over the path `path_flag` selects: every tracked row matches the reference, the
// candidate blocks too. `check` then looks at what is particular to that path, before the
// server stops.
void LoadTest::VerifyV41UnaryPath(const std::string& path_flag,
                                  const std::vector<std::string>& extra_args,
                                  const std::function<void(const nlohmann::json&)>& check) {
  RealServer server(std::string(DI_LOAD_TEST_DIR) + "/v41-tiny.toml", Path("server.log"));
  ASSERT_TRUE(server.WaitReady()) << ReadText(Path("server.log"));
  std::vector<std::string> args = {"--target",
                                   server.target(),
                                   path_flag,
                                   "--concurrency",
                                   "2",
                                   "--requests-per-step",
                                   "2",
                                   "--next-n",
                                   "2",
                                   "--context",
                                   "300",
                                   "--steps",
                                   "4",
                                   "--verify",
                                   "--verify-sequences",
                                   "4",
                                   "--verify-tolerance",
                                   "0",
                                   "--seed",
                                   Seed(),
                                   "--json",
                                   Path("r.json")};
  args.insert(args.end(), extra_args.begin(), extra_args.end());
  const int rc = RunLoad(args);
  EXPECT_EQ(rc, 0) << Log() << ReadText(Path("server.log"));
  const nlohmann::json report = ReadJson("r.json");
  ExpectCleanVerifiedRun(report, 4);
  EXPECT_GT(report["verify"]["candidate_rows_checked"].get<int>(), 0);
  EXPECT_EQ(report["verify"]["candidate_rows_mismatched"].get<int>(), 0);
  check(report);
  EXPECT_TRUE(server.Stop().has_value());
}

// q, q_scales and weights through each worker's shared-memory region and the answer (and
// the candidate blocks) back through it: every tracked row still matches the reference,
// and neither q nor the answer crossed gRPC.
TEST_F(LoadTest, RealServerSharedMemoryUnaryVerifies) {
  VerifyV41UnaryPath(
      "--shared-memory", {"--csv", Path("r.csv")}, [&](const nlohmann::json& report) {
        EXPECT_TRUE(report["config"]["shared_memory"].get<bool>());
        // The smallest q a step can carry (packed FP4, half a byte an element) did not travel.
        const double rows = report["config"]["requests_per_step"].get<double>() *
                            report["config"]["next_n"].get<double>();
        const double fp4_q = rows * report["server"]["num_heads"].get<double>() *
                             report["server"]["head_dim"].get<double>() / 2;
        EXPECT_LT(RequestBytesPerRpc(report), fp4_q);
        EXPECT_LT(ResponseBytesPerRpc(report), RawAnswerBytes(report));
        EXPECT_NE(ReadText(Path("r.csv")).find("shared_memory"), std::string::npos);
        // Every worker unregistered its region and unlinked it.
        for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
          EXPECT_EQ(entry.path().filename().string().find("di-load-" + std::to_string(getpid())),
                    std::string::npos);
        }
      });
}

// Every step through each worker's step ring (the same-host fast path): every tracked row
// still matches the reference (the candidate blocks too), and nothing crossed gRPC per step.
TEST_F(LoadTest, RealServerFastPathVerifies) {
  VerifyV41UnaryPath("--fast-path", {}, [](const nlohmann::json& report) {
    EXPECT_TRUE(report["config"]["fast_path"].get<bool>());
    EXPECT_EQ(RequestBytesPerRpc(report), 0);
  });
}

TEST_F(LoadTest, RealServerSharedMemoryStreamingFp32Verifies) {
  RealServer server(std::string(DI_LOAD_TEST_DIR) + "/v32-tiny.toml", Path("server.log"));
  ASSERT_TRUE(server.WaitReady()) << ReadText(Path("server.log"));
  const int rc = RunLoad({"--target",
                          server.target(),
                          "--shared-memory",
                          "--streaming",
                          "--concurrency",
                          "2",
                          "--requests-per-step",
                          "3",
                          "--context",
                          "250",
                          "--q-format",
                          "fp32",
                          "--steps",
                          "5",
                          "--verify",
                          "--verify-sequences",
                          "3",
                          "--verify-tolerance",
                          "0",
                          "--seed",
                          Seed(),
                          "--json",
                          Path("r.json")});
  EXPECT_EQ(rc, 0) << Log() << ReadText(Path("server.log"));
  const nlohmann::json report = ReadJson("r.json");
  ExpectCleanVerifiedRun(report, 5);
  EXPECT_TRUE(report["config"]["shared_memory"].get<bool>());
  EXPECT_LT(ResponseBytesPerRpc(report), RawAnswerBytes(report));
  EXPECT_TRUE(server.Stop().has_value());
}

// Delta-varint answers are decoded before they are checked: exact, and smaller on the wire
// than the raw int32 answer alone would be.
TEST_F(LoadTest, RealServerDeltaAnswersVerify) {
  RealServer server(std::string(DI_LOAD_TEST_DIR) + "/v41-tiny.toml", Path("server.log"));
  ASSERT_TRUE(server.WaitReady()) << ReadText(Path("server.log"));
  for (const bool streaming : {false, true}) {
    std::vector<std::string> args = {"--target",
                                     server.target(),
                                     "--answer-encoding",
                                     "delta",
                                     "--concurrency",
                                     "2",
                                     "--requests-per-step",
                                     "3",
                                     "--next-n",
                                     "2",
                                     "--context",
                                     "280",
                                     "--steps",
                                     "3",
                                     "--verify",
                                     "--verify-sequences",
                                     "3",
                                     "--verify-tolerance",
                                     "0",
                                     "--seed",
                                     Seed(),
                                     "--json",
                                     Path("r.json")};
    if (streaming) args.push_back("--streaming");
    EXPECT_EQ(RunLoad(args), 0) << Log() << ReadText(Path("server.log"));
    const nlohmann::json report = ReadJson("r.json");
    ExpectCleanVerifiedRun(report, 3);
    EXPECT_GT(report["verify"]["candidate_rows_checked"].get<int>(), 0);
    EXPECT_EQ(report["config"]["answer_encoding"].get<std::string>(), "delta");
    EXPECT_LT(ResponseBytesPerRpc(report), RawAnswerBytes(report)) << "streaming " << streaming;
  }
  EXPECT_TRUE(server.Stop().has_value());
}

// --deadline with --streaming is each step's timeout_us: one no step can meet fails them
// with DEADLINE_EXCEEDED (each ends its stream; the next step opens another), a generous
// one fails none.
TEST_F(LoadTest, RealServerStreamingStepDeadline) {
  RealServer server(std::string(DI_LOAD_TEST_DIR) + "/v32-tiny.toml", Path("server.log"));
  ASSERT_TRUE(server.WaitReady()) << ReadText(Path("server.log"));
  // 32 rows of fp32 q: the server checks every value before it looks at the clock, tens of
  // microseconds however fast the host, so 1 us is always past.
  const std::vector<std::string> common = {
      "--target", server.target(), "--streaming", "--concurrency",  "2",    "--requests-per-step",
      "8",        "--next-n",      "4",           "--q-format",     "fp32", "--context",
      "200",      "--steps",       "4",           "--warmup-steps", "0",    "--seed",
      Seed(),     "--json",        Path("r.json")};
  std::vector<std::string> impossible = common;
  impossible.insert(impossible.end(), {"--deadline", "0.001", "--allow-errors"});
  EXPECT_EQ(RunLoad(impossible), 0) << Log() << ReadText(Path("server.log"));
  nlohmann::json report = ReadJson("r.json");
  EXPECT_EQ(report["config"]["deadline_scope"].get<std::string>(), "step");
  EXPECT_GT(report["errors"].value("DEADLINE_EXCEEDED", 0), 0) << report["errors"].dump();
  EXPECT_EQ(report["errors"].size(), 1u) << report["errors"].dump();
  EXPECT_EQ(report["steps"]["failed"].get<int>(), 4);

  std::vector<std::string> generous = common;
  generous.insert(generous.end(), {"--deadline", "60000"});
  EXPECT_EQ(RunLoad(generous), 0) << Log() << ReadText(Path("server.log"));
  report = ReadJson("r.json");
  EXPECT_TRUE(report["errors"].empty()) << report["errors"].dump();
  EXPECT_EQ(report["steps"]["ok"].get<int>(), 4);
  EXPECT_TRUE(server.Stop().has_value());
}

// The example deployment profile loads, and the server reports what it says.
TEST_F(LoadTest, RealServerLoadsDeployExampleProfile) {
  RealServer server(std::string(DI_LOAD_TEST_DIR) + "/../../deploy/profiles/v41-example.toml",
                    Path("server.log"));
  v1::ServerInfo info;
  ASSERT_TRUE(server.WaitReady(&info)) << ReadText(Path("server.log"));
  EXPECT_EQ(info.profile(), "v41-example");
  EXPECT_EQ(info.layers_size(), 61);
  int sources = 0, consumers = 0;
  for (const v1::LayerInfo& layer : info.layers()) {
    sources += layer.role() == v1::LAYER_ROLE_CANDIDATE_SOURCE;
    consumers += layer.role() == v1::LAYER_ROLE_CANDIDATE_CONSUMER;
  }
  EXPECT_EQ(sources, 1);
  EXPECT_EQ(consumers, 57);
  EXPECT_EQ(info.max_rows_per_sequence(), 4);
  // And the load tester gets through a step of all 61 layers against it.
  const int rc =
      RunLoad({"--target", server.target(), "--concurrency", "1", "--requests-per-step", "1",
               "--context", "100", "--steps", "1", "--seed", Seed(), "--json", Path("r.json")});
  EXPECT_EQ(rc, 0) << Log();
  EXPECT_EQ(ReadJson("r.json")["rpcs"]["ok"].get<int>(), 61);
  EXPECT_TRUE(server.Stop().has_value());
}

#else

TEST_F(LoadTest, RealServer) { GTEST_SKIP() << "decode-indexer-server is not part of this build"; }

#endif  // DI_SERVER_BINARY

}  // namespace
}  // namespace decode_indexer::load_test
