// The server on a Unix domain socket (--listen unix:PATH, beside or instead of TCP): what the
// listen addresses parse to (one address, or two TCP ones that overlap, refused), unary and
// streamed steps over the socket answering what the reference answers, the socket file removed
// at shutdown, and the addresses that cannot be served refused with a message naming why,
// before anything is allocated (a live server's socket is never taken over, nor one another
// server holds the lock of, even when both start at the same instant); --socket-mode on every
// socket file; --shm-socket's path checked as early, and never one of --listen's.
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "server/service/listen_address.h"
#include "tests/service/service_harness.h"
#include "tests/service/socket_test_util.h"
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

// Two TCP addresses that bind one address on one port are refused too: gRPC sets SO_REUSEPORT,
// so both binds succeed and two listeners of one server split the port's connections (without
// it the second fails, unexplained). A wildcard host takes its port on every address, localhost
// is 127.0.0.1 and [::1], an IP literal is itself however written; port 0 picks a port each.
TEST(ListenAddressTest, RefusesTcpAddressesThatOverlap) {
  struct Case {
    std::string first, second, why;
  };
  const std::string wildcard = "a wildcard host (0.0.0.0, [::]) takes port 50051 on every address";
  for (const Case& c : std::vector<Case>{
           {"localhost:50051", "LOCALHOST:50051", "the same address as \"localhost:50051\""},
           {"[::1]:50051", "[0:0::1]:50051", "the same address as \"[::1]:50051\""},
           {"127.0.0.1:50051", "127.1:50051", "the same address as \"127.0.0.1:50051\""},
           {"127.0.0.1:50051", "[::ffff:127.0.0.1]:50051", "the same address as"},
           {"127.0.0.1:8080", "127.0.0.1:08080", "the same address as"},
           {"0.0.0.0:50051", "[::]:50051", "the same address as \"0.0.0.0:50051\""},
           {"0.0.0.0:50051", ":50051", "the same address as"},
           {"localhost:50051", "127.0.0.1:50051",
            "overlaps \"localhost:50051\": both bind 127.0.0.1 port 50051"},
           {"[::1]:50051", "localhost:50051",
            "overlaps \"[::1]:50051\": both bind [::1] port 50051"},
           {"0.0.0.0:50051", "127.0.0.1:50051", "overlaps \"0.0.0.0:50051\": " + wildcard},
           {"0.0.0.0:50051", "[::1]:50051", wildcard},
           {"10.1.2.3:50051", "[::]:50051", "overlaps \"10.1.2.3:50051\": " + wildcard},
           {"db.example:50051", "0.0.0.0:50051", wildcard},
       }) {
    absl::StatusOr<std::vector<ListenAddress>> got =
        service::ParseListenAddresses({"unix:/run/di/grpc.sock", c.first, c.second});
    ASSERT_FALSE(got.ok()) << c.first << " and " << c.second;
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
    EXPECT_NE(got.status().message().find("listen: \"" + c.second + "\": "), std::string::npos)
        << got.status();
    EXPECT_NE(got.status().message().find(c.why), std::string::npos) << got.status();
  }
  for (const auto& [first, second] : std::vector<std::pair<std::string, std::string>>{
           {"0.0.0.0:0", "127.0.0.1:0"},
           {"localhost:0", "localhost:0"},
           {"127.0.0.1:50051", "127.0.0.2:50051"},
           {"127.0.0.1:50051", "[::1]:50051"},
           {"localhost:50051", "127.0.0.1:50052"},
           {"0.0.0.0:50051", "127.0.0.1:50052"},
           {"db.example:50051", "db2.example:50051"},
           {"0.0.0.0:50051", "unix:/run/di/grpc.sock"},
       }) {
    absl::StatusOr<std::vector<ListenAddress>> got = service::ParseListenAddresses({first, second});
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->size(), 2u);
    EXPECT_EQ((*got)[1].address, second);
  }
}

// --shm-socket on one of --listen's socket paths, however either is spelled: refused naming
// both flags (gRPC would unlink the shared-memory socket to bind its own).
TEST(ListenAddressTest, RefusesAnShmSocketThatIsAListenPath) {
  const std::string cwd = std::filesystem::current_path().string();
  for (const auto& [listen, shm] : std::vector<std::pair<std::string, std::string>>{
           {"unix:/run/di/x.sock", "/run/di/x.sock"},
           {"unix:///run/di/x.sock", "/run/di/./x.sock"},
           {"unix:x.sock", "./x.sock"},
           {"unix:" + cwd + "/x.sock", "x.sock"},
           {"unix:x.sock", cwd + "/sub/../x.sock"},
       }) {
    absl::StatusOr<std::vector<ListenAddress>> parsed =
        service::ParseListenAddresses({"127.0.0.1:0", listen});
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    const absl::Status s = service::CheckShmSocketIsNotListened(shm, *parsed);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << listen << " and " << shm;
    EXPECT_NE(s.message().find("shm-socket: \"" + shm + "\" is the socket of --listen \"" + listen +
                               "\""),
              std::string::npos)
        << s;
  }
  absl::StatusOr<std::vector<ListenAddress>> parsed = service::ParseListenAddresses(
      {"unix:/run/di/grpc.sock", "unix-abstract:/run/di/shm.sock", "127.0.0.1:0"});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  for (const std::string shm : {"/run/di/shm.sock", "", "grpc.sock"}) {
    EXPECT_TRUE(service::CheckShmSocketIsNotListened(shm, *parsed).ok()) << shm;
  }
}

TEST(ListenAddressTest, ParsesSocketMode) {
  for (const auto& [text, mode] : std::vector<std::pair<std::string, int>>{{"0660", 0660},
                                                                           {"660", 0660},
                                                                           {"0", 0},
                                                                           {"0777", 0777},
                                                                           {"600", 0600},
                                                                           {"00660", 0660}}) {
    absl::StatusOr<int> got = service::ParseSocketMode(text);
    ASSERT_TRUE(got.ok()) << text << ": " << got.status();
    EXPECT_EQ(*got, mode) << text;
  }
  for (const std::string text :
       {"", "0888", "01000", "1777", "4755", "0x1ff", "-1", "66o", "07770"}) {
    absl::StatusOr<int> got = service::ParseSocketMode(text);
    ASSERT_FALSE(got.ok()) << text;
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(got.status().message().find("socket-mode: \"" + text +
                                          "\": expected an octal file mode of at most 0777"),
              std::string::npos)
        << got.status();
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
  // The first server's lock refuses it before the probe would.
  EXPECT_NE(second.status().message().find("another server holds " + dir.path + "/grpc.sock"),
            std::string::npos)
      << second.status();

  struct stat after = {};
  ASSERT_EQ(::lstat((dir.path + "/grpc.sock").c_str(), &after), 0);
  EXPECT_EQ(after.st_ino, before.st_ino) << "the first server's socket file was replaced";
  absl::StatusOr<std::unique_ptr<client::IndexerClient>> c =
      client::IndexerClient::Connect(address);
  ASSERT_TRUE(c.ok()) << c.status();
  absl::StatusOr<v1::ServerInfo> info = (*c)->ServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();

  // A live listener that takes no lock (another program, a server of an older version) is
  // found by the probe.
  const std::string other_path = dir.path + "/other.sock";
  const int other = ::socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(other, 0);
  sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, other_path.data(), other_path.size());
  ASSERT_EQ(::bind(other, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(other, 4), 0);
  absl::StatusOr<std::unique_ptr<service::Server>> beside =
      service::Server::Start(Options(profile, {"unix:" + other_path}));
  ASSERT_FALSE(beside.ok());
  EXPECT_EQ(beside.status().code(), absl::StatusCode::kAlreadyExists) << beside.status();
  EXPECT_NE(beside.status().message().find("another process is serving on it"), std::string::npos)
      << beside.status();
  EXPECT_TRUE(IsSocket(other_path));
  ::close(other);

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

// TCP too: gRPC's default SO_REUSEPORT would let a second server bind a live server's
// host:port and split the connections between two processes holding different sequences.
TEST(UnixSocketTest, NeverSharesATcpPortWithALiveServer) {
  const config::Profile profile = LoadOrDie(TinyProfilePath());
  absl::StatusOr<std::unique_ptr<service::Server>> first =
      service::Server::Start(Options(profile, {"127.0.0.1:0"}));
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string taken = (*first)->address();
  absl::StatusOr<std::unique_ptr<service::Server>> second =
      service::Server::Start(Options(profile, {taken}));
  ASSERT_FALSE(second.ok()) << "a second server started on " << taken;
  EXPECT_NE(second.status().message().find(taken), std::string::npos) << second.status();
}

// A live server that is slow to accept (its backlog full) is neither taken over nor waited
// for: a blocking probe would hang the start until it accepts, so the probe does not block and
// a socket it cannot judge is refused.
TEST(UnixSocketTest, RefusesASocketWhoseBacklogIsFullWithoutWaiting) {
  TempDir dir;
  const std::string path = dir.path + "/grpc.sock";
  BusyUnixListener listener(path, SOCK_STREAM, /*fill=*/true);
  ASSERT_TRUE(listener.full()) << "the backlog never filled";
  absl::StatusOr<std::unique_ptr<service::Server>> server =
      service::Server::Start(Options(LoadOrDie(TinyProfilePath()), {"unix:" + path}));
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kFailedPrecondition) << server.status();
  EXPECT_NE(server.status().message().find("cannot tell whether the socket there is in use"),
            std::string::npos)
      << server.status();
  EXPECT_TRUE(IsSocket(path)) << "the live socket's file was removed";
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

// Checking a path and binding it are two steps: the path's lock (PATH.lock, flock) is taken
// before the check and held while the server lives, so a server whose path another server holds
// is refused at once, naming the path, and binds nothing; the shared-memory socket likewise. The
// lock file goes with its server, and one a killed server left holds nothing.
TEST(UnixSocketTest, RefusesAPathWhoseLockAnotherServerHolds) {
  TempDir dir;
  const config::Profile profile = LoadOrDie(TinyProfilePath());
  const std::string path = dir.path + "/grpc.sock";
  const std::string shm = dir.path + "/shm.sock";
  {
    // What a server starting on the path at this instant holds, before anything is bound.
    absl::StatusOr<service::SocketPathLock> other = service::SocketPathLock::Acquire(path, "test");
    ASSERT_TRUE(other.ok()) << other.status();
    absl::StatusOr<service::SocketPathLock> other_shm =
        service::SocketPathLock::Acquire(shm, "test");
    ASSERT_TRUE(other_shm.ok()) << other_shm.status();

    absl::StatusOr<std::unique_ptr<service::Server>> server =
        service::Server::Start(Options(profile, {"127.0.0.1:0", "unix:" + path}));
    ASSERT_FALSE(server.ok());
    EXPECT_EQ(server.status().code(), absl::StatusCode::kAlreadyExists) << server.status();
    EXPECT_NE(server.status().message().find("listen: \"unix:" + path +
                                             "\": another server holds " + path),
              std::string::npos)
        << server.status();
    EXPECT_FALSE(std::filesystem::exists(path)) << "a refused start bound the socket";

    service::ServerOptions with_shm = Options(profile, {"127.0.0.1:0"});
    with_shm.shm_socket = shm;
    server = service::Server::Start(with_shm);
    ASSERT_FALSE(server.ok());
    EXPECT_EQ(server.status().code(), absl::StatusCode::kAlreadyExists) << server.status();
    EXPECT_NE(
        server.status().message().find("shm-socket: \"" + shm + "\": another server holds " + shm),
        std::string::npos)
        << server.status();
    EXPECT_FALSE(std::filesystem::exists(shm)) << "a refused start bound the socket";
  }
  // Let go: both start, and hold the paths against a second server in this process.
  service::ServerOptions both = Options(profile, {"unix:" + path});
  both.shm_socket = shm;
  absl::StatusOr<std::unique_ptr<service::Server>> first = service::Server::Start(both);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_FALSE(service::SocketPathLock::Acquire(path, "test").ok());
  EXPECT_FALSE(service::SocketPathLock::Acquire(shm, "test").ok());
  (*first)->Shutdown(std::chrono::seconds(2));
  first->reset();
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE(std::filesystem::exists(shm));
  EXPECT_FALSE(std::filesystem::exists(path + ".lock")) << "its holder removes it";
  EXPECT_FALSE(std::filesystem::exists(shm + ".lock")) << "its holder removes it";
  // A lock file a killed server left behind holds nothing.
  std::ofstream(path + ".lock") << "";
  absl::StatusOr<std::unique_ptr<service::Server>> again = service::Server::Start(both);
  ASSERT_TRUE(again.ok()) << "a leftover lock file held the path: " << again.status();
}

// The lock file goes with its lock, yet the lock never has two holders: threads taking and
// letting go of one path's lock as fast as they can are never in it together. (Without the
// check that the path still names the file just locked, a thread that opened the file just
// before its holder removed it would lock the removed file while another locked the new one.)
TEST(SocketPathLockTest, NeverTwoHoldersWhileHoldersRemoveTheFile) {
  TempDir dir;
  const std::string path = dir.path + "/grpc.sock";
  constexpr int kThreads = 4;
  std::atomic<int> inside{0};
  std::atomic<int> most{0};
  std::atomic<int> taken{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 3000; ++i) {
        absl::StatusOr<service::SocketPathLock> lock =
            service::SocketPathLock::Acquire(path, "test");
        if (!lock.ok()) {
          EXPECT_EQ(lock.status().code(), absl::StatusCode::kAlreadyExists) << lock.status();
          continue;
        }
        const int now = inside.fetch_add(1) + 1;
        int seen = most.load();
        while (now > seen && !most.compare_exchange_weak(seen, now)) {
        }
        taken.fetch_add(1);
        std::this_thread::yield();
        inside.fetch_sub(1);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(most.load(), 1) << "two holders of one lock at once";
  EXPECT_GT(taken.load(), 0);
  EXPECT_FALSE(std::filesystem::exists(path + ".lock"));
}

// Servers started on one path at the same instant: exactly one serves on it, the others are
// refused. Without the lock each found the path free and the last to bind took it, so several
// "started", all but one unreachable.
TEST(UnixSocketTest, ServersStartingAtOnceOnOnePathExactlyOneWins) {
  TempDir dir;
  const config::Profile profile = LoadOrDie(TinyProfilePath());
  const std::string address = "unix:" + dir.path + "/grpc.sock";
  constexpr int kServers = 6;
  std::vector<service::ServerOptions> options(kServers, Options(profile, {address}));
  int winners = 0;
  auto started = StartAllAtOnce<std::unique_ptr<service::Server>>(
      kServers, [&](int i) { return service::Server::Start(options[i]); }, dir.path + "/grpc.sock",
      &winners);
  EXPECT_EQ(winners, 1);
  absl::StatusOr<std::unique_ptr<client::IndexerClient>> c =
      client::IndexerClient::Connect(address);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE((*c)->ServerInfo().ok()) << "the winner is not reachable on its socket";
}

// A bad --shm-socket fails the start before the executor allocates its caches, as a bad
// --listen does: with a cache the executor refuses (2^40 pages a pool), the answer says which
// came first.
TEST(UnixSocketTest, ChecksEverySocketPathBeforeAllocating) {
  TempDir dir;
  const std::string file = dir.path + "/not-a-socket";
  std::ofstream(file) << "x";
  const int live = ::socket(AF_UNIX, SOCK_SEQPACKET, 0);
  ASSERT_GE(live, 0);
  const std::string live_path = dir.path + "/live.sock";
  sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, live_path.data(), live_path.size());
  ASSERT_EQ(::bind(live, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(live, 4), 0);
  service::ServerOptions options = Options(LoadOrDie(TinyProfilePath()), {"127.0.0.1:0"});
  options.executor.cache_pages = int64_t{1} << 40;
  {
    absl::StatusOr<std::unique_ptr<service::Server>> server = service::Server::Start(options);
    ASSERT_FALSE(server.ok());
    ASSERT_NE(server.status().message().find("cache_pages"), std::string::npos)
        << "the executor no longer refuses this cache: " << server.status();
  }
  struct Case {
    std::vector<std::string> listen;
    std::string shm_socket, why;
  };
  for (const Case& c : std::vector<Case>{
           {{"127.0.0.1:0"},
            dir.path + "/missing/shm.sock",
            "shm-socket: \"" + dir.path + "/missing/shm.sock\": directory"},
           {{"127.0.0.1:0"}, file, "shm-socket: " + file + " exists and is not a socket"},
           {{"127.0.0.1:0"}, live_path, "shm-socket: another server is listening on " + live_path},
           {{"127.0.0.1:0"}, dir.path + "/" + std::string(120, 's'), "shm-socket: a path of"},
           {{"unix:" + dir.path + "/missing/grpc.sock"}, "", "listen: "},
           {{"unix:" + file}, "", "listen: "},
       }) {
    options.listen = c.listen;
    options.shm_socket = c.shm_socket;
    absl::StatusOr<std::unique_ptr<service::Server>> server = service::Server::Start(options);
    ASSERT_FALSE(server.ok()) << c.why;
    EXPECT_NE(server.status().message().find(c.why), std::string::npos)
        << "not refused before the caches were allocated: " << server.status();
  }
  ::close(live);
}

// --socket-mode: every socket file the server creates gets the mode right after its bind
// (gRPC's unix: paths and the shared-memory socket); without it the shm socket is 0600 and a
// unix: path what the umask leaves. A mode over 0777 is refused.
TEST(UnixSocketTest, SocketModeIsAppliedToEverySocketFile) {
  TempDir dir;
  const config::Profile profile = LoadOrDie(TinyProfilePath());
  const std::string grpc_path = dir.path + "/grpc.sock";
  const std::string shm_path = dir.path + "/shm.sock";
  auto mode_of = [](const std::string& path) {
    struct stat st = {};
    EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
    return static_cast<int>(st.st_mode & 07777);
  };
  for (const int mode : {0640, 0606, 0700}) {
    service::ServerOptions options = Options(profile, {"unix:" + grpc_path, "127.0.0.1:0"});
    options.shm_socket = shm_path;
    options.socket_mode = mode;
    absl::StatusOr<std::unique_ptr<service::Server>> server = service::Server::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    EXPECT_EQ(mode_of(grpc_path), mode) << std::oct << mode;
    EXPECT_EQ(mode_of(shm_path), mode) << std::oct << mode;
    absl::StatusOr<std::unique_ptr<client::IndexerClient>> c =
        client::IndexerClient::Connect("unix:" + grpc_path);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_TRUE((*c)->ServerInfo().ok());
  }
  {
    service::ServerOptions options = Options(profile, {"unix:" + grpc_path});
    options.shm_socket = shm_path;
    absl::StatusOr<std::unique_ptr<service::Server>> server = service::Server::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    EXPECT_EQ(mode_of(shm_path), 0600);
  }
  service::ServerOptions options = Options(profile, {"unix:" + grpc_path});
  options.socket_mode = 01777;
  absl::StatusOr<std::unique_ptr<service::Server>> server = service::Server::Start(options);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument) << server.status();
  EXPECT_NE(server.status().message().find("socket_mode: expected a file mode of 0..0777"),
            std::string::npos)
      << server.status();
}

// An abstract name has no file and takes no lock: a second bind of it fails with EADDRINUSE,
// which gRPC reports as its error, and the start is refused naming the address. Here the name
// is held by a socket that is bound but not listening, so the probe finds no server.
TEST(UnixSocketTest, AnAbstractNameInUseIsRefused) {
  const std::string name =
      "di-uds-held-" + std::to_string(getpid()) + "-" + std::to_string(TestSeed());
  const int holder = ::socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(holder, 0);
  sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  ASSERT_EQ(::bind(holder, reinterpret_cast<sockaddr*>(&addr),
                   static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size())),
            0);
  absl::StatusOr<std::unique_ptr<service::Server>> server = service::Server::Start(
      Options(LoadOrDie(TinyProfilePath()), {"127.0.0.1:0", "unix-abstract:" + name}));
  ::close(holder);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kAlreadyExists) << server.status();
  EXPECT_NE(server.status().message().find(
                "listen: \"unix-abstract:" + name +
                "\": another process holds the abstract name (bind: Address already in use)"),
            std::string::npos)
      << server.status();
}

}  // namespace
}  // namespace decode_indexer::testing
