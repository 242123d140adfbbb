// SIGTERM drain of the real decode-indexer-server binary: health turns NOT_SERVING, an
// in-flight DecodeStream keeps being answered, and the process exits 0 once --drain-timeout
// has passed (cancelling the stream that never closed). The token comes from DI_AUTH_TOKEN.
// And, in process (Server::Shutdown, what the binary's SIGTERM handler calls), a step inside
// the server when the drain begins: it completes with the right answer, health turns
// NOT_SERVING, and new calls are refused.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "health_subset.grpc.pb.h"
#include "tests/service/service_harness.h"
#include "tests/test_seed.h"

extern char** environ;

namespace decode_indexer::testing {
namespace {

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The port decode-indexer-server logs once it listens ("... (port N)"), 0 until then.
int LoggedPort(const std::string& log) {
  const size_t at = log.find("(port ");
  if (at == std::string::npos) return 0;
  return std::atoi(log.c_str() + at + 6);
}

TEST(DrainTest, SigtermDrainsInFlightAndStopsWithinDrainTimeout) {
  const uint64_t seed = ::decode_indexer::testing::TestSeed();
  const std::string token = "drain-" + std::to_string(seed);
  const std::string log =
      (std::filesystem::temp_directory_path() / ("di-drain-" + std::to_string(getpid()) + ".log"))
          .string();
  std::vector<std::string> args = {DI_SERVER_BINARY,
                                   "--listen",
                                   "127.0.0.1:0",
                                   "--profile",
                                   TinyProfilePath(),
                                   "--backend",
                                   "cpu",
                                   "--cpu-threads",
                                   "1",
                                   "--cache-pages",
                                   "32",
                                   "--drain-timeout",
                                   "1",
                                   "--log-level",
                                   "info"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
  env_strings.push_back("DI_AUTH_TOKEN=" + token);
  std::vector<char*> envp;
  for (std::string& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  pid_t pid = -1;
  ASSERT_EQ(posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), envp.data()), 0);
  posix_spawn_file_actions_destroy(&actions);
  // Whatever happens below, the child does not outlive the test.
  struct Reaper {
    pid_t pid;
    bool reaped = false;
    ~Reaper() {
      if (!reaped) {
        kill(pid, SIGKILL);
        waitpid(pid, nullptr, 0);
      }
    }
  } reaper{pid};

  int port = 0;
  for (int i = 0; i < 600 && port == 0; ++i) {
    port = LoggedPort(ReadAll(log));
    if (port == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_GT(port, 0) << ReadAll(log);
  const std::string address = "127.0.0.1:" + std::to_string(port);

  client::ClientOptions opts;
  opts.auth_token = token;
  auto c = client::IndexerClient::Connect(address, opts);
  ASSERT_TRUE(c.ok()) << c.status();
  const config::Profile profile = LoadOrDie(TinyProfilePath());
  Gen gen(seed);
  ASSERT_TRUE((*c)->CreateSequence(1).ok());
  auto [keys, scales] =
      gen.Keys(KeyForm::kF32, 20, profile.layers[0].cache_format, profile.head_dim);
  ASSERT_TRUE((*c)->AppendKeys(1, 0, keys, scales).ok());

  // Health watch opened before the signal sees the change.
  std::shared_ptr<grpc::Channel> ch =
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(ch);
  grpc::ClientContext wctx;
  auto watch = health->Watch(&wctx, grpc::health::v1::HealthCheckRequest());
  grpc::health::v1::HealthCheckResponse hres;
  ASSERT_TRUE(watch->Read(&hres));
  EXPECT_EQ(hres.status(), grpc::health::v1::HealthCheckResponse::SERVING);

  auto stream = (*c)->OpenStream();
  ASSERT_TRUE(stream.ok());
  int64_t length = 20;
  auto step = [&](uint64_t id) {
    v1::DecodeStepRequest req =
        MakeStep(gen, profile, 0, {1}, {length}, 1, QForm::kF32Rope, KeyForm::kF32, id);
    ++length;
    return (*stream)->Step(req);
  };
  absl::StatusOr<client::StepAnswer> first = step(1);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->lengths, std::vector<int64_t>{21});

  ASSERT_EQ(kill(pid, SIGTERM), 0);
  bool not_serving = false;
  while (!not_serving && watch->Read(&hres)) {
    not_serving = hres.status() == grpc::health::v1::HealthCheckResponse::NOT_SERVING;
  }
  EXPECT_TRUE(not_serving);

  // The stream opened before the signal is still served while draining.
  absl::StatusOr<client::StepAnswer> second = step(2);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->lengths, std::vector<int64_t>{22});

  // The stream is left open: the server cancels it after --drain-timeout and exits 0.
  int wstatus = 0;
  pid_t done = 0;
  for (int i = 0; i < 600 && done == 0; ++i) {
    done = waitpid(pid, &wstatus, WNOHANG);
    if (done == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_EQ(done, pid) << "server still running 30 s after SIGTERM with --drain-timeout 1\n"
                       << ReadAll(log);
  reaper.reaped = true;
  ASSERT_TRUE(WIFEXITED(wstatus)) << ReadAll(log);
  EXPECT_EQ(WEXITSTATUS(wstatus), 0) << ReadAll(log);
  EXPECT_FALSE(step(3).ok());
  EXPECT_NE(ReadAll(log).find("decode-indexer-server stopped"), std::string::npos);
  wctx.TryCancel();
  std::filesystem::remove(log);
}

// A step already inside the server (held at admission, so deterministically in flight) when
// the drain begins: health turns NOT_SERVING, new calls are refused, and once admitted the
// step completes and its answer (checked against the reference) reaches the client.
TEST(DrainTest, StepInFlightAtShutdownCompletes) {
  const uint64_t seed = ::decode_indexer::testing::TestSeed();
  const config::Profile profile = LoadOrDie(TinyProfilePath());
  std::unique_ptr<Session> s = StartSession(profile, CpuOptions(1, 64));
  ASSERT_NE(s, nullptr);
  ServiceOracle oracle(profile, 64, seed);
  Gen gen(seed);
  const std::vector<uint64_t> ids = {1, 2};
  const std::vector<int64_t> lengths = {17, 40};
  Prefill(*s, oracle, gen, ids, lengths, {0});
  const v1::DecodeStepRequest req =
      MakeStep(gen, profile, 0, ids, lengths, 2, QForm::kF32Rope, KeyForm::kF32, 99);

  std::shared_ptr<grpc::Channel> ch =
      grpc::CreateChannel(s->server->address(), grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(ch);
  grpc::ClientContext wctx;
  auto watch = health->Watch(&wctx, grpc::health::v1::HealthCheckRequest());
  grpc::health::v1::HealthCheckResponse hres;
  ASSERT_TRUE(watch->Read(&hres));
  EXPECT_EQ(hres.status(), grpc::health::v1::HealthCheckResponse::SERVING);

  service::IndexerService& svc = s->server->service();
  std::unique_lock<std::mutex> hold = svc.HoldStepAdmissionForTesting();
  absl::StatusOr<client::StepAnswer> answer;
  std::thread caller([&] { answer = s->client->DecodeStep(req); });
  while (svc.StepsWaitingForAdmissionForTesting() == 0) std::this_thread::yield();

  // The drain begins while the step is inside the server.
  std::thread drain([&] { s->server->Shutdown(std::chrono::seconds(60)); });
  bool not_serving = false;
  while (!not_serving && watch->Read(&hres)) {
    not_serving = hres.status() == grpc::health::v1::HealthCheckResponse::NOT_SERVING;
  }
  EXPECT_TRUE(not_serving);
  wctx.TryCancel();  // the drain waits for open calls: this one is done
  // New calls are refused (once the server stops accepting, right after the health change).
  // A client that cannot even connect any more is refused too.
  bool refused = false;
  for (int i = 0; i < 2000 && !refused; ++i) {
    auto late = client::IndexerClient::Connect(s->server->address());
    refused = !late.ok() || (!(*late)->ServerInfo().ok() && !(*late)->CreateSequence(3).ok());
    if (!refused) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(refused) << "calls still accepted while draining";

  hold.unlock();  // the held step runs now
  caller.join();
  drain.join();
  ASSERT_TRUE(answer.ok()) << answer.status();
  absl::StatusOr<OracleAnswer> want = oracle.Step(req);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(answer->step_id, 99u);
  EXPECT_EQ(answer->lengths, want->lengths);
  EXPECT_TRUE(want->Matches(answer->topk));
}

}  // namespace
}  // namespace decode_indexer::testing
