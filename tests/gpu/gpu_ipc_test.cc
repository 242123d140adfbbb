// The CUDA data plane against the real server binary on the CUDA backend: this process (the
// "attention worker") cudaMallocs a buffer, exports it with cudaIpcGetMemHandle and registers
// it; the server opens the handle in another process and copies each step's answer there
// device to device. The answer read back from the buffer must equal the same step's answer
// through plain gRPC (the CUDA backend is deterministic, so bit for bit), also through a
// stream and with q read from a page-locked shared-memory region. Then the registration's
// device-side rejections (foreign handle, size past the allocation, wrong device) and the
// per-rank device-memory gauge; the CUDA IPC events' ordering; and a step's new keys read from
// the buffer (cuda_ipc.new_keys_offset, the ring's kKeysCudaIpc; FP8 at v32, FP4 at v41).
// Skips visibly where no GPU is visible.
#include <cuda_runtime.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "client/fast_path.h"
#include "client/indexer_client.h"
#include "client/tensor.h"
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
  return at == std::string::npos ? 0 : std::atoi(log.c_str() + at + 6);
}

// The server under test: DI_SERVER_BINARY from the environment (a bundled copy on the GPU
// machine) or the one this build made.
std::string ServerBinary() {
  const char* env = std::getenv("DI_SERVER_BINARY");
  return env != nullptr && *env != 0 ? env : DI_SERVER_BINARY;
}

class ServerProcess {
 public:
  ~ServerProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      for (int i = 0; i < 100 && waitpid(pid_, nullptr, WNOHANG) == 0; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (!log_.empty()) std::filesystem::remove(log_);
  }
  // Starts the server and answers its address, "" on failure (the log says why).
  std::string Start(const std::string& profile = "v32") {
    log_ = (std::filesystem::temp_directory_path() /
            ("di-gpu-ipc-" + std::to_string(getpid()) + ".log"))
               .string();
    std::vector<std::string> args = {
        ServerBinary(), "--listen", "127.0.0.1:0",   "--backend", "cuda",        "--ranks", "1",
        "--profile",    profile,    "--cache-pages", "2048",      "--log-level", "info"};
    // Shared-memory regions are sealed memfds handed over this socket.
    args.push_back("--shm-socket");
    args.push_back((std::filesystem::temp_directory_path() /
                    ("di-gpu-ipc-" + std::to_string(getpid()) + ".sock"))
                       .string());
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log_.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0600);
    posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
    const int rc = posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) return "";
    for (int i = 0; i < 1200; ++i) {
      if (const int port = LoggedPort(ReadAll(log_)); port > 0) {
        return "127.0.0.1:" + std::to_string(port);
      }
      if (waitpid(pid_, nullptr, WNOHANG) == pid_) {
        pid_ = -1;
        return "";
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return "";
  }
  std::string log() const { return ReadAll(log_); }

 private:
  pid_t pid_ = -1;
  std::string log_;
};

#define ASSERT_CUDA(expr)                                                  \
  do {                                                                     \
    const cudaError_t e_ = (expr);                                         \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_); \
  } while (0)

TEST(GpuIpcTest, AnswerInTheExportedBufferEqualsThePlainGrpcAnswer) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    GTEST_SKIP() << "no GPU visible: the CUDA IPC data plane needs one";
  }
  ServerProcess server;
  const std::string address = server.Start();
  ASSERT_FALSE(address.empty()) << server.log();
  absl::StatusOr<std::unique_ptr<client::IndexerClient>> c =
      client::IndexerClient::Connect(address);
  ASSERT_TRUE(c.ok()) << c.status();
  client::IndexerClient& cl = **c;
  absl::StatusOr<v1::ServerInfo> info = cl.ServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_EQ(info->backend(), "cuda");
  const int H = info->num_heads(), D = info->head_dim(), K = info->topk();

  // Sequences of fresh random keys (fp32, quantized by the server) on dense layer 0.
  std::mt19937_64 rng(::decode_indexer::testing::TestSeed());
  std::normal_distribution<float> normal;
  const int requests = 8;
  std::vector<int64_t> lengths;
  for (int i = 0; i < requests; ++i) {
    lengths.push_back(1000 + int64_t(rng() % 4000));
    ASSERT_TRUE(cl.CreateSequence(100 + i).ok());
    std::vector<float> keys(size_t(lengths.back()) * D);
    for (float& x : keys) x = normal(rng);
    absl::StatusOr<int64_t> len = cl.AppendKeys(100 + i, 0, keys, D);
    ASSERT_TRUE(len.ok()) << len.status();
  }
  // A step without new keys changes nothing, so the same request can be asked twice.
  auto make_step = [&](uint64_t step_id) {
    v1::DecodeStepRequest req;
    req.set_layer(0);
    req.set_step_id(step_id);
    std::vector<int64_t> positions;
    for (int i = 0; i < requests; ++i) {
      v1::SequenceStep* s = req.add_sequences();
      s->set_sequence_id(100 + i);
      s->set_num_rows(1);
      positions.push_back(lengths[i] - 1);
    }
    std::vector<float> q(size_t(requests) * H * D), w(size_t(requests) * H);
    for (float& x : q) x = normal(rng);
    for (float& x : w) x = normal(rng);
    *req.mutable_q() = client::F32Tensor(q, {requests, H, D});
    *req.mutable_weights() = client::F32Tensor(w, {requests, H});
    *req.mutable_positions() = client::I64Tensor(positions, {requests});
    return req;
  };

  // The worker's buffer, stale bytes everywhere so a missing write shows.
  ASSERT_CUDA(cudaSetDevice(0));
  const size_t bytes = size_t(4) << 20;
  void* buffer = nullptr;
  ASSERT_CUDA(cudaMalloc(&buffer, bytes));
  ASSERT_CUDA(cudaMemset(buffer, 0x5A, bytes));
  ASSERT_CUDA(cudaDeviceSynchronize());
  cudaIpcMemHandle_t handle;
  ASSERT_CUDA(cudaIpcGetMemHandle(&handle, buffer));
  const std::string handle_bytes(reinterpret_cast<const char*>(&handle), sizeof(handle));
  absl::StatusOr<uint64_t> region = cl.RegisterCudaIpcMemory(handle_bytes, bytes, 0);
  ASSERT_TRUE(region.ok()) << region.status() << "\n" << server.log();

  auto read_back = [&](uint64_t offset, size_t count) {
    std::vector<int32_t> out(count);
    EXPECT_EQ(cudaMemcpy(out.data(), static_cast<char*>(buffer) + offset, count * 4,
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    return out;
  };
  absl::StatusOr<std::unique_ptr<client::StepStream>> stream = cl.OpenStream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  for (int i = 0; i < 4; ++i) {
    const v1::DecodeStepRequest plain = make_step(10 + i);
    absl::StatusOr<client::StepAnswer> want = cl.DecodeStep(plain);
    ASSERT_TRUE(want.ok()) << want.status();
    ASSERT_EQ(want->rows, requests);
    ASSERT_EQ(want->k, K);
    v1::DecodeStepRequest ipc = plain;
    const uint64_t offset = 4 * (rng() % 4096);
    ipc.mutable_cuda_ipc()->set_region_id(*region);
    ipc.mutable_cuda_ipc()->set_answer_offset(offset);
    // Unary, then the same step through the stream (odd steps), at the same offset.
    absl::StatusOr<client::StepAnswer> got = i % 2 == 0 ? cl.DecodeStep(ipc) : (*stream)->Step(ipc);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(got->topk.empty());
    EXPECT_EQ(read_back(offset, want->topk.size()), want->topk) << "step " << i;
  }
  ASSERT_TRUE((*stream)->Finish().ok());

  // q and weights from a page-locked shared-memory region, the answer to the device buffer.
  {
    const std::string name = "/di-gpu-ipc-" + std::to_string(getpid());
    const uint64_t shm_bytes = 8 << 20;
    absl::StatusOr<std::unique_ptr<client::SharedMemory>> shm =
        client::SharedMemory::Create(name, shm_bytes);
    ASSERT_TRUE(shm.ok()) << shm.status();
    absl::StatusOr<uint64_t> shm_region = cl.RegisterSharedMemory(**shm);
    ASSERT_TRUE(shm_region.ok()) << shm_region.status();
    const v1::DecodeStepRequest plain = make_step(20);
    absl::StatusOr<client::StepAnswer> want = cl.DecodeStep(plain);
    ASSERT_TRUE(want.ok()) << want.status();
    for (bool to_device : {true, false}) {
      v1::DecodeStepRequest req = plain;
      uint64_t at = 0;
      auto place = [&](v1::Tensor* t) {
        const uint64_t off = at;
        std::memcpy((*shm)->data() + off, t->data().data(), t->data().size());
        at += (t->data().size() + 4095) / 4096 * 4096;
        t->clear_data();
        return off;
      };
      v1::SharedMemoryStep* sm = req.mutable_shared_memory();
      sm->set_region_id(*shm_region);
      sm->set_q_offset(place(req.mutable_q()));
      sm->set_weights_offset(place(req.mutable_weights()));
      sm->set_answer_offset(at);
      std::memset((*shm)->data() + at, 0x5A, size_t(requests) * K * 4);
      if (to_device) {
        req.mutable_cuda_ipc()->set_region_id(*region);
        req.mutable_cuda_ipc()->set_answer_offset(4096);
      }
      absl::StatusOr<client::StepAnswer> got = cl.DecodeStep(req);
      ASSERT_TRUE(got.ok()) << got.status();
      std::vector<int32_t> answer(want->topk.size());
      if (to_device) {
        answer = read_back(4096, want->topk.size());
      } else {
        std::memcpy(answer.data(), (*shm)->data() + at, answer.size() * 4);
      }
      EXPECT_EQ(answer, want->topk) << (to_device ? "shm q, device answer" : "shm q and answer");
    }
    ASSERT_TRUE(cl.UnregisterSharedMemory(*shm_region).ok());
  }

  // q and weights read from the device buffer (cuda_ipc.q_offset), fp32 q (rotated by the
  // server) and FP8 codes, over gRPC and through the step ring: bit for bit the plain answer.
  auto to_device = [&](v1::DecodeStepRequest& req, uint64_t q_at, uint64_t answer_at) {
    uint64_t at = q_at;
    auto put = [&](v1::Tensor* t) {
      const uint64_t off = at;
      EXPECT_EQ(cudaMemcpy(static_cast<char*>(buffer) + off, t->data().data(), t->data().size(),
                           cudaMemcpyHostToDevice),
                cudaSuccess);
      at = (at + t->data().size() + 255) / 256 * 256;
      t->clear_data();
      return off;
    };
    v1::CudaIpcStep* ci = req.mutable_cuda_ipc();
    ci->set_region_id(*region);
    ci->set_q_offset(put(req.mutable_q()));
    ci->set_weights_offset(put(req.mutable_weights()));
    ci->set_answer_offset(answer_at);
  };
  auto fp8_step = [&](uint64_t step_id) {
    v1::DecodeStepRequest req = make_step(step_id);
    std::string codes(size_t(requests) * H * D, '\0');
    for (char& ch : codes) {
      uint8_t b = uint8_t(rng());
      if ((b & 0x7F) == 0x7F) b ^= 0x40;  // no NaN codes
      ch = static_cast<char>(b);
    }
    req.mutable_q()->set_dtype(v1::DTYPE_FP8_E4M3);
    req.mutable_q()->set_data(codes);
    req.clear_positions();  // FP8 q is already rotated
    return req;
  };
  for (int i = 0; i < 4; ++i) {
    const v1::DecodeStepRequest plain = i % 2 == 0 ? make_step(30 + i) : fp8_step(30 + i);
    absl::StatusOr<client::StepAnswer> want = cl.DecodeStep(plain);
    ASSERT_TRUE(want.ok()) << want.status();
    v1::DecodeStepRequest req = plain;
    const uint64_t answer_at = 4 * (rng() % 4096);
    to_device(req, 1 << 20, answer_at);
    absl::StatusOr<client::StepAnswer> got = cl.DecodeStep(req);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(read_back(answer_at, want->topk.size()), want->topk) << "device q, step " << i;
  }
  {
    absl::StatusOr<std::unique_ptr<client::FastPathRing>> ring = client::FastPathRing::Create(cl);
    ASSERT_TRUE(ring.ok()) << ring.status();
    for (int i = 0; i < 3; ++i) {
      const v1::DecodeStepRequest plain = fp8_step(40 + i);
      absl::StatusOr<client::StepAnswer> want = cl.DecodeStep(plain);
      ASSERT_TRUE(want.ok()) << want.status();
      v1::DecodeStepRequest req = plain;
      to_device(req, 1 << 20, 8192);
      client::RingStep step;
      step.descriptor.layer = 0;
      step.descriptor.step_id = 40 + i;
      step.descriptor.flags = ring::kAnswerCudaIpc | ring::kInputsCudaIpc;
      step.descriptor.cuda_ipc_region_id = *region;
      step.descriptor.rows_per_sequence = 1;
      step.descriptor.q_dtype = v1::DTYPE_FP8_E4M3;
      step.descriptor.weights_dtype = v1::DTYPE_FP32;
      step.descriptor.q_offset = req.cuda_ipc().q_offset();
      step.descriptor.weights_offset = req.cuda_ipc().weights_offset();
      step.descriptor.answer_offset = 8192;
      std::vector<uint64_t> ids;
      for (int r = 0; r < requests; ++r) ids.push_back(100 + r);
      step.sequence_ids = ids;
      ASSERT_CUDA(cudaMemset(static_cast<char*>(buffer) + 8192, 0x5A, size_t(requests) * K * 4));
      absl::StatusOr<client::RingCompletion> done = (*ring)->Step(step);
      ASSERT_TRUE(done.ok()) << done.status();
      ASSERT_TRUE(done->status.ok()) << done->status;
      EXPECT_EQ(read_back(8192, want->topk.size()), want->topk) << "ring, device q, step " << i;
    }
    ASSERT_TRUE((*ring)->Unregister().ok());
  }
  // A NaN code in the device q of a step that appends a key: INVALID_ARGUMENT naming q, found
  // on the device, and the key is not committed.
  {
    v1::DecodeStepRequest bad = fp8_step(50);
    std::vector<float> key(D);
    for (float& x : key) x = normal(rng);
    *bad.mutable_sequences(0)->mutable_new_keys() = client::F32Tensor(key, {1, D});
    to_device(bad, 1 << 20, 0);
    const uint8_t nan = 0xFF;
    ASSERT_CUDA(
        cudaMemcpy(static_cast<char*>(buffer) + (1 << 20) + 4097, &nan, 1, cudaMemcpyHostToDevice));
    absl::StatusOr<client::StepAnswer> r = cl.DecodeStep(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_NE(r.status().message().find("q.data"), std::string::npos) << r.status();
    absl::StatusOr<v1::GetSequenceResponse> seq = cl.GetSequence(100);
    ASSERT_TRUE(seq.ok()) << seq.status();
    ASSERT_GT(seq->caches_size(), 0);
    EXPECT_EQ(seq->caches(0).length(), lengths[0]) << "a failed step committed its key";
    const v1::DecodeStepRequest plain = make_step(51);
    absl::StatusOr<client::StepAnswer> after = cl.DecodeStep(plain);
    ASSERT_TRUE(after.ok()) << after.status();
  }

  // Device-side rejections: a handle of no allocation, a size past the allocation, another
  // device. None leaves a region behind.
  std::string foreign = handle_bytes;
  for (size_t i = 0; i < foreign.size(); ++i) foreign[i] = static_cast<char>(rng());
  absl::StatusOr<uint64_t> bad = cl.RegisterCudaIpcMemory(foreign, bytes, 0);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  bad = cl.RegisterCudaIpcMemory(handle_bytes, bytes + 4096, 0);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_NE(bad.status().message().find("size"), std::string::npos) << bad.status();
  bad = cl.RegisterCudaIpcMemory(handle_bytes, bytes, devices);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_NE(bad.status().message().find("device"), std::string::npos) << bad.status();

  // The gauge: rank 0's GPU holds the caches and workspaces.
  absl::StatusOr<v1::Statistics> stats = cl.GetStatistics();
  ASSERT_TRUE(stats.ok()) << stats.status();
  ASSERT_EQ(stats->device_memory_bytes_size(), 1);
  EXPECT_GT(stats->device_memory_bytes(0), int64_t{1} << 20);

  ASSERT_TRUE(cl.UnregisterCudaIpcMemory(*region).ok());
  EXPECT_EQ(cl.UnregisterCudaIpcMemory(*region).code(), absl::StatusCode::kNotFound);
  ASSERT_CUDA(cudaFree(buffer));
}

// GPU-side ordering with CUDA IPC events (cuda_ipc.wait_inputs_event / record_answer_event,
// the ring's kWaitInputsEvent / kRecordAnswerEvent). The worker's stream is held 300 ms by a
// host function and only then copies the step's q and weights into the buffer (stale q lies
// there meanwhile) and records the inputs event; the step is sent at once, with no host wait.
// The answer equals the plain gRPC answer only if the server's stream waited for that record.
// The worker's stream then waits on the answer event and reads the answer back on the
// stream, as the attention would. (That the server records the answer event after the
// answer's copies, and only when asked, is checked on the CPU fake, data_plane_test: here
// the server synchronises its stream before it answers, so the record is complete either
// way, and a worker-side pending record of the same event would hold the server's.)
void HoldStream(void* ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(*static_cast<int*>(ms)));
}

TEST(GpuIpcTest, EventsOrderTheStepOnTheGpu) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    GTEST_SKIP() << "no GPU visible: CUDA IPC events need one";
  }
  ServerProcess server;
  const std::string address = server.Start();
  ASSERT_FALSE(address.empty()) << server.log();
  absl::StatusOr<std::unique_ptr<client::IndexerClient>> c =
      client::IndexerClient::Connect(address);
  ASSERT_TRUE(c.ok()) << c.status();
  client::IndexerClient& cl = **c;
  absl::StatusOr<v1::ServerInfo> info = cl.ServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  const int H = info->num_heads(), D = info->head_dim();
  std::mt19937_64 rng(::decode_indexer::testing::TestSeed() + 1);
  std::normal_distribution<float> normal;
  const int requests = 4;
  std::vector<uint64_t> ids;
  for (int i = 0; i < requests; ++i) {
    ids.push_back(300 + i);
    ASSERT_TRUE(cl.CreateSequence(ids.back()).ok());
    std::vector<float> keys(size_t(3000 + rng() % 3000) * D);
    for (float& x : keys) x = normal(rng);
    ASSERT_TRUE(cl.AppendKeys(ids.back(), 0, keys, D).ok());
  }
  auto codes = [&] {
    std::string out(size_t(requests) * H * D, '\0');
    for (char& ch : out) {
      uint8_t b = uint8_t(rng());
      if ((b & 0x7F) == 0x7F) b ^= 0x40;  // no NaN codes
      ch = static_cast<char>(b);
    }
    return out;
  };

  ASSERT_CUDA(cudaSetDevice(0));
  const size_t bytes = size_t(4) << 20;
  void* buffer = nullptr;
  ASSERT_CUDA(cudaMalloc(&buffer, bytes));
  cudaIpcMemHandle_t handle;
  ASSERT_CUDA(cudaIpcGetMemHandle(&handle, buffer));
  cudaEvent_t inputs = nullptr, answer = nullptr;
  ASSERT_CUDA(cudaEventCreateWithFlags(&inputs, cudaEventInterprocess | cudaEventDisableTiming));
  ASSERT_CUDA(cudaEventCreateWithFlags(&answer, cudaEventInterprocess | cudaEventDisableTiming));
  cudaIpcEventHandle_t inputs_handle, answer_handle;
  ASSERT_CUDA(cudaIpcGetEventHandle(&inputs_handle, inputs));
  ASSERT_CUDA(cudaIpcGetEventHandle(&answer_handle, answer));
  auto as_bytes = [](const auto& h) {
    return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
  };
  absl::StatusOr<uint64_t> region = cl.RegisterCudaIpcMemory(
      as_bytes(handle), bytes, 0, as_bytes(inputs_handle), as_bytes(answer_handle));
  ASSERT_TRUE(region.ok()) << region.status() << "\n" << server.log();

  cudaStream_t worker = nullptr;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&worker, cudaStreamNonBlocking));
  void* pinned = nullptr;  // page-locked, so the copies wait in the stream, not in the call
  ASSERT_CUDA(cudaMallocHost(&pinned, size_t(2) << 20));
  static int hold_inputs_ms = 300;
  const uint64_t q_at = 1 << 20, answer_at = 8192;
  absl::StatusOr<std::unique_ptr<client::FastPathRing>> ring = client::FastPathRing::Create(cl);
  ASSERT_TRUE(ring.ok()) << ring.status();

  // Steps 0-1 over gRPC, 2-3 through the ring; step 4 the control: the same timeline without
  // wait_inputs_event, where the server must read the stale q (so the hold does what it says).
  for (int i = 0; i < 5; ++i) {
    const bool through_ring = i == 2 || i == 3;
    const bool control = i == 4;
    v1::DecodeStepRequest plain;
    plain.set_layer(0);
    plain.set_step_id(60 + i);
    for (uint64_t id : ids) plain.add_sequence_ids(id);
    plain.set_rows_per_sequence(1);
    std::vector<float> w(size_t(requests) * H);
    for (float& x : w) x = normal(rng);
    const std::string q = codes();
    plain.mutable_q()->set_dtype(v1::DTYPE_FP8_E4M3);
    for (int64_t d : {int64_t{requests}, int64_t{H}, int64_t{D}}) plain.mutable_q()->add_shape(d);
    plain.mutable_q()->set_data(q);
    *plain.mutable_weights() = client::F32Tensor(w, {requests, H});
    absl::StatusOr<client::StepAnswer> want = cl.DecodeStep(plain);
    ASSERT_TRUE(want.ok()) << want.status();

    // Stale q in the buffer now; the step's q lands there only after the hold.
    const std::string stale = codes();
    const uint64_t w_at = q_at + (q.size() + 255) / 256 * 256;
    ASSERT_CUDA(cudaMemcpy(static_cast<char*>(buffer) + q_at, stale.data(), stale.size(),
                           cudaMemcpyHostToDevice));
    ASSERT_CUDA(cudaMemset(static_cast<char*>(buffer) + answer_at, 0x5A, want->topk.size() * 4));
    std::memcpy(pinned, q.data(), q.size());
    std::memcpy(static_cast<char*>(pinned) + q.size(), w.data(), w.size() * 4);
    ASSERT_CUDA(cudaLaunchHostFunc(worker, HoldStream, &hold_inputs_ms));
    ASSERT_CUDA(cudaMemcpyAsync(static_cast<char*>(buffer) + q_at, pinned, q.size(),
                                cudaMemcpyHostToDevice, worker));
    ASSERT_CUDA(cudaMemcpyAsync(static_cast<char*>(buffer) + w_at,
                                static_cast<char*>(pinned) + q.size(), w.size() * 4,
                                cudaMemcpyHostToDevice, worker));
    ASSERT_CUDA(cudaEventRecord(inputs, worker));

    absl::Status status;
    if (!through_ring) {
      v1::DecodeStepRequest req = plain;
      req.mutable_q()->clear_data();
      req.mutable_weights()->clear_data();
      v1::CudaIpcStep* ci = req.mutable_cuda_ipc();
      ci->set_region_id(*region);
      ci->set_q_offset(q_at);
      ci->set_weights_offset(w_at);
      ci->set_answer_offset(answer_at);
      ci->set_wait_inputs_event(!control);
      ci->set_record_answer_event(!control);
      absl::StatusOr<client::StepAnswer> got = cl.DecodeStep(req);
      status = got.status();
    } else {
      client::RingStep step;
      step.descriptor.layer = 0;
      step.descriptor.step_id = 60 + i;
      step.descriptor.flags = ring::kAnswerCudaIpc | ring::kInputsCudaIpc | ring::kWaitInputsEvent |
                              ring::kRecordAnswerEvent;
      step.descriptor.cuda_ipc_region_id = *region;
      step.descriptor.rows_per_sequence = 1;
      step.descriptor.q_dtype = v1::DTYPE_FP8_E4M3;
      step.descriptor.weights_dtype = v1::DTYPE_FP32;
      step.descriptor.q_offset = q_at;
      step.descriptor.weights_offset = w_at;
      step.descriptor.answer_offset = answer_at;
      step.sequence_ids = ids;
      absl::StatusOr<client::RingCompletion> done = (*ring)->Step(step);
      status = done.ok() ? done->status : done.status();
    }
    ASSERT_TRUE(status.ok()) << status;
    std::vector<int32_t> got(want->topk.size());
    ASSERT_CUDA(cudaStreamWaitEvent(worker, answer, 0));
    ASSERT_CUDA(cudaMemcpyAsync(got.data(), static_cast<char*>(buffer) + answer_at, got.size() * 4,
                                cudaMemcpyDeviceToHost, worker));
    ASSERT_CUDA(cudaStreamSynchronize(worker));
    if (control) {
      EXPECT_NE(got, want->topk) << "without the wait the server still saw the new q: the "
                                    "300 ms hold did not hold";
    } else {
      EXPECT_EQ(got, want->topk) << (through_ring ? "ring" : "gRPC")
                                 << ": the server read q before the inputs event (step " << i
                                 << ")";
    }
  }
  ASSERT_TRUE((*ring)->Unregister().ok());
  ASSERT_TRUE(cl.UnregisterCudaIpcMemory(*region).ok());
  ASSERT_CUDA(cudaFreeHost(pinned));
  ASSERT_CUDA(cudaStreamDestroy(worker));
  ASSERT_CUDA(cudaEventDestroy(inputs));
  ASSERT_CUDA(cudaEventDestroy(answer));
  ASSERT_CUDA(cudaFree(buffer));
}

// A step's new keys read from the exported buffer (cuda_ipc.new_keys_offset /
// new_key_scales_offset; the ring's kKeysCudaIpc), pre-quantized in the layer's format: FP8
// codes and fp32 scales at v32's layer 0, FP4 codes and UE8M0 scales at v41's. Over unary, a
// stream and the ring, each step answers (from the buffer) bit for bit what twin sequences
// answer to the same step with everything inline, and both keep equal lengths. A NaN code or
// a bad scale written into the buffer fails the step with INVALID_ARGUMENT naming
// new_keys.data / new_key_scales.data, found on the device, and commits nothing. With
// wait_inputs_event and the keys alone on the device, the server's stream waits for the
// worker's record: the buffer holds poisoned keys until the worker's stream, held 300 ms,
// copies the real ones there and records the event; the step must succeed and answer as the
// inline step (the control, without the wait, must read the poison and fail).
TEST(GpuIpcTest, KeysFromTheExportedBufferAnswerAsInline) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    GTEST_SKIP() << "no GPU visible: the CUDA IPC data plane needs one";
  }
  for (const std::string profile : {"v32", "v41"}) {
    SCOPED_TRACE(profile);
    ServerProcess server;
    const std::string address = server.Start(profile);
    ASSERT_FALSE(address.empty()) << server.log();
    absl::StatusOr<std::unique_ptr<client::IndexerClient>> c =
        client::IndexerClient::Connect(address);
    ASSERT_TRUE(c.ok()) << c.status();
    client::IndexerClient& cl = **c;
    absl::StatusOr<v1::ServerInfo> info = cl.ServerInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    ASSERT_EQ(info->backend(), "cuda");
    const int H = info->num_heads(), D = info->head_dim(), K = info->topk();
    ASSERT_GT(info->layers_size(), 0);
    ASSERT_EQ(info->layers(0).role(), v1::LAYER_ROLE_DENSE);
    const bool fp4 = info->layers(0).cache_format() == v1::CACHE_FORMAT_FP4;
    ASSERT_EQ(fp4, profile == "v41");

    std::mt19937_64 rng(::decode_indexer::testing::TestSeed() + 2);
    std::normal_distribution<float> normal;
    const int requests = 8;
    std::vector<uint64_t> ids, twins;
    std::vector<int64_t> lengths;
    for (int i = 0; i < requests; ++i) {
      ids.push_back(500 + i);
      twins.push_back(600 + i);
      lengths.push_back(1000 + int64_t(rng() % 4000));
      std::vector<float> keys(size_t(lengths.back()) * D);
      for (float& x : keys) x = normal(rng);
      for (uint64_t id : {ids.back(), twins.back()}) {
        ASSERT_TRUE(cl.CreateSequence(id).ok());
        absl::StatusOr<int64_t> len = cl.AppendKeys(id, 0, keys, D);
        ASSERT_TRUE(len.ok()) << len.status();
      }
    }
    // One pre-quantized key a request: codes (no NaN) and scales (powers of two).
    const size_t key_bytes = size_t(requests) * (fp4 ? D / 2 : D);
    const size_t scale_bytes = size_t(requests) * (fp4 ? D / 32 : 4);
    auto fresh_keys = [&] {
      std::string keys(key_bytes, '\0'), scales(scale_bytes, '\0');
      for (char& ch : keys) {
        uint8_t b = uint8_t(rng());
        if (!fp4 && (b & 0x7F) == 0x7F) b ^= 0x40;
        ch = static_cast<char>(b);
      }
      for (int r = 0; r < requests; ++r) {
        if (fp4) {
          for (int g = 0; g < D / 32; ++g)
            scales[size_t(r) * (D / 32) + g] = char(118 + rng() % 14);
        } else {
          const float s = std::ldexp(1.0f, -int(2 + rng() % 8));
          std::memcpy(&scales[size_t(r) * 4], &s, 4);
        }
      }
      return std::pair<std::string, std::string>(keys, scales);
    };
    int step = 0;
    // The columnar step for `seqs` with these keys inline (fp32 q the server rotates).
    auto columnar = [&](const std::vector<uint64_t>& seqs, const std::string& keys,
                        const std::string& scales, const std::vector<float>& q,
                        const std::vector<float>& w) {
      v1::DecodeStepRequest req;
      req.set_layer(0);
      req.set_step_id(uint64_t(step));
      for (uint64_t id : seqs) req.add_sequence_ids(id);
      req.set_rows_per_sequence(1);
      v1::Tensor* k = req.mutable_new_keys();
      k->set_dtype(fp4 ? v1::DTYPE_FP4_E2M1 : v1::DTYPE_FP8_E4M3);
      k->add_shape(requests);
      k->add_shape(D);
      k->set_data(keys);
      v1::Tensor* ks = req.mutable_new_key_scales();
      ks->set_dtype(fp4 ? v1::DTYPE_UE8M0 : v1::DTYPE_FP32);
      ks->add_shape(requests);
      if (fp4) ks->add_shape(D / 32);
      ks->set_data(scales);
      *req.mutable_q() = client::F32Tensor(q, {requests, H, D});
      *req.mutable_weights() = client::F32Tensor(w, {requests, H});
      std::vector<int64_t> positions;
      for (int i = 0; i < requests; ++i) positions.push_back(lengths[i] + step);
      *req.mutable_positions() = client::I64Tensor(positions, {requests});
      return req;
    };
    auto fresh_q = [&] {
      std::vector<float> q(size_t(requests) * H * D), w(size_t(requests) * H);
      for (float& x : q) x = normal(rng);
      for (float& x : w) x = normal(rng);
      return std::pair<std::vector<float>, std::vector<float>>(q, w);
    };

    ASSERT_CUDA(cudaSetDevice(0));
    const size_t bytes = size_t(4) << 20;
    void* buffer = nullptr;
    ASSERT_CUDA(cudaMalloc(&buffer, bytes));
    ASSERT_CUDA(cudaMemset(buffer, 0x5A, bytes));
    ASSERT_CUDA(cudaDeviceSynchronize());
    cudaIpcMemHandle_t handle;
    ASSERT_CUDA(cudaIpcGetMemHandle(&handle, buffer));
    cudaEvent_t inputs = nullptr;
    ASSERT_CUDA(cudaEventCreateWithFlags(&inputs, cudaEventInterprocess | cudaEventDisableTiming));
    cudaIpcEventHandle_t inputs_handle;
    ASSERT_CUDA(cudaIpcGetEventHandle(&inputs_handle, inputs));
    absl::StatusOr<uint64_t> region = cl.RegisterCudaIpcMemory(
        std::string(reinterpret_cast<const char*>(&handle), sizeof(handle)), bytes, 0,
        std::string(reinterpret_cast<const char*>(&inputs_handle), sizeof(inputs_handle)));
    ASSERT_TRUE(region.ok()) << region.status() << "\n" << server.log();
    const uint64_t keys_at = 1 << 20;
    const uint64_t scales_at = keys_at + (key_bytes + 255) / 256 * 256;
    const uint64_t answer_at = 8192;
    auto put = [&](uint64_t at, const std::string& data) {
      ASSERT_CUDA(cudaMemcpy(static_cast<char*>(buffer) + at, data.data(), data.size(),
                             cudaMemcpyHostToDevice));
    };
    auto read_back = [&](size_t count) {
      std::vector<int32_t> out(count);
      EXPECT_EQ(cudaMemcpy(out.data(), static_cast<char*>(buffer) + answer_at, count * 4,
                           cudaMemcpyDeviceToHost),
                cudaSuccess);
      return out;
    };
    // The twins' step with the keys at keys_at / scales_at in the buffer.
    auto on_device = [&](v1::DecodeStepRequest req) {
      req.mutable_new_keys()->clear_data();
      req.mutable_new_key_scales()->clear_data();
      v1::CudaIpcStep* ci = req.mutable_cuda_ipc();
      ci->set_region_id(*region);
      ci->set_new_keys_offset(keys_at);
      ci->set_new_key_scales_offset(scales_at);
      ci->set_answer_offset(answer_at);
      return req;
    };
    auto twin_lengths = [&] {
      std::vector<int64_t> out;
      for (uint64_t id : twins) {
        absl::StatusOr<v1::GetSequenceResponse> seq = cl.GetSequence(id);
        EXPECT_TRUE(seq.ok()) << seq.status();
        out.push_back(seq.ok() && seq->caches_size() > 0 ? seq->caches(0).length() : -1);
      }
      return out;
    };
    absl::StatusOr<std::unique_ptr<client::StepStream>> stream = cl.OpenStream();
    ASSERT_TRUE(stream.ok()) << stream.status();
    absl::StatusOr<std::unique_ptr<client::FastPathRing>> ring = client::FastPathRing::Create(cl);
    ASSERT_TRUE(ring.ok()) << ring.status();

    // Unary, stream, ring, twice each.
    for (int i = 0; i < 6; ++i, ++step) {
      const auto [keys, scales] = fresh_keys();
      const auto [q, w] = fresh_q();
      absl::StatusOr<client::StepAnswer> want = cl.DecodeStep(columnar(ids, keys, scales, q, w));
      ASSERT_TRUE(want.ok()) << want.status();
      ASSERT_EQ(want->rows, requests);
      ASSERT_EQ(want->k, K);
      const v1::DecodeStepRequest twin_inline = columnar(twins, keys, scales, q, w);
      put(keys_at, keys);
      put(scales_at, scales);
      ASSERT_CUDA(cudaMemset(static_cast<char*>(buffer) + answer_at, 0x5A, want->topk.size() * 4));
      std::vector<int64_t> got_lengths;
      if (i % 3 == 0) {
        absl::StatusOr<client::StepAnswer> got = cl.DecodeStep(on_device(twin_inline));
        ASSERT_TRUE(got.ok()) << got.status();
        got_lengths = got->lengths;
      } else if (i % 3 == 1) {
        absl::StatusOr<client::StepAnswer> got = (*stream)->Step(on_device(twin_inline));
        ASSERT_TRUE(got.ok()) << got.status();
        got_lengths = got->lengths;
      } else {
        v1::DecodeStepRequest staged_req = twin_inline;  // q, weights, positions in the ring
        staged_req.clear_new_keys();
        staged_req.clear_new_key_scales();
        absl::StatusOr<client::StagedStep> st = client::StageRequest(
            staged_req, std::span<uint8_t>((*ring)->region(), (*ring)->region_bytes()),
            (*ring)->data_offset(), K, info->num_candidate_blocks());
        ASSERT_TRUE(st.ok()) << st.status();
        ring::StepDescriptor& d = st->step.descriptor;
        d.flags |= ring::kAnswerCudaIpc | ring::kKeysCudaIpc;
        d.cuda_ipc_region_id = *region;
        d.answer_offset = answer_at;
        d.new_keys_dtype = fp4 ? v1::DTYPE_FP4_E2M1 : v1::DTYPE_FP8_E4M3;
        d.new_key_scales_dtype = fp4 ? v1::DTYPE_UE8M0 : v1::DTYPE_FP32;
        d.new_keys_rows = requests;
        d.new_keys_offset = keys_at;
        d.new_key_scales_offset = scales_at;
        absl::StatusOr<client::RingCompletion> done = (*ring)->Step(st->step);
        ASSERT_TRUE(done.ok()) << done.status();
        ASSERT_TRUE(done->status.ok()) << done->status;
        got_lengths = done->lengths;
      }
      EXPECT_EQ(got_lengths, want->lengths) << "step " << i;
      EXPECT_EQ(read_back(want->topk.size()), want->topk) << "step " << i;
    }

    // Bad values written into the buffer: found on the device, nothing committed.
    for (int bad = 0; bad < 3; ++bad, ++step) {
      auto [keys, scales] = fresh_keys();
      const auto [q, w] = fresh_q();
      std::string field;
      if (bad == 0 && !fp4) {
        keys[rng() % keys.size()] = char(rng() % 2 ? 0x7F : 0xFF);
        field = "new_keys.data";
      } else if (fp4) {
        scales[rng() % scales.size()] = char(0xFF);
        field = "new_key_scales.data";
      } else {
        const float v = bad == 1 ? -0.5f : 0.0f;
        std::memcpy(&scales[4 * (rng() % requests)], &v, 4);
        field = "new_key_scales.data";
      }
      put(keys_at, keys);
      put(scales_at, scales);
      const std::vector<int64_t> before = twin_lengths();
      absl::StatusOr<client::StepAnswer> r =
          cl.DecodeStep(on_device(columnar(twins, keys, scales, q, w)));
      EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << field << r.status();
      EXPECT_NE(r.status().message().find(field), std::string::npos) << r.status();
      EXPECT_EQ(twin_lengths(), before) << field << ": a failed step committed its keys";
    }

    // GPU-side ordering of the keys alone: poison in the buffer until the held worker stream
    // copies the real keys there and records the inputs event.
    cudaStream_t worker = nullptr;
    ASSERT_CUDA(cudaStreamCreateWithFlags(&worker, cudaStreamNonBlocking));
    void* pinned = nullptr;
    ASSERT_CUDA(cudaMallocHost(&pinned, key_bytes + scale_bytes));
    static int hold_keys_ms = 300;
    for (const bool wait : {true, false}) {  // the second: the control
      const auto [keys, scales] = fresh_keys();
      const auto [q, w] = fresh_q();
      // FP8: a NaN code in every key; FP4 codes are all finite: a NaN scale.
      std::string poison = keys, poison_scales = scales;
      if (fp4) {
        poison_scales[0] = char(0xFF);
      } else {
        for (size_t r = 0; r < size_t(requests); ++r) poison[r * D] = char(0x7F);
      }
      put(keys_at, poison);
      put(scales_at, poison_scales);
      std::memcpy(pinned, keys.data(), keys.size());
      std::memcpy(static_cast<char*>(pinned) + keys.size(), scales.data(), scales.size());
      ASSERT_CUDA(cudaLaunchHostFunc(worker, HoldStream, &hold_keys_ms));
      ASSERT_CUDA(cudaMemcpyAsync(static_cast<char*>(buffer) + keys_at, pinned, keys.size(),
                                  cudaMemcpyHostToDevice, worker));
      ASSERT_CUDA(cudaMemcpyAsync(static_cast<char*>(buffer) + scales_at,
                                  static_cast<char*>(pinned) + keys.size(), scales.size(),
                                  cudaMemcpyHostToDevice, worker));
      ASSERT_CUDA(cudaEventRecord(inputs, worker));
      v1::DecodeStepRequest req = on_device(columnar(twins, keys, scales, q, w));
      req.mutable_cuda_ipc()->set_wait_inputs_event(wait);
      absl::StatusOr<client::StepAnswer> got = cl.DecodeStep(req);
      if (wait) {
        ASSERT_TRUE(got.ok()) << got.status() << ": the server read the keys before the event";
        absl::StatusOr<client::StepAnswer> want = cl.DecodeStep(columnar(ids, keys, scales, q, w));
        ASSERT_TRUE(want.ok()) << want.status();
        EXPECT_EQ(read_back(want->topk.size()), want->topk);
        EXPECT_EQ(got->lengths, want->lengths);
      } else {
        EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument)
            << "without the wait the server still saw the real keys: the 300 ms hold did not "
               "hold ("
            << got.status() << ")";
      }
      ASSERT_CUDA(cudaStreamSynchronize(worker));
      ++step;
    }
    ASSERT_TRUE((*stream)->Finish().ok());
    ASSERT_TRUE((*ring)->Unregister().ok());
    ASSERT_TRUE(cl.UnregisterCudaIpcMemory(*region).ok());
    ASSERT_CUDA(cudaFreeHost(pinned));
    ASSERT_CUDA(cudaStreamDestroy(worker));
    ASSERT_CUDA(cudaEventDestroy(inputs));
    ASSERT_CUDA(cudaFree(buffer));
  }
}

}  // namespace
}  // namespace decode_indexer::testing
