// Restart without loss (spec section 11) with the real decode-indexer-server binary: SIGTERM
// writes the snapshot after the drain, a restart on the same directory restores it (two ranks
// each time, so every replica is rebuilt) and answers bit for bit as an in-process server with
// the same history that never stopped, keeping the instance id; torn, corrupt, foreign and
// mismatched files are refused with exit code 3 and a message saying which and why, and are
// left as they were.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "tests/service/service_harness.h"

extern char** environ;

namespace decode_indexer::testing {
namespace {

namespace fs = std::filesystem;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteAll(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

// A decode-indexer-server process; killed (SIGKILL) if the test leaves it running.
class ServerProcess {
 public:
  ServerProcess(const std::string& profile, const std::string& dir, const std::string& log)
      : log_(log) {
    std::vector<std::string> args = {DI_SERVER_BINARY,
                                     "--listen",
                                     "127.0.0.1:0",
                                     "--profile",
                                     profile,
                                     "--backend",
                                     "cpu",
                                     "--ranks",
                                     "2",
                                     "--cpu-threads",
                                     "1",
                                     "--cache-pages",
                                     "256",
                                     "--snapshot-dir",
                                     dir,
                                     "--drain-timeout",
                                     "1",
                                     "--log-level",
                                     "info"};
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0600);
    posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
    EXPECT_EQ(posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(), environ), 0);
    posix_spawn_file_actions_destroy(&actions);
  }
  ~ServerProcess() {
    if (pid_ > 0 && !reaped_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  // The port it logs once serving; 0 if it exited first.
  int Port() {
    for (int i = 0; i < 1200; ++i) {
      const std::string log = ReadAll(log_);
      const size_t at = log.find("(port ");
      if (at != std::string::npos) return std::atoi(log.c_str() + at + 6);
      if (Exited(/*wait=*/false)) return 0;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return 0;
  }
  bool Exited(bool wait) {
    if (reaped_) return true;
    const pid_t done = waitpid(pid_, &status_, wait ? 0 : WNOHANG);
    reaped_ = done == pid_;
    return reaped_;
  }
  // SIGTERM, then the exit code (-1: killed by a signal).
  int Stop() {
    kill(pid_, SIGTERM);
    return ExitCode();
  }
  int ExitCode() {
    Exited(/*wait=*/true);
    return WIFEXITED(status_) ? WEXITSTATUS(status_) : -1;
  }
  std::string log() const { return ReadAll(log_); }

 private:
  std::string log_;
  pid_t pid_ = -1;
  int status_ = 0;
  bool reaped_ = false;
};

class SnapshotTest : public ::testing::Test {
 protected:
  void SetUp() override {
    profile_ = LoadOrDie(TinyProfilePath());
    root_ = fs::temp_directory_path() / ("di-snapshot-" + std::to_string(getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_);
    dir_ = (root_ / "snap").string();
  }
  void TearDown() override { fs::remove_all(root_); }
  std::string Log(const std::string& name) { return (root_ / (name + ".log")).string(); }

  std::vector<float> Keys(int n, uint64_t seed) {
    return Gen(seed).Normal(size_t(n) * profile_.head_dim);
  }
  // A history: prefill, a round of every layer, a fork, a speculative step rolled back.
  void History(client::IndexerClient& c) {
    const int D = profile_.head_dim;
    for (uint64_t id : {1, 2}) {
      ASSERT_TRUE(c.CreateSequence(id).ok());
      for (int layer : profile_.CacheLayers()) {
        ASSERT_TRUE(c.AppendKeys(id, layer, Keys(150 + int(id), id * 10 + layer), D).ok());
      }
    }
    ASSERT_TRUE(Round(c, 1, 1).size() == profile_.layers.size());
    ASSERT_TRUE(c.ForkSequence(1, 3, 120).ok());
    ASSERT_TRUE(c.AppendKeysAt(2, 0, 140, Keys(3, 5), D).ok());
  }
  std::vector<client::StepAnswer> Round(client::IndexerClient& c, uint64_t id, uint64_t seed) {
    std::vector<client::StepAnswer> out;
    for (const config::LayerSpec& l : profile_.layers) {
      v1::DecodeStepRequest req;
      req.set_layer(l.layer);
      req.set_return_candidates(l.role == config::LayerRole::kCandidateSource);
      v1::SequenceStep* s = req.add_sequences();
      s->set_sequence_id(id);
      s->set_num_rows(1);
      if (l.role != config::LayerRole::kCandidateConsumer) {
        *s->mutable_new_keys() =
            client::F32Tensor(Keys(1, seed * 100 + l.layer), {1, profile_.head_dim});
      }
      Gen(seed * 1000 + l.layer).FillQ(req, QForm::kF32NoRope, 1, profile_, l.cache_format, {});
      absl::StatusOr<client::StepAnswer> a = c.DecodeStep(req);
      EXPECT_TRUE(a.ok()) << a.status();
      if (a.ok()) out.push_back(*a);
    }
    return out;
  }
  // A consumer step before any source step: it needs the restored candidates.
  absl::StatusOr<client::StepAnswer> ConsumerFirst(client::IndexerClient& c, uint64_t id) {
    v1::DecodeStepRequest req;
    req.set_layer(3);
    v1::SequenceStep* s = req.add_sequences();
    s->set_sequence_id(id);
    s->set_num_rows(1);
    Gen(4242).FillQ(req, QForm::kF32NoRope, 1, profile_, profile_.layers[3].cache_format, {});
    return c.DecodeStep(req);
  }
  std::unique_ptr<client::IndexerClient> Connect(int port) {
    absl::StatusOr<std::unique_ptr<client::IndexerClient>> c =
        client::IndexerClient::Connect("127.0.0.1:" + std::to_string(port));
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }
  // Starts on `dir_` holding `bytes` as snapshot.bin: expects exit 3 with `why` in the log
  // and the file left as it was.
  void ExpectRefused(const std::string& bytes, const std::string& profile, const std::string& why,
                     const std::string& name) {
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    const std::string path = dir_ + "/snapshot.bin";
    WriteAll(path, bytes);
    ServerProcess p(profile, dir_, Log(name));
    EXPECT_EQ(p.Port(), 0) << name << ": started anyway\n" << p.log();
    EXPECT_EQ(p.ExitCode(), 3) << name << "\n" << p.log();
    EXPECT_NE(p.log().find(why), std::string::npos) << name << "\n" << p.log();
    EXPECT_NE(p.log().find(path), std::string::npos) << name << ": names the file\n" << p.log();
    EXPECT_EQ(ReadAll(path), bytes) << name << ": the refused file was changed";
  }

  config::Profile profile_;
  fs::path root_;
  std::string dir_;
};

TEST_F(SnapshotTest, SigtermThenRestartAnswersBitForBitAndBadFilesAreRefused) {
  std::unique_ptr<Session> control = StartSession(profile_, CpuOptions(1, 256));
  ASSERT_NE(control, nullptr);
  History(*control->client);

  std::string instance;
  {
    ServerProcess p(TinyProfilePath(), dir_, Log("first"));
    const int port = p.Port();
    ASSERT_GT(port, 0) << p.log();
    std::unique_ptr<client::IndexerClient> c = Connect(port);
    ASSERT_NE(c, nullptr);
    History(*c);
    absl::StatusOr<v1::ServerInfo> info = c->ServerInfo();
    ASSERT_TRUE(info.ok());
    instance = info->instance_id();
    ASSERT_EQ(p.Stop(), 0) << p.log();
    EXPECT_NE(p.log().find("snapshot: wrote 3 sequences"), std::string::npos) << p.log();
  }
  const std::string path = dir_ + "/snapshot.bin";
  ASSERT_TRUE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  const std::string good = ReadAll(path);

  {
    ServerProcess p(TinyProfilePath(), dir_, Log("second"));
    const int port = p.Port();
    ASSERT_GT(port, 0) << p.log();
    std::unique_ptr<client::IndexerClient> c = Connect(port);
    ASSERT_NE(c, nullptr);
    absl::StatusOr<v1::ServerInfo> info = c->ServerInfo();
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->instance_id(), instance) << "a restore keeps the instance id";
    EXPECT_EQ(info->sequences(), 3);
    EXPECT_FALSE(fs::exists(path)) << "a restored snapshot is consumed";
    for (uint64_t id : {1, 2, 3}) {
      absl::StatusOr<v1::GetSequenceResponse> got = c->GetSequence(id);
      absl::StatusOr<v1::GetSequenceResponse> want = control->client->GetSequence(id);
      ASSERT_TRUE(got.ok() && want.ok()) << got.status();
      ASSERT_EQ(got->caches_size(), want->caches_size());
      for (int i = 0; i < got->caches_size(); ++i) {
        EXPECT_EQ(got->caches(i).length(), want->caches(i).length()) << id;
      }
      EXPECT_EQ(got->candidate_layers_size(), want->candidate_layers_size()) << id;
    }
    absl::StatusOr<client::StepAnswer> a = ConsumerFirst(*c, 1);
    absl::StatusOr<client::StepAnswer> b = ConsumerFirst(*control->client, 1);
    ASSERT_TRUE(a.ok() && b.ok()) << a.status() << " " << b.status();
    EXPECT_EQ(a->topk, b->topk);
    for (uint64_t id : {1, 2, 3}) {
      std::vector<client::StepAnswer> x = Round(*c, id, 20 + id);
      std::vector<client::StepAnswer> y = Round(*control->client, id, 20 + id);
      ASSERT_EQ(x.size(), y.size());
      for (size_t l = 0; l < x.size(); ++l) {
        EXPECT_EQ(x[l].topk, y[l].topk) << "sequence " << id << " layer " << l;
        EXPECT_EQ(x[l].candidates, y[l].candidates) << "sequence " << id << " layer " << l;
        EXPECT_EQ(x[l].lengths, y[l].lengths) << "sequence " << id << " layer " << l;
      }
    }
    ASSERT_EQ(p.Stop(), 0) << p.log();
  }

  // An unfinished snapshot.bin.tmp alone: removed, the server starts empty with a new id.
  {
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    WriteAll(path + ".tmp", good.substr(0, good.size() / 2));
    ServerProcess p(TinyProfilePath(), dir_, Log("tmp"));
    const int port = p.Port();
    ASSERT_GT(port, 0) << p.log();
    std::unique_ptr<client::IndexerClient> c = Connect(port);
    ASSERT_NE(c, nullptr);
    absl::StatusOr<v1::ServerInfo> info = c->ServerInfo();
    ASSERT_TRUE(info.ok());
    EXPECT_NE(info->instance_id(), instance);
    EXPECT_EQ(info->sequences(), 0);
    EXPECT_FALSE(fs::exists(path + ".tmp"));
    EXPECT_EQ(p.Stop(), 0);
  }

  ExpectRefused(good.substr(0, good.size() / 2), TinyProfilePath(), "torn or truncated",
                "half the file");
  ExpectRefused(good.substr(0, good.size() - 3), TinyProfilePath(), "torn or truncated",
                "the end record cut");
  {
    std::string corrupt = good;
    corrupt[corrupt.size() / 2] ^= 0x20;
    ExpectRefused(corrupt, TinyProfilePath(), "corrupt", "a flipped byte");
  }
  ExpectRefused("not a snapshot at all", TinyProfilePath(), "not a snapshot", "a foreign file");
  ExpectRefused(good, "v32", "mismatched profile", "another profile");
}

}  // namespace
}  // namespace decode_indexer::testing
