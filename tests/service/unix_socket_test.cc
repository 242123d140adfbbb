// The server on a Unix domain socket (--listen unix:PATH, beside or instead of TCP): what the
// listen addresses parse to, unary and streamed steps over the socket answering what the
// reference answers, the socket file removed at shutdown, and the addresses that cannot be
// served refused with a message naming why, before anything is allocated (a live server's
// socket is never taken over).
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "server/service/listen_address.h"
#include "tests/service/service_harness.h"
#include "tests/test_seed.h"

namespace decode_indexer::testing {
namespace {

using service::ListenAddress;
using service::ParseListenAddress;

// A fresh private directory under the temp dir, removed with everything in it.
struct TempDir {
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "di-uds-XXXXXX").string();
    path = ::mkdtemp(pattern.data()) != nullptr ? pattern : "";
    EXPECT_FALSE(path.empty()) << "mkdtemp";
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string path;
};

bool IsSocket(const std::string& path) {
  struct stat st = {};
  return ::lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode);
}

service::ServerOptions Options(const config::Profile& profile, std::vector<std::string> listen) {
  service::ServerOptions so;
  so.listen = std::move(listen);
  so.profile = profile;
  so.executor = CpuOptions(1, 64);
  so.grpc_edge = TestEdge();
  return so;
}

TEST(ListenAddressTest, ParsesTcpAndSocketForms) {
  struct Case {
    std::string address;
    ListenAddress::Kind kind;
    std::string path;
  };
  for (const Case& c : std::vector<Case>{
           {"0.0.0.0:50051", ListenAddress::Kind::kTcp, ""},
           {"[::]:0", ListenAddress::Kind::kTcp, ""},
           {"localhost:65535", ListenAddress::Kind::kTcp, ""},
           {"unix:/run/di/grpc.sock", ListenAddress::Kind::kUnixPath, "/run/di/grpc.sock"},
           {"unix:grpc.sock", ListenAddress::Kind::kUnixPath, "grpc.sock"},
           {"unix:///run/di/grpc.sock", ListenAddress::Kind::kUnixPath, "/run/di/grpc.sock"},
           {"unix-abstract:di-grpc", ListenAddress::Kind::kUnixAbstract, "di-grpc"},
       }) {
    absl::StatusOr<ListenAddress> got = ParseListenAddress(c.address);
    ASSERT_TRUE(got.ok()) << c.address << ": " << got.status();
    EXPECT_EQ(got->kind, c.kind) << c.address;
    EXPECT_EQ(got->path, c.path) << c.address;
    EXPECT_EQ(got->address, c.address);
  }
  // Each refusal names the address and what is wrong with it.
  const std::string long_path = "unix:/" + std::string(107, 'a');
  for (const auto& [address, why] : std::vector<std::pair<std::string, std::string>>{
           {"localhost", "expected host:port"},
           {"localhost:http", "expected host:port"},
           {"127.0.0.1:65536", "expected host:port"},
           {"127.0.0.1:", "expected host:port"},
           {"unix:", "needs a path"},
           {"unix://host/grpc.sock", "absolute path"},
           {"unix-abstract:", "needs a name"},
           {long_path, "at most 107 bytes, this one has 108"},
       }) {
    absl::StatusOr<ListenAddress> got = ParseListenAddress(address);
    ASSERT_FALSE(got.ok()) << address;
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << address;
    EXPECT_NE(got.status().message().find(why), std::string::npos) << got.status();
    EXPECT_NE(got.status().message().find(address.substr(0, 20)), std::string::npos)
        << got.status();
  }
}

// One socket (however its path is spelled) or one host:port given twice is refused before
// anything binds: gRPC would bind the second over the first, and for a path it unlinks the
// first's file, leaving that listener unreachable. Port 0 twice is two ports.
TEST(ListenAddressTest, RefusesTheSameAddressTwice) {
  const std::string cwd = std::filesystem::current_path().string();
  for (const auto& [first, second] : std::vector<std::pair<std::string, std::string>>{
           {"unix:/run/di/grpc.sock", "unix:/run/di/grpc.sock"},
           {"unix:/run/di/grpc.sock", "unix:///run/di/grpc.sock"},
           {"unix:/run/di/grpc.sock", "unix:/run/di/../di/./grpc.sock"},
           {"unix:grpc.sock", "unix:./grpc.sock"},
           {"unix:grpc.sock", "unix:" + cwd + "/grpc.sock"},
           {"unix-abstract:di-grpc", "unix-abstract:di-grpc"},
           {"127.0.0.1:50051", "127.0.0.1:50051"},
       }) {
    absl::StatusOr<std::vector<ListenAddress>> got =
        service::ParseListenAddresses({"127.0.0.1:0", first, second});
    ASSERT_FALSE(got.ok()) << first << " and " << second;
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
    EXPECT_NE(got.status().message().find("listen: \"" + second + "\": "), std::string::npos)
        << got.status();
    EXPECT_NE(got.status().message().find("given twice"), std::string::npos) << got.status();
    if (first != second) {
      EXPECT_NE(got.status().message().find("the same address as \"" + first + "\""),
                std::string::npos)
          << got.status();
    }
  }
  for (const auto& [first, second] : std::vector<std::pair<std::string, std::string>>{
           {"127.0.0.1:0", "127.0.0.1:0"},
           {"unix:/run/di/grpc.sock", "unix-abstract:/run/di/grpc.sock"},
           {"unix:/run/di/a.sock", "unix:/run/di/b.sock"},
           {"127.0.0.1:50051", "127.0.0.1:50052"},
       }) {
    absl::StatusOr<std::vector<ListenAddress>> got = service::ParseListenAddresses({first, second});
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->size(), 2u);
    EXPECT_EQ((*got)[1].address, second);
  }
}

TEST(ListenAddressTest, ConnectAddressDialsLoopbackOrTheSocket) {
  auto dial = [](const std::string& listen, int port) {
    absl::StatusOr<ListenAddress> a = ParseListenAddress(listen);
    EXPECT_TRUE(a.ok()) << a.status();
    return a.ok() ? service::ConnectAddress(*a, port) : "";
  };
  EXPECT_EQ(dial("0.0.0.0:0", 40001), "127.0.0.1:40001");
  EXPECT_EQ(dial("[::]:50051", 50051), "127.0.0.1:50051");
  EXPECT_EQ(dial("10.1.2.3:0", 40002), "10.1.2.3:40002");
  // gRPC reports a bound socket as port 1: never part of the address.
  EXPECT_EQ(dial("unix:/run/di/grpc.sock", 1), "unix:/run/di/grpc.sock");
  EXPECT_EQ(dial("unix-abstract:di-grpc", 1), "unix-abstract:di-grpc");
}

// Unary and streamed steps through a client on the socket, each checked against the
// reference; the TCP address of the same server keeps working beside it.
TEST(UnixSocketTest, StepsOverTheSocketAnswerWhatTheReferenceAnswers) {
  const uint64_t seed = TestSeed();
  TempDir dir;
  const std::string socket_path = dir.path + "/grpc.sock";
  const config::Profile profile = LoadOrDie(TinyProfilePath());
  auto session = std::make_unique<Session>();
  session->profile = profile;
  {
    absl::StatusOr<std::unique_ptr<service::Server>> server =
        service::Server::Start(Options(profile, {"127.0.0.1:0", "unix:" + socket_path}));
    ASSERT_TRUE(server.ok()) << server.status();
    session->server = std::move(*server);
  }
  service::Server& server = *session->server;
  EXPECT_TRUE(IsSocket(socket_path));
  ASSERT_EQ(server.addresses().size(), 2u);
  EXPECT_EQ(server.addresses()[0], "127.0.0.1:" + std::to_string(server.port()));
  EXPECT_EQ(server.addresses()[1], "unix:" + socket_path);
  EXPECT_GT(server.port(), 1);  // the TCP port, not the socket's stand-in "port 1"

  absl::StatusOr<std::unique_ptr<client::IndexerClient>> over_socket =
      client::IndexerClient::Connect("unix:" + socket_path);
  ASSERT_TRUE(over_socket.ok()) << over_socket.status();
  session->client = std::move(*over_socket);

  ServiceOracle oracle(profile, 64, seed);
  Gen gen(seed);
  const std::vector<uint64_t> ids = {11, 12, 13};
  std::vector<int64_t> lengths = {40, profile.topk + 5, 3 * profile.topk};
  Prefill(*session, oracle, gen, ids, lengths, {0});
  uint64_t step_id = 1;
  for (QForm form : {QForm::kQuantized, QForm::kF32Rope}) {
    v1::DecodeStepRequest req =
        MakeStep(gen, profile, 0, ids, lengths, 1, form, KeyForm::kQuantized, step_id++);
    client::StepAnswer got = StepAndCompare(*session, oracle, req, "unary over the socket");
    ASSERT_EQ(got.lengths.size(), ids.size());
    for (size_t i = 0; i < ids.size(); ++i) lengths[i] = got.lengths[i];
  }
  absl::StatusOr<std::unique_ptr<client::StepStream>> stream = session->client->OpenStream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  for (int s = 0; s < 3; ++s) {
    v1::DecodeStepRequest req = MakeStep(gen, profile, 0, ids, lengths, 1, QForm::kQuantized,
                                         KeyForm::kQuantized, step_id++);
    absl::StatusOr<client::StepAnswer> got = (*stream)->Step(req);
    ASSERT_TRUE(got.ok()) << got.status();
    absl::StatusOr<OracleAnswer> want = oracle.Step(req);
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(got->step_id, req.step_id());
    EXPECT_EQ(got->lengths, want->lengths);
    EXPECT_TRUE(want->Matches(got->topk, {})) << "stream step " << s << " over the socket";
    lengths = got->lengths;
  }
  EXPECT_TRUE((*stream)->Finish().ok());

  // The TCP address of the same server sees the sequences the socket's client stepped.
  absl::StatusOr<std::unique_ptr<client::IndexerClient>> over_tcp =
      client::IndexerClient::Connect(server.address());
  ASSERT_TRUE(over_tcp.ok()) << over_tcp.status();
  absl::StatusOr<v1::GetSequenceResponse> seen = (*over_tcp)->GetSequence(ids[0]);
  ASSERT_TRUE(seen.ok()) << seen.status();

  session->client.reset();
  over_tcp->reset();
  server.Shutdown(std::chrono::seconds(5));
  EXPECT_FALSE(std::filesystem::exists(socket_path)) << "the socket file outlived the server";
}

TEST(UnixSocketTest, ServesOnTheSocketAlone) {
  TempDir dir;
  const std::string address = "unix:" + dir.path + "/only.sock";
  absl::StatusOr<std::unique_ptr<service::Server>> server =
      service::Server::Start(Options(LoadOrDie(TinyProfilePath()), {address}));
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ((*server)->port(), 0);  // no TCP address
  EXPECT_EQ((*server)->address(), address);
  absl::StatusOr<std::unique_ptr<client::IndexerClient>> c =
      client::IndexerClient::Connect((*server)->address());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE((*c)->ServerInfo().ok());
}

// Each address that cannot be served is refused before the executor starts, with a message
// that names the address and the reason (gRPC alone says "No address added").
TEST(UnixSocketTest, RefusesAPathThatCannotBeBoundAndSaysWhy) {
  TempDir dir;
  const config::Profile profile = LoadOrDie(TinyProfilePath());
  const std::string file = dir.path + "/not-a-socket";
  std::ofstream(file) << "x";
  struct Case {
    std::string address;
    absl::StatusCode code;
    std::string why;
  };
  for (const Case& c : std::vector<Case>{
           {"unix:" + dir.path + "/missing/grpc.sock", absl::StatusCode::kInvalidArgument,
            "/missing\": No such file or directory"},
           {"unix:" + file + "/grpc.sock", absl::StatusCode::kInvalidArgument,
            "is not a directory"},
           {"unix:" + file, absl::StatusCode::kAlreadyExists, "exists and is not a socket"},
           {"unix:" + dir.path + "/" + std::string(120, 's'), absl::StatusCode::kInvalidArgument,
            "at most 107 bytes"},
       }) {
    // A TCP address first: one bad address fails the start whatever else is listed.
    absl::StatusOr<std::unique_ptr<service::Server>> server =
        service::Server::Start(Options(profile, {"127.0.0.1:0", c.address}));
    ASSERT_FALSE(server.ok()) << c.address;
    EXPECT_EQ(server.status().code(), c.code) << server.status();
    EXPECT_NE(server.status().message().find(c.why), std::string::npos) << server.status();
    EXPECT_NE(server.status().message().find("listen: "), std::string::npos) << server.status();
  }
  std::string contents;
  std::getline(std::ifstream(file), contents);
  EXPECT_EQ(contents, "x") << "a refused start touched the file in the way";
}

// The same path twice in one server's addresses: refused before anything is bound (gRPC's
// second bind would unlink the first's file and orphan its listener).
TEST(UnixSocketTest, RefusesTheSamePathTwice) {
  TempDir dir;
  const std::string path = dir.path + "/grpc.sock";
  absl::StatusOr<std::unique_ptr<service::Server>> server = service::Server::Start(
      Options(LoadOrDie(TinyProfilePath()), {"unix:" + path, "unix://" + path}));
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument) << server.status();
  EXPECT_NE(server.status().message().find("given twice"), std::string::npos) << server.status();
  EXPECT_FALSE(std::filesystem::exists(path)) << "a refused start bound the socket";
}

// gRPC unlinks whatever socket is at the path before it binds: without the check a second
// server would take a live server's path and leave the first unreachable.
TEST(UnixSocketTest, NeverTakesOverALiveServersSocket) {
  TempDir dir;
  const config::Profile profile = LoadOrDie(TinyProfilePath());
  const std::string address = "unix:" + dir.path + "/grpc.sock";
  absl::StatusOr<std::unique_ptr<service::Server>> first =
      service::Server::Start(Options(profile, {address}));
  ASSERT_TRUE(first.ok()) << first.status();
  struct stat before = {};
  ASSERT_EQ(::lstat((dir.path + "/grpc.sock").c_str(), &before), 0);

  absl::StatusOr<std::unique_ptr<service::Server>> second =
      service::Server::Start(Options(profile, {address}));
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kAlreadyExists) << second.status();
  EXPECT_NE(second.status().message().find("another process is serving on it"), std::string::npos)
      << second.status();

  struct stat after = {};
  ASSERT_EQ(::lstat((dir.path + "/grpc.sock").c_str(), &after), 0);
  EXPECT_EQ(after.st_ino, before.st_ino) << "the first server's socket file was replaced";
  absl::StatusOr<std::unique_ptr<client::IndexerClient>> c =
      client::IndexerClient::Connect(address);
  ASSERT_TRUE(c.ok()) << c.status();
  absl::StatusOr<v1::ServerInfo> info = (*c)->ServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();

  // The same for an abstract name (no file: the probe is the only guard there).
  const std::string abstract =
      "unix-abstract:di-uds-test-" + std::to_string(getpid()) + "-" + std::to_string(TestSeed());
  absl::StatusOr<std::unique_ptr<service::Server>> third =
      service::Server::Start(Options(profile, {abstract}));
  ASSERT_TRUE(third.ok()) << third.status();
  absl::StatusOr<std::unique_ptr<service::Server>> fourth =
      service::Server::Start(Options(profile, {abstract}));
  ASSERT_FALSE(fourth.ok());
  EXPECT_EQ(fourth.status().code(), absl::StatusCode::kAlreadyExists) << fourth.status();
}

// A live server that is slow to accept (its backlog full) is neither taken over nor waited
// for: a blocking probe would hang the start until it accepts, so the probe does not block and
// a socket it cannot judge is refused.
TEST(UnixSocketTest, RefusesASocketWhoseBacklogIsFullWithoutWaiting) {
  TempDir dir;
  const std::string path = dir.path + "/grpc.sock";
  sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  const int listener = ::socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(listener, 0);
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(listener, 0), 0);  // never accepts
  std::vector<int> queued;
  bool full = false;
  for (int i = 0; i < 64 && !full; ++i) {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0);
    ASSERT_GE(fd, 0);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
      queued.push_back(fd);
    } else {
      EXPECT_EQ(errno, EAGAIN) << std::strerror(errno);
      full = true;
      ::close(fd);
    }
  }
  ASSERT_TRUE(full) << "the backlog never filled";
  absl::StatusOr<std::unique_ptr<service::Server>> server =
      service::Server::Start(Options(LoadOrDie(TinyProfilePath()), {"unix:" + path}));
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kFailedPrecondition) << server.status();
  EXPECT_NE(server.status().message().find("cannot tell whether the socket there is in use"),
            std::string::npos)
      << server.status();
  EXPECT_TRUE(IsSocket(path)) << "the live socket's file was removed";
  for (int fd : queued) ::close(fd);
  ::close(listener);
}

// A socket file left by a server that was killed (nobody accepting on it) is replaced.
TEST(UnixSocketTest, ReplacesAStaleSocketOfAKilledServer) {
  TempDir dir;
  const std::string path = dir.path + "/grpc.sock";
  {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    sockaddr_un addr = {};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path.data(), path.size());
    ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    ASSERT_EQ(::listen(fd, 1), 0);
    ::close(fd);  // what a SIGKILL leaves: the file, and nobody accepting
  }
  ASSERT_TRUE(IsSocket(path));
  absl::StatusOr<std::unique_ptr<service::Server>> server =
      service::Server::Start(Options(LoadOrDie(TinyProfilePath()), {"unix:" + path}));
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<std::unique_ptr<client::IndexerClient>> c =
      client::IndexerClient::Connect((*server)->address());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE((*c)->ServerInfo().ok());
}

}  // namespace
}  // namespace decode_indexer::testing
