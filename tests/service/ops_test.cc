// Serving operations: Prometheus metrics agree with GetStatistics, a step whose deadline
// passed while queued changes nothing, bearer-token authentication (health exempt), and TLS /
// mutual TLS with certificates made by the openssl CLI (skipped, visibly, without it).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <thread>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>

#include <nlohmann/json.hpp>

#include "health_subset.grpc.pb.h"
#include "server/service/data_plane.h"
#include "server/service/gpu_utilization.h"
#include "server/service/logging.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"
#include "tests/service/service_harness.h"

namespace decode_indexer::testing {
namespace {

// The test's seed (tests/test_seed.h): printed when the test fails; DI_TEST_SEED replays it.
uint64_t Seed() { return TestSeed(); }

struct OpsSession {
  config::Profile profile;
  std::unique_ptr<service::Server> server;
};

std::unique_ptr<OpsSession> StartOps(service::ServerOptions so) {
  auto s = std::make_unique<OpsSession>();
  so.listen = {"127.0.0.1:0"};
  s->profile = so.profile;
  absl::StatusOr<std::unique_ptr<service::Server>> server = service::Server::Start(so);
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return nullptr;
  s->server = std::move(*server);
  return s;
}

service::ServerOptions BaseOptions(int ranks = 1) {
  service::ServerOptions so;
  so.profile = LoadOrDie(TinyProfilePath());
  so.executor = CpuOptions(ranks, 64);
  so.grpc_edge = TestEdge();
  return so;
}

// A plain HTTP/1.0 exchange with 127.0.0.1:port: answers {status line, body}.
std::pair<std::string, std::string> HttpRequest(int port, const std::string& request) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  EXPECT_GE(fd, 0);
  // A generous deadline, only so that a wedged server fails the test instead of hanging it.
  timeval tv = {60, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    ADD_FAILURE() << "cannot connect to the metrics port " << port;
    return {};
  }
  EXPECT_EQ(send(fd, request.data(), request.size(), 0), static_cast<ssize_t>(request.size()));
  std::string reply;
  char buf[4096];
  ssize_t n;
  while ((n = recv(fd, buf, sizeof(buf), 0)) > 0) reply.append(buf, static_cast<size_t>(n));
  close(fd);
  const size_t eol = reply.find("\r\n");
  const size_t body = reply.find("\r\n\r\n");
  if (eol == std::string::npos || body == std::string::npos) return {reply, ""};
  return {reply.substr(0, eol), reply.substr(body + 4)};
}

// "name{labels}" -> value, from the exposition text; every sample line must parse.
std::map<std::string, double> ParseMetrics(const std::string& text) {
  std::map<std::string, double> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t sp = line.rfind(' ');
    EXPECT_NE(sp, std::string::npos) << line;
    if (sp == std::string::npos) continue;
    EXPECT_TRUE(line.rfind("decode_indexer_", 0) == 0 || line.rfind("process_", 0) == 0) << line;
    const std::string value = line.substr(sp + 1);
    out[line.substr(0, sp)] = value == "+Inf" ? INFINITY : std::stod(value);
  }
  return out;
}

// Sum of every sample whose key starts with `prefix`.
double SumPrefix(const std::map<std::string, double>& m, const std::string& prefix) {
  double sum = 0;
  for (auto it = m.lower_bound(prefix); it != m.end() && it->first.rfind(prefix, 0) == 0; ++it) {
    sum += it->second;
  }
  return sum;
}

const v1::RpcStatistics* FindRpc(const v1::Statistics& st, const std::string& method) {
  for (const v1::RpcStatistics& r : st.rpcs()) {
    if (r.method() == method) return &r;
  }
  return nullptr;
}

// Every layer kind steps a few times, sharded (2 ranks, 3 requests) and not, plus a rejected
// step; then the scrape must agree with GetStatistics and ServerInfo.
// Which NVML device a rank's utilisation is read from: NVML ignores CUDA_VISIBLE_DEVICES, so
// the mapping must follow it (a wrong mapping reports another GPU's load as ours).
TEST(MetricsTest, UtilizationFollowsCudaVisibleDevices) {
  using service::NvmlDevicesForRanks;
  EXPECT_EQ(NvmlDevicesForRanks(std::nullopt, 2), (std::vector<std::string>{"0", "1"}));
  EXPECT_EQ(NvmlDevicesForRanks(std::string(""), 2), (std::vector<std::string>{"0", "1"}));
  EXPECT_EQ(NvmlDevicesForRanks(std::string("3, 1"), 2), (std::vector<std::string>{"3", "1"}));
  EXPECT_EQ(NvmlDevicesForRanks(std::string("GPU-ab12,GPU-cd34"), 2),
            (std::vector<std::string>{"GPU-ab12", "GPU-cd34"}));
  // A rank beyond the list has no device to report.
  EXPECT_EQ(NvmlDevicesForRanks(std::string("5"), 2), (std::vector<std::string>{"5", ""}));
}

TEST(MetricsTest, ScrapeAgreesWithStatistics) {
  service::ServerOptions so = BaseOptions(2);
  so.metrics_listen = "127.0.0.1:0";
  auto s = StartOps(so);
  ASSERT_NE(s, nullptr);
  ASSERT_GT(s->server->metrics_port(), 0);
  auto c = client::IndexerClient::Connect(s->server->address());
  ASSERT_TRUE(c.ok()) << c.status();
  Session session{s->profile, nullptr, std::move(*c)};
  ServiceOracle oracle(s->profile, 64, Seed());
  Gen gen(Seed());
  const std::vector<uint64_t> ids = {11, 12, 13, 14};
  const std::vector<int64_t> lengths = {40 + int64_t(gen.rng()() % 60), 70, 33,
                                        20 + int64_t(gen.rng()() % 9)};
  Prefill(session, oracle, gen, ids, lengths, {0, 1, 2});
  uint64_t step_id = 1;
  for (int round = 0; round < 2; ++round) {
    // All four requests, two rows each (sharded: 2 ranks, row_shard_min_requests 2, whole
    // requests on even rows), then one request of one row (unsharded).
    const std::vector<uint64_t> some = round == 0 ? ids : std::vector<uint64_t>{ids[0]};
    for (int layer : {0, 2, 3}) {
      // Positions only feed RoPE; the oracle sees the same request.
      std::vector<int64_t> before(lengths.begin(), lengths.begin() + some.size());
      v1::DecodeStepRequest req = MakeStep(gen, s->profile, layer, some, before, round == 0 ? 2 : 1,
                                           QForm::kF32Rope, KeyForm::kF32, step_id++);
      StepAndCompare(session, oracle, req, "metrics step");
    }
  }
  v1::DecodeStepRequest bad =
      MakeStep(gen, s->profile, 0, {999}, {0}, 1, QForm::kF32NoRope, KeyForm::kF32, 99);
  EXPECT_EQ(session.client->DecodeStep(bad).status().code(), absl::StatusCode::kNotFound);

  auto [status, body] = HttpRequest(s->server->metrics_port(), "GET /metrics HTTP/1.0\r\n\r\n");
  ASSERT_EQ(status, "HTTP/1.1 200 OK") << body;
  absl::StatusOr<v1::Statistics> st = session.client->GetStatistics();
  ASSERT_TRUE(st.ok()) << st.status();
  absl::StatusOr<v1::ServerInfo> info = session.client->ServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  const std::map<std::string, double> m = ParseMetrics(body);

  EXPECT_GT(st->steps(), 0u);
  EXPECT_GT(st->steps_sharded(), 0u);
  EXPECT_GT(st->steps_unsharded(), 0u);
  EXPECT_EQ(m.at("decode_indexer_steps_total"), st->steps());
  EXPECT_EQ(m.at("decode_indexer_steps_sharded_total"), st->steps_sharded());
  EXPECT_EQ(m.at("decode_indexer_steps_unsharded_total"), st->steps_unsharded());
  EXPECT_EQ(m.at("decode_indexer_rows_scored_total"), st->rows_scored());
  for (const char* event : {"captured", "replayed", "evicted"}) {  // the CPU has no graphs
    EXPECT_EQ(m.at(std::string("decode_indexer_step_graphs_total{event=\"") + event + "\"}"), 0);
  }
  EXPECT_EQ(m.at("decode_indexer_sequences"), st->sequences());
  EXPECT_EQ(m.at("decode_indexer_healthy"), st->healthy() ? 1 : 0);
  EXPECT_TRUE(st->healthy());
  EXPECT_TRUE(info->healthy());
  EXPECT_FALSE(st->collective().empty());
  EXPECT_EQ(info->collective(), st->collective());
  EXPECT_NEAR(m.at("decode_indexer_compute_seconds_total"), st->compute_us_total() * 1e-6, 1e-9);
  EXPECT_NEAR(m.at("decode_indexer_collective_seconds_total"), st->collective_us_total() * 1e-6,
              1e-9);
  // Every successful step observed once by kind and once by rows.
  double kinds = 0;
  for (const char* k : {"dense", "source", "consumer"}) {
    const double n =
        m.at(std::string("decode_indexer_step_latency_seconds_count{kind=\"") + k + "\"}");
    EXPECT_GT(n, 0) << k;
    kinds += n;
  }
  EXPECT_EQ(kinds, st->steps());
  EXPECT_EQ(m.at("decode_indexer_rows_per_step_count"), st->steps());
  EXPECT_EQ(m.at("decode_indexer_rows_per_step_sum"), st->rows_scored());
  EXPECT_EQ(m.at("decode_indexer_queue_seconds_count"), st->steps());
  // "Queue" is one thing: the histogram sums what GetStatistics sums (each response's
  // ServerTiming.queue_us).
  EXPECT_NEAR(m.at("decode_indexer_queue_seconds_sum"), st->queue_us_total() * 1e-6, 1e-6);
  EXPECT_EQ(m.at("decode_indexer_steps_in_flight"), 0);
  EXPECT_EQ(m.at("decode_indexer_rpc_duration_seconds_count{method=\"DecodeStep\"}"),
            FindRpc(*st, "DecodeStep")->count());
  EXPECT_EQ(m.at("decode_indexer_rpc_duration_seconds_count{method=\"AppendKeys\"}"),
            FindRpc(*st, "AppendKeys")->count());
  // Build info and the process metrics.
  EXPECT_NE(body.find("decode_indexer_build_info{version=\"" DI_TEST_VERSION "\""),
            std::string::npos);
  EXPECT_GT(m.at("process_resident_memory_bytes"), 0);
  EXPECT_GT(m.at("process_open_fds"), 0);
  EXPECT_GT(m.at("process_start_time_seconds"), 1.6e9);
  EXPECT_GE(m.at("process_cpu_seconds_total"), 0);
  // Bucket labels are short decimals (le="2e-05", never le="2.0000000000000002e-05").
  for (size_t at = body.find("le=\""); at != std::string::npos; at = body.find("le=\"", at + 1)) {
    const std::string le = body.substr(at + 4, body.find('"', at + 4) - at - 4);
    EXPECT_LE(le.size(), 6u) << le;
  }
  // Buckets are cumulative and end at the count.
  double prev = 0;
  for (double le : {1, 2, 4, 8, 16}) {
    const double b =
        m.at("decode_indexer_rows_per_step_bucket{le=\"" + std::to_string(int(le)) + "\"}");
    EXPECT_GE(b, prev);
    prev = b;
  }
  EXPECT_EQ(m.at("decode_indexer_rows_per_step_bucket{le=\"+Inf\"}"), st->steps());
  // RPC counters: same counts as GetStatistics (taken after the scrape, so GetStatistics
  // itself is left out).
  for (const v1::RpcStatistics& r : st->rpcs()) {
    if (r.method() == "GetStatistics" || r.method() == "GetServerInfo") continue;
    const std::string prefix = "decode_indexer_rpcs_total{method=\"" + r.method() + "\",";
    EXPECT_EQ(SumPrefix(m, prefix), r.count()) << r.method();
    EXPECT_EQ(SumPrefix(m, prefix) - m.at(prefix + "code=\"OK\"}"), r.errors()) << r.method();
  }
  EXPECT_EQ(m.at("decode_indexer_rpcs_total{method=\"DecodeStep\",code=\"NOT_FOUND\"}"), 1);
  // Pages per cache pool as ServerInfo reports them.
  int64_t in_use = 0;
  for (const v1::CachePoolInfo& pool : info->caches()) {
    const std::string key = "decode_indexer_cache_pages_in_use{cache_layer=\"" +
                            std::to_string(pool.cache_layer()) + "\"}";
    EXPECT_EQ(m.at(key), pool.pages_total() - pool.pages_free()) << key;
    in_use += pool.pages_total() - pool.pages_free();
  }
  EXPECT_GT(in_use, 0);
  EXPECT_EQ(in_use, st->pages_in_use());
  for (int r = 0; r < info->num_ranks(); ++r) {
    EXPECT_EQ(m.count("decode_indexer_device_memory_bytes{rank=\"" + std::to_string(r) +
                      "\",device=\"host\"}"),
              1u);
  }

  EXPECT_EQ(HttpRequest(s->server->metrics_port(), "GET /other HTTP/1.0\r\n\r\n").first,
            "HTTP/1.1 404 Not Found");
  EXPECT_EQ(HttpRequest(s->server->metrics_port(), "POST /metrics HTTP/1.0\r\n\r\n").first,
            "HTTP/1.1 405 Method Not Allowed");
}

// A step queued behind admission whose deadline passes answers DEADLINE_EXCEEDED and changes
// nothing: the same request afterwards answers as on a server that never saw it.
TEST(DeadlineTest, ExpiredWhileQueuedChangesNothing) {
  auto s = StartOps(BaseOptions());
  ASSERT_NE(s, nullptr);
  auto c = client::IndexerClient::Connect(s->server->address());
  ASSERT_TRUE(c.ok()) << c.status();
  Session session{s->profile, nullptr, std::move(*c)};
  ServiceOracle oracle(s->profile, 64, Seed());
  Gen gen(Seed());
  const std::vector<uint64_t> ids = {5, 6};
  const std::vector<int64_t> lengths = {30 + int64_t(gen.rng()() % 30), 50};
  Prefill(session, oracle, gen, ids, lengths, {0});
  const v1::DecodeStepRequest req =
      MakeStep(gen, s->profile, 0, ids, lengths, 2, QForm::kF32Rope, KeyForm::kF32, 7);

  client::ClientOptions short_deadline;
  short_deadline.timeout = std::chrono::milliseconds(200);
  auto impatient = client::IndexerClient::Connect(s->server->address(), short_deadline);
  ASSERT_TRUE(impatient.ok()) << impatient.status();
  {
    service::IndexerService& svc = s->server->service();
    std::unique_lock<std::mutex> hold = svc.HoldStepAdmissionForTesting();
    // The client gives up while the step waits for admission.
    EXPECT_EQ((*impatient)->DecodeStep(req).status().code(), absl::StatusCode::kDeadlineExceeded);
    // The step is queued (a count, not a guess), and its server-side deadline (from its
    // grpc-timeout, later than the client's) has passed before admission is released: the
    // server must then find it expired.
    while (svc.StepsWaitingForAdmissionForTesting() == 0) std::this_thread::yield();
    while (std::chrono::system_clock::now() <= svc.LastQueuedDeadlineForTesting()) {
      std::this_thread::yield();
    }
  }
  // The server answers the abandoned step once admitted; wait until it has been counted.
  uint64_t count = 0;
  for (int i = 0; i < 500 && count == 0; ++i) {
    absl::StatusOr<v1::Statistics> st = session.client->GetStatistics();
    ASSERT_TRUE(st.ok());
    count = FindRpc(*st, "DecodeStep")->count();
    if (count == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(count, 1u);
  absl::StatusOr<v1::Statistics> st = session.client->GetStatistics();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->steps(), 0u);
  EXPECT_EQ(FindRpc(*st, "DecodeStep")->errors(), 1u);
  EXPECT_NE(s->server->service().RenderMetrics().find(
                "decode_indexer_rpcs_total{method=\"DecodeStep\",code=\"DEADLINE_EXCEEDED\"} 1"),
            std::string::npos);
  StepAndCompare(session, oracle, req, "after the expired step");
}

TEST(AuthTest, BearerTokenRequiredHealthExempt) {
  service::ServerOptions so = BaseOptions();
  so.auth_token = "tok-" + std::to_string(Seed());
  auto s = StartOps(so);
  ASSERT_NE(s, nullptr);

  auto anonymous = client::IndexerClient::Connect(s->server->address());
  ASSERT_TRUE(anonymous.ok());
  client::ClientOptions wrong_opts;
  wrong_opts.auth_token = so.auth_token + "x";
  auto wrong = client::IndexerClient::Connect(s->server->address(), wrong_opts);
  ASSERT_TRUE(wrong.ok());
  client::ClientOptions right_opts;
  right_opts.auth_token = so.auth_token;
  auto right = client::IndexerClient::Connect(s->server->address(), right_opts);
  ASSERT_TRUE(right.ok());

  for (auto* cl : {anonymous->get(), wrong->get()}) {
    EXPECT_EQ(cl->ServerInfo().status().code(), absl::StatusCode::kUnauthenticated);
    EXPECT_EQ(cl->CreateSequence(1).code(), absl::StatusCode::kUnauthenticated);
    EXPECT_EQ(cl->GetStatistics().status().code(), absl::StatusCode::kUnauthenticated);
    v1::DecodeStepRequest req;
    EXPECT_EQ(cl->DecodeStep(req).status().code(), absl::StatusCode::kUnauthenticated);
    auto stream = cl->OpenStream();
    ASSERT_TRUE(stream.ok());
    EXPECT_EQ((*stream)->Step(req).status().code(), absl::StatusCode::kUnauthenticated);
  }
  // Nothing the rejected calls asked for happened.
  ASSERT_TRUE((*right)->CreateSequence(1).ok());
  absl::StatusOr<v1::ServerInfo> info = (*right)->ServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->sequences(), 1);

  std::shared_ptr<grpc::Channel> ch =
      grpc::CreateChannel(s->server->address(), grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(ch);
  grpc::ClientContext hctx;
  grpc::health::v1::HealthCheckResponse hres;
  ASSERT_TRUE(health->Check(&hctx, grpc::health::v1::HealthCheckRequest(), &hres).ok());
  EXPECT_EQ(hres.status(), grpc::health::v1::HealthCheckResponse::SERVING);
}

// The message-size limit is explicit and enforced both ways; keepalive settings on both ends
// leave a working connection.
TEST(LimitsTest, MessageSizeLimitAndKeepalive) {
  service::ServerOptions so = BaseOptions();
  so.max_message_bytes = 64 << 10;
  so.keepalive_time_ms = 10000;
  so.keepalive_timeout_ms = 5000;
  so.keepalive_min_ping_ms = 5000;
  auto s = StartOps(so);
  ASSERT_NE(s, nullptr);
  client::ClientOptions co;
  co.keepalive_time_ms = 10000;
  co.keepalive_timeout_ms = 5000;
  auto c = client::IndexerClient::Connect(s->server->address(), co);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE((*c)->CreateSequence(1).ok());
  Gen gen(Seed());
  const int D = s->profile.head_dim;
  // 64 fp32 keys (32 KiB) fit; 256 (128 KiB) exceed the server's 64 KiB.
  std::vector<float> small = gen.Normal(size_t(64) * D), big = gen.Normal(size_t(256) * D);
  absl::StatusOr<int64_t> ok = (*c)->AppendKeys(1, 0, small, D);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, 64);
  EXPECT_EQ((*c)->AppendKeys(1, 0, big, D).status().code(), absl::StatusCode::kResourceExhausted);
  absl::StatusOr<v1::ServerInfo> info = (*c)->ServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->sequences(), 1);
}

// Certificates from the openssl CLI: a CA, a server cert for localhost/127.0.0.1, a client
// cert, and an unrelated CA (other-ca.pem) that signed nothing here, all EC P-256 (fast).
class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::system("openssl version > /dev/null 2>&1") != 0) {
      GTEST_SKIP() << "openssl CLI not installed: TLS tests skipped";
    }
    dir_ = std::filesystem::temp_directory_path() /
           ("di-tls-" + std::to_string(getpid()) + "-" + std::to_string(Seed() % 100000));
    std::filesystem::create_directories(dir_);
    const std::string d = dir_.string();
    const std::string ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
    const std::string cmd =
        "cd " + d + " && (openssl req -x509 " + ec +
        " -keyout ca.key -out ca.pem -days 2 -subj /CN=di-test-ca && "
        "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > server.ext && "
        "openssl req " +
        ec +
        " -keyout server.key -out server.csr -subj /CN=localhost && "
        "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
        "-out server.pem -days 2 -extfile server.ext && "
        "openssl req " +
        ec +
        " -keyout client.key -out client.csr -subj /CN=di-test-client && "
        "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
        "-out client.pem -days 2 && "
        "openssl req -x509 " +
        ec + " -keyout other-ca.key -out other-ca.pem -days 2 -subj /CN=di-other-ca)";
    ASSERT_EQ(std::system((cmd + " > /dev/null 2>&1").c_str()), 0) << cmd;
  }
  void TearDown() override {
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }
  std::string Path(const char* name) const { return (dir_ / name).string(); }
  std::string Read(const char* name) const {
    std::ifstream in(Path(name));
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  client::ClientOptions Tls(bool with_client_cert) const {
    client::ClientOptions o;
    o.tls_root_ca = Read("ca.pem");
    if (with_client_cert) {
      o.tls_cert = Read("client.pem");
      o.tls_key = Read("client.key");
    }
    o.connect_timeout = std::chrono::milliseconds(0);
    o.timeout = std::chrono::seconds(10);
    return o;
  }

  std::filesystem::path dir_;
};

TEST_F(TlsTest, ServerTls) {
  service::ServerOptions so = BaseOptions();
  so.tls_cert = Path("server.pem");
  so.tls_key = Path("server.key");
  auto s = StartOps(so);
  ASSERT_NE(s, nullptr);
  auto tls = client::IndexerClient::Connect(s->server->address(), Tls(false));
  ASSERT_TRUE(tls.ok()) << tls.status();
  const uint64_t id = Seed() % 1000 + 1;
  ASSERT_TRUE((*tls)->CreateSequence(id).ok());
  absl::StatusOr<v1::ServerInfo> info = (*tls)->ServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->sequences(), 1);

  client::ClientOptions plain;
  plain.connect_timeout = std::chrono::milliseconds(0);
  plain.timeout = std::chrono::seconds(5);
  auto insecure = client::IndexerClient::Connect(s->server->address(), plain);
  ASSERT_TRUE(insecure.ok());
  EXPECT_FALSE((*insecure)->ServerInfo().ok());
}

// A client that trusts another CA, or expects another host name than the certificate's, must
// refuse the server: UNAVAILABLE, and nothing it asked for happens. The same server answers
// a client that trusts its CA under its own name (so the refusals are the checks', not a
// broken setup).
TEST_F(TlsTest, UntrustedCaAndWrongHostnameAreRefused) {
  service::ServerOptions so = BaseOptions();
  so.tls_cert = Path("server.pem");
  so.tls_key = Path("server.key");
  auto s = StartOps(so);
  ASSERT_NE(s, nullptr);

  client::ClientOptions untrusted = Tls(false);
  untrusted.tls_root_ca = Read("other-ca.pem");
  client::ClientOptions wrong_name = Tls(false);
  wrong_name.tls_target_name = "not-the-server.example";
  for (const auto& [what, opts] :
       {std::pair{"untrusted CA", untrusted}, std::pair{"wrong host name", wrong_name}}) {
    SCOPED_TRACE(what);
    auto c = client::IndexerClient::Connect(s->server->address(), opts);
    ASSERT_TRUE(c.ok()) << c.status();  // lazy connect: the handshake fails on the first call
    EXPECT_EQ((*c)->CreateSequence(7).code(), absl::StatusCode::kUnavailable);
    EXPECT_EQ((*c)->ServerInfo().status().code(), absl::StatusCode::kUnavailable);
  }

  client::ClientOptions right_name = Tls(false);
  right_name.tls_target_name = "localhost";
  auto good = client::IndexerClient::Connect(s->server->address(), right_name);
  ASSERT_TRUE(good.ok()) << good.status();
  absl::StatusOr<v1::ServerInfo> info = (*good)->ServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->sequences(), 0);  // the refused clients created nothing
  EXPECT_TRUE((*good)->CreateSequence(7).ok());
}

TEST_F(TlsTest, MutualTlsRequiresClientCertificate) {
  service::ServerOptions so = BaseOptions();
  so.tls_cert = Path("server.pem");
  so.tls_key = Path("server.key");
  so.tls_client_ca = Path("ca.pem");
  auto s = StartOps(so);
  ASSERT_NE(s, nullptr);

  auto mtls = client::IndexerClient::Connect(s->server->address(), Tls(true));
  ASSERT_TRUE(mtls.ok()) << mtls.status();
  Session session{s->profile, nullptr, std::move(*mtls)};
  ServiceOracle oracle(s->profile, 64, Seed());
  Gen gen(Seed());
  Prefill(session, oracle, gen, {3}, {25}, {1});
  StepAndCompare(session, oracle,
                 MakeStep(gen, s->profile, 1, {3}, {25}, 1, QForm::kF32Rope, KeyForm::kF32, 1),
                 "mutual TLS step");

  auto no_cert = client::IndexerClient::Connect(s->server->address(), Tls(false));
  ASSERT_TRUE(no_cert.ok());
  EXPECT_EQ((*no_cert)->ServerInfo().status().code(), absl::StatusCode::kUnavailable);
}

// A connected TCP socket to 127.0.0.1:port (-1 on failure).
int ConnectLoopback(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd >= 0 && connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Three clients connect to the metrics port and send nothing; a scrape is still answered
// while all three are held open (the old single-threaded server served them one after the
// other, closing each on its 2 s timeout before it reached the scrape). The idle timeout is
// set far above anything a loaded machine needs, so this checks order, not speed.
TEST(MetricsTest, IdleConnectionsDoNotBlockAScrape) {
  service::MetricsHttpOptions http;
  http.listen = "127.0.0.1:0";
  http.request_timeout_ms = 120000;
  auto metrics =
      service::MetricsHttpServer::Start(http, [] { return std::string("decode_indexer_up 1\n"); });
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  const int port = (*metrics)->port();
  ASSERT_GT(port, 0);
  std::vector<int> idle;
  for (int i = 0; i < 3; ++i) {
    idle.push_back(ConnectLoopback(port));
    ASSERT_GE(idle.back(), 0);
  }
  auto [status, body] = HttpRequest(port, "GET /metrics HTTP/1.0\r\n\r\n");
  EXPECT_EQ(status, "HTTP/1.1 200 OK");
  EXPECT_EQ(body, "decode_indexer_up 1\n");
  // The idle connections are still open: the scrape did not wait for them to time out.
  for (int fd : idle) {
    char byte;
    const ssize_t n = recv(fd, &byte, 1, MSG_DONTWAIT);
    EXPECT_TRUE(n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
        << "an idle connection was closed before the scrape was answered";
    close(fd);
  }
}

// --metrics-auth: /metrics demands the bearer token; the server refuses to start with
// metrics auth and no token.
TEST(MetricsTest, BearerTokenOnMetrics) {
  service::MetricsHttpOptions http;
  http.listen = "127.0.0.1:0";
  http.bearer_token = "metrics-" + std::to_string(Seed());
  auto metrics =
      service::MetricsHttpServer::Start(http, [] { return std::string("decode_indexer_up 1\n"); });
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  const int port = (*metrics)->port();
  EXPECT_EQ(HttpRequest(port, "GET /metrics HTTP/1.0\r\n\r\n").first, "HTTP/1.1 401 Unauthorized");
  EXPECT_EQ(HttpRequest(port, "GET /metrics HTTP/1.0\r\nAuthorization: Bearer " +
                                  http.bearer_token + "x\r\n\r\n")
                .first,
            "HTTP/1.1 401 Unauthorized");
  auto [status, body] = HttpRequest(
      port, "GET /metrics HTTP/1.0\r\nAuthorization: Bearer " + http.bearer_token + "\r\n\r\n");
  EXPECT_EQ(status, "HTTP/1.1 200 OK");
  EXPECT_EQ(body, "decode_indexer_up 1\n");

  service::ServerOptions so = BaseOptions();
  so.listen = {"127.0.0.1:0"};
  so.metrics_listen = "127.0.0.1:0";
  so.metrics_auth = true;
  absl::StatusOr<std::unique_ptr<service::Server>> refused = service::Server::Start(so);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("metrics-auth"), std::string::npos);
  so.auth_token = http.bearer_token;
  auto s = StartOps(so);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(HttpRequest(s->server->metrics_port(), "GET /metrics HTTP/1.0\r\n\r\n").first,
            "HTTP/1.1 401 Unauthorized");
  EXPECT_EQ(
      HttpRequest(s->server->metrics_port(),
                  "GET /metrics HTTP/1.0\r\nAuthorization: Bearer " + so.auth_token + "\r\n\r\n")
          .first,
      "HTTP/1.1 200 OK");
}

grpc::health::v1::HealthCheckResponse::ServingStatus HealthOf(const std::string& address,
                                                              const std::string& service,
                                                              grpc::StatusCode* code) {
  std::shared_ptr<grpc::Channel> ch =
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(ch);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse res;
  *code = health->Check(&ctx, req, &res).error_code();
  return res.status();
}

// Health answers for "" and for the service's own name; a drain reports NOT_SERVING for both
// during --drain-grace while calls are still accepted, and only then stops accepting.
TEST(HealthTest, PerServiceNameAndDrainGrace) {
  service::ServerOptions so = BaseOptions();
  so.drain_grace = std::chrono::seconds(5);
  auto s = StartOps(so);
  ASSERT_NE(s, nullptr);
  const std::string address = s->server->address();
  grpc::StatusCode code;
  for (const std::string name : {"", service::Server::kHealthServiceName}) {
    EXPECT_EQ(HealthOf(address, name, &code), grpc::health::v1::HealthCheckResponse::SERVING)
        << "'" << name << "'";
    EXPECT_EQ(code, grpc::StatusCode::OK);
  }
  HealthOf(address, "no.such.Service", &code);
  EXPECT_EQ(code, grpc::StatusCode::NOT_FOUND);

  auto c = client::IndexerClient::Connect(address);
  ASSERT_TRUE(c.ok()) << c.status();
  std::thread drain([&] { s->server->Shutdown(std::chrono::seconds(1)); });
  // Health turns NOT_SERVING first (bounded poll: the drain thread may not have started yet).
  grpc::health::v1::HealthCheckResponse::ServingStatus st =
      grpc::health::v1::HealthCheckResponse::SERVING;
  for (int i = 0; i < 1000 && st == grpc::health::v1::HealthCheckResponse::SERVING; ++i) {
    st = HealthOf(address, service::Server::kHealthServiceName, &code);
    if (st == grpc::health::v1::HealthCheckResponse::SERVING) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  EXPECT_EQ(st, grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(HealthOf(address, "", &code), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  // ... while calls are still served, on the open connection and on a new one.
  EXPECT_TRUE((*c)->CreateSequence(7).ok());
  auto late = client::IndexerClient::Connect(address);
  ASSERT_TRUE(late.ok());
  absl::StatusOr<v1::ServerInfo> info = (*late)->ServerInfo();
  EXPECT_TRUE(info.ok()) << info.status();
  drain.join();
  EXPECT_FALSE((*c)->ServerInfo().ok());
}

// Every answer carries the request id: the client's x-request-id when sent, else a fresh one;
// in the initial and the trailing metadata, on success and on failure.
TEST(RequestIdTest, EchoedOrGenerated) {
  auto s = StartOps(BaseOptions());
  ASSERT_NE(s, nullptr);
  std::shared_ptr<grpc::Channel> ch =
      grpc::CreateChannel(s->server->address(), grpc::InsecureChannelCredentials());
  auto stub = v1::DecodeIndexer::NewStub(ch);
  auto first = [](const std::multimap<grpc::string_ref, grpc::string_ref>& md) {
    auto it = md.find(service::kRequestIdKey);
    return it == md.end() ? std::string() : std::string(it->second.data(), it->second.size());
  };
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata(service::kRequestIdKey, "req-" + std::to_string(Seed()));
    v1::ServerInfo info;
    ASSERT_TRUE(stub->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info).ok());
    EXPECT_EQ(first(ctx.GetServerInitialMetadata()), "req-" + std::to_string(Seed()));
    EXPECT_EQ(first(ctx.GetServerTrailingMetadata()), "req-" + std::to_string(Seed()));
  }
  std::string generated;
  {
    grpc::ClientContext ctx;
    v1::ReleaseSequenceRequest req;
    req.set_sequence_id(424242);
    v1::ReleaseSequenceResponse res;
    EXPECT_EQ(stub->ReleaseSequence(&ctx, req, &res).error_code(), grpc::StatusCode::NOT_FOUND);
    generated = first(ctx.GetServerTrailingMetadata());
    EXPECT_EQ(generated.size(), 16u) << generated;
  }
  {
    grpc::ClientContext ctx;
    v1::ServerInfo info;
    ASSERT_TRUE(stub->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info).ok());
    EXPECT_EQ(first(ctx.GetServerInitialMetadata()).size(), 16u);
    EXPECT_NE(first(ctx.GetServerInitialMetadata()), generated);  // one per call
  }
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata(service::kRequestIdKey, "stream-1");
    auto stream = stub->DecodeStream(&ctx);
    stream->WritesDone();
    v1::DecodeStepResponse res;
    EXPECT_FALSE(stream->Read(&res));
    EXPECT_TRUE(stream->Finish().ok());
    EXPECT_EQ(first(ctx.GetServerInitialMetadata()), "stream-1");
  }
}

// --log-format json: one object a line with time, level, message (escaped) and the request id
// of the call being handled.
TEST(LoggingTest, JsonLinesCarryTheRequestId) {
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  spdlog::logger logger("json-test", sink);
  logger.set_formatter(service::MakeJsonFormatter());
  logger.info("plain");
  {
    service::ScopedRequestId id("rid-7");
    logger.warn("a \"quoted\"\nline\t{}", 3);
  }
  std::istringstream in(out.str());
  std::string line;
  std::vector<nlohmann::json> lines;
  while (std::getline(in, line)) lines.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(lines.size(), 2u) << out.str();
  EXPECT_EQ(lines[0]["level"], "info");
  EXPECT_EQ(lines[0]["message"], "plain");
  EXPECT_FALSE(lines[0].contains("request_id"));
  EXPECT_EQ(lines[1]["level"], "warning");
  EXPECT_EQ(lines[1]["message"], "a \"quoted\"\nline\t3");
  EXPECT_EQ(lines[1]["request_id"], "rid-7");
  EXPECT_EQ(lines[1]["time"].get<std::string>().back(), 'Z');
}

// Memory the client may not write is PERMISSION_DENIED, not NOT_FOUND or INVALID_ARGUMENT:
// shared memory is a sealed memfd handed over the shm socket (issue 16), and a read-only
// descriptor of one is refused with that code.
TEST(SharedMemoryTest, PermissionDeniedIsNotNotFound) {
  const int fd = memfd_create("di-perm", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  ASSERT_EQ(posix_fallocate(fd, 0, 4096), 0);
  ASSERT_EQ(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), 0);
  const std::string self = "/proc/self/fd/" + std::to_string(fd);
  const int ro = open(self.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(ro, 0) << std::strerror(errno);
  service::RegionRegistry registry;
  absl::StatusOr<uint64_t> id = registry.RegisterSharedMemoryFd(ro, 4096, geteuid());
  EXPECT_EQ(id.status().code(), absl::StatusCode::kPermissionDenied) << id.status();
  EXPECT_NE(id.status().message().find("read-write"), absl::string_view::npos) << id.status();
  EXPECT_TRUE(registry.RegisterSharedMemoryFd(fd, 4096, geteuid()).ok());
  close(ro);
  close(fd);
}

// A region whose pages the client only sized (ftruncate) is refused: mapped populated and
// page-locked, its pages would be allocated by the server, charged to it, up to 2^40 bytes a
// region for one ftruncate. Half allocated is refused too; fully allocated is mapped.
TEST(SharedMemoryTest, PagesTheClientDidNotAllocateAreRefused) {
  constexpr off_t kSize = off_t{1} << 20;
  const int fd = memfd_create("di-sparse", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  ASSERT_EQ(ftruncate(fd, kSize), 0);
  ASSERT_EQ(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), 0);
  service::RegionRegistry registry;
  for (const off_t allocated : {off_t{0}, kSize / 2}) {
    if (allocated > 0) {
      ASSERT_EQ(posix_fallocate(fd, 0, allocated), 0);
    }
    absl::StatusOr<uint64_t> id = registry.RegisterSharedMemoryFd(fd, kSize, geteuid());
    EXPECT_EQ(id.status().code(), absl::StatusCode::kFailedPrecondition) << id.status();
    EXPECT_NE(id.status().message().find("posix_fallocate"), absl::string_view::npos)
        << id.status();
    EXPECT_EQ(registry.shared_memory_count(), 0u);
  }
  ASSERT_EQ(posix_fallocate(fd, 0, kSize), 0);
  absl::StatusOr<uint64_t> id = registry.RegisterSharedMemoryFd(fd, kSize, geteuid());
  EXPECT_TRUE(id.ok()) << id.status();
  close(fd);
}

// Shared-memory and CUDA IPC regions share one registry and one id space: an id finds only a
// region of its own kind (the other kind's lookups and unregistrations answer NOT_FOUND naming
// the field and change nothing), each kind has its own quota, and a CUDA IPC buffer closes once
// when its last holder lets go.
TEST(SharedMemoryTest, OneRegistryForBothKinds) {
  const int fd = memfd_create("di-kinds", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  ASSERT_EQ(posix_fallocate(fd, 0, 4096), 0);
  ASSERT_EQ(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), 0);
  service::RegionRegistry registry;
  absl::StatusOr<uint64_t> shm = registry.RegisterSharedMemoryFd(fd, 4096, geteuid());
  ASSERT_TRUE(shm.ok()) << shm.status();
  int closes = 0;
  static uint8_t fake_device[256];
  auto ipc_region = [&] {
    return std::make_shared<service::CudaIpcRegion>(fake_device, sizeof(fake_device),
                                                    [&](void*) { ++closes; });
  };
  absl::StatusOr<uint64_t> ipc = registry.AddCudaIpc(ipc_region());
  ASSERT_TRUE(ipc.ok()) << ipc.status();
  EXPECT_NE(*shm, *ipc);
  EXPECT_EQ(registry.shared_memory_count(), 1u);
  EXPECT_EQ(registry.cuda_ipc_count(), 1u);

  // Each id only as its own kind.
  absl::StatusOr<std::shared_ptr<service::CudaIpcRegion>> wrong_ipc = registry.CudaIpc(*shm);
  EXPECT_EQ(wrong_ipc.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(wrong_ipc.status().message().find("cuda_ipc.region_id"), absl::string_view::npos);
  absl::StatusOr<std::shared_ptr<service::SharedMemoryRegion>> wrong_shm =
      registry.SharedMemory(*ipc);
  EXPECT_EQ(wrong_shm.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(wrong_shm.status().message().find("shared_memory.region_id"), absl::string_view::npos);
  EXPECT_EQ(registry.UnregisterCudaIpc(*shm).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.UnregisterSharedMemory(*ipc).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(registry.SharedMemory(*shm).ok());  // nothing changed
  EXPECT_TRUE(registry.CudaIpc(*ipc).ok());
  EXPECT_EQ(closes, 0);

  // Separate quotas: the CUDA IPC kind full, shared memory still registers.
  std::vector<uint64_t> more;
  while (registry.HasRoomForCudaIpc()) {
    absl::StatusOr<uint64_t> id = registry.AddCudaIpc(ipc_region());
    ASSERT_TRUE(id.ok()) << id.status();
    more.push_back(*id);
  }
  EXPECT_EQ(registry.cuda_ipc_count(), service::RegionRegistry::kMaxCudaIpcRegions);
  EXPECT_EQ(registry.AddCudaIpc(ipc_region()).status().code(),
            absl::StatusCode::kResourceExhausted);
  absl::StatusOr<uint64_t> shm2 = registry.RegisterSharedMemoryFd(fd, 4096, geteuid());
  EXPECT_TRUE(shm2.ok()) << shm2.status();
  EXPECT_EQ(closes, 1);  // the refused region closed as it went
  for (uint64_t id : more) EXPECT_TRUE(registry.UnregisterCudaIpc(id).ok());
  EXPECT_EQ(closes, 1 + static_cast<int>(more.size()));

  // A holder keeps the buffer open past its unregistration; it closes once, when let go.
  absl::StatusOr<std::shared_ptr<service::CudaIpcRegion>> held = registry.CudaIpc(*ipc);
  ASSERT_TRUE(held.ok());
  const int before = closes;
  EXPECT_TRUE(registry.UnregisterCudaIpc(*ipc).ok());
  EXPECT_EQ(registry.UnregisterCudaIpc(*ipc).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(closes, before);
  held->reset();
  EXPECT_EQ(closes, before + 1);
  EXPECT_TRUE(registry.UnregisterSharedMemory(*shm).ok());
  EXPECT_EQ(registry.shared_memory_count(), 1u);
  close(fd);
}

}  // namespace
}  // namespace decode_indexer::testing
