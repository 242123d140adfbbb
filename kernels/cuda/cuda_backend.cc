// The CUDA backend: one instance per rank and device. It owns the rank's streams (main + a
// side stream for CandidateOverlap), its workspaces (sized once from the limits, so a decode
// step allocates nothing and never waits on the host), and strings the SM90 launchers together.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "decode_indexer/kernels/backend.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/sm90_launchers.h"

namespace decode_indexer::kernels {
namespace {

using cuda::CudaStatus;

int64_t RoundUp4(int64_t n) { return (n + 3) / 4 * 4; }

// Smallest candidate block the scores workspace is sized for (v41 uses 8).
constexpr int32_t kMinCandidateBlock = 8;

class CudaBackend final : public Backend {
 public:
  CudaBackend(const BackendLimits& limits, int device) : limits_(limits), device_(device) {}

  ~CudaBackend() override {
    cudaSetDevice(device_);
    if (main_ != nullptr) cudaStreamSynchronize(main_);
    if (side_ != nullptr) cudaStreamSynchronize(side_);
    for (void* p : {static_cast<void*>(schedule_ws_), static_cast<void*>(logits_),
                    static_cast<void*>(scores_), static_cast<void*>(sparse_logits_),
                    static_cast<void*>(masked_positions_), static_cast<void*>(masked_counts_)}) {
      if (p != nullptr) cudaFree(p);
    }
    if (fork_event_ != nullptr) cudaEventDestroy(fork_event_);
    if (join_event_ != nullptr) cudaEventDestroy(join_event_);
    if (side_ != nullptr) cudaStreamDestroy(side_);
    if (main_ != nullptr) cudaStreamDestroy(main_);
  }

  absl::Status Init() {
    DI_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    cudaDeviceProp prop;
    DI_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device_), "cudaGetDeviceProperties");
    if (prop.major < 9) {
      return absl::FailedPreconditionError(absl::StrCat("cuda:", device_, " ", prop.name, " is sm_",
                                                        prop.major, prop.minor,
                                                        "; the kernels are built for sm_90a"));
    }
    device_name_ = prop.name;
    num_sms_ = prop.multiProcessorCount;
    DI_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&main_, cudaStreamNonBlocking),
                            "create main stream");
    DI_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking),
                            "create side stream");
    DI_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&fork_event_, cudaEventDisableTiming),
                            "create fork event");
    DI_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&join_event_, cudaEventDisableTiming),
                            "create join event");
    const int64_t rows = std::max(1, limits_.max_rows);
    const int64_t requests = std::max(1, limits_.max_requests);
    logits_stride_cap_ = RoundUp4(std::max<int64_t>(1, limits_.max_context));
    scores_stride_cap_ =
        RoundUp4((logits_stride_cap_ + kMinCandidateBlock - 1) / kMinCandidateBlock);
    const int64_t cand = std::max(1, limits_.max_candidate_positions);
    DI_CUDA_RETURN_IF_ERROR(
        cudaMalloc(&schedule_ws_, sizeof(int32_t) * cuda::MqaScheduleInts(requests)),
        "allocate schedule workspace");
    schedule_ = cuda::CarveMqaSchedule(schedule_ws_, static_cast<int32_t>(requests));
    DI_CUDA_RETURN_IF_ERROR(cudaMalloc(&logits_, sizeof(float) * rows * logits_stride_cap_),
                            "allocate logits workspace");
    DI_CUDA_RETURN_IF_ERROR(cudaMalloc(&scores_, sizeof(float) * rows * scores_stride_cap_),
                            "allocate candidate-score workspace");
    DI_CUDA_RETURN_IF_ERROR(cudaMalloc(&sparse_logits_, sizeof(float) * rows * cand),
                            "allocate sparse logits workspace");
    DI_CUDA_RETURN_IF_ERROR(cudaMalloc(&masked_positions_, sizeof(int32_t) * rows * cand),
                            "allocate masked expansion workspace");
    DI_CUDA_RETURN_IF_ERROR(cudaMalloc(&masked_counts_, sizeof(int32_t) * rows),
                            "allocate masked count workspace");
    return absl::OkStatus();
  }

  std::string_view name() const override { return "cuda"; }
  std::string description() const override {
    return absl::StrCat("cuda:", device_, " ", device_name_, " (", num_sms_, " SMs)");
  }

  absl::StatusOr<void*> Allocate(size_t bytes) override {
    DI_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    void* ptr = nullptr;
    const cudaError_t err = cudaMalloc(&ptr, std::max<size_t>(bytes, 16));
    if (err != cudaSuccess) {
      cudaGetLastError();  // an allocation failure is not sticky: clear it for later calls
      return absl::ResourceExhaustedError(absl::StrCat("cuda:", device_, ": cannot allocate ",
                                                       bytes, " bytes: ", cudaGetErrorString(err)));
    }
    DI_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(ptr, 0, bytes, main_), "zero-fill allocation");
    return ptr;
  }
  void Free(void* ptr) override {
    if (ptr == nullptr) return;
    cudaSetDevice(device_);
    cudaFree(ptr);  // implicitly waits for work that may still use it
  }

  absl::Status CopyToDevice(void* dst, const void* host_src, size_t bytes) override {
    DI_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    DI_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, main_),
                            "copy host to device");
    return absl::OkStatus();
  }
  absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes) override {
    DI_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    DI_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, main_),
                            "copy device to host");
    return absl::OkStatus();
  }
  absl::Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes) override {
    DI_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    DI_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, main_),
                            "copy device to device");
    return absl::OkStatus();
  }
  absl::Status Synchronize() override {
    DI_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    DI_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(side_), "synchronize side stream");
    DI_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(main_), "synchronize main stream");
    return absl::OkStatus();
  }

  absl::Status InsertKeys(const KeyInsertArgs& args) override {
    DI_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    return cuda::LaunchInsertKeys(args, main_);
  }

  absl::Status RopeQuantQ(const QPrepArgs& args) override {
    DI_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    const float c =
        static_cast<float>(1.0 / std::sqrt(static_cast<double>(args.num_heads) * args.head_dim));
    return cuda::LaunchRopeQuantQ(args, c, main_);
  }

  absl::Status DenseTopK(const DenseArgs& args) override {
    DI_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    const RowBatch& rows = args.rows;
    if (rows.num_rows == 0) return absl::OkStatus();
    if (absl::Status s = CheckRows(rows); !s.ok()) return s;
    const int64_t stride = RoundUp4(rows.max_row_length);
    cuda::PagedLogitsArgs la;
    la.cache = args.cache;
    la.rows = rows;
    la.q = args.q;
    la.schedule = schedule_;
    la.logits = logits_;
    la.logits_stride = stride;
    absl::Status s;
    // The fused logits variant derives its schedule itself: one launch fewer per step.
    if (cuda::PagedLogitsNeedsSchedule(la)) {
      if (s = cuda::LaunchMqaSchedule(rows, schedule_, main_); !s.ok()) return s;
    }
    if (s = cuda::LaunchPagedMqaLogits(la, num_sms_, main_); !s.ok()) return s;
    cuda::TopKArgs tk;
    tk.num_rows = rows.num_rows;
    tk.values = logits_;
    tk.stride = stride;
    tk.lengths = rows.row_length;
    tk.k = args.topk;
    tk.out = args.topk_out;
    tk.max_length = rows.max_row_length;
    if (s = cuda::LaunchRadixTopK(tk, num_sms_, main_); !s.ok()) return s;
    if (args.candidates_out == nullptr) return absl::OkStatus();
    const int32_t bs = args.candidate_block_size;
    if (bs < kMinCandidateBlock) {
      return absl::UnimplementedError(absl::StrCat("candidate block size ", bs, " (the CUDA ",
                                                   "backend needs >= ", kMinCandidateBlock, ")"));
    }
    const int64_t scores_stride = RoundUp4((rows.max_row_length + bs - 1) / bs);
    if (s = cuda::LaunchCandidateScores(rows.num_rows, logits_, stride, rows.row_length, bs,
                                        scores_, scores_stride, static_cast<int32_t>(scores_stride),
                                        main_);
        !s.ok()) {
      return s;
    }
    cuda::TopKArgs ck;
    ck.num_rows = rows.num_rows;
    ck.values = scores_;
    ck.stride = scores_stride;
    ck.lengths = rows.row_length;
    ck.length_divisor = bs;
    ck.k = args.num_candidate_blocks;
    ck.out = args.candidates_out;
    ck.max_length = static_cast<int32_t>(scores_stride);
    return cuda::LaunchRadixTopK(ck, num_sms_, main_);
  }

  absl::Status SparseTopK(const SparseArgs& args) override {
    DI_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    if (args.rows.num_rows == 0) return absl::OkStatus();
    if (absl::Status s = CheckRows(args.rows); !s.ok()) return s;
    return Sparse(args.cache, args.rows, args.q, args.positions, args.counts, args.max_positions,
                  args.topk, args.topk_out);
  }

  absl::Status MaskedTopK(const MaskedArgs& args) override {
    DI_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    if (args.rows.num_rows == 0) return absl::OkStatus();
    if (absl::Status s = CheckRows(args.rows); !s.ok()) return s;
    // The masked consumer scores exactly the positions the sparse one would: expand inline,
    // then share the sparse kernels, so both answer bit-identically.
    ExpandArgs e;
    e.num_rows = args.rows.num_rows;
    e.candidates = args.candidates;
    e.row_length = args.rows.row_length;
    e.num_candidate_blocks = args.num_candidate_blocks;
    e.candidate_block_size = args.candidate_block_size;
    e.out.positions = masked_positions_;
    e.out.counts = masked_counts_;
    e.out.max_positions = args.num_candidate_blocks * args.candidate_block_size;
    if (e.out.max_positions > limits_.max_candidate_positions) {
      return absl::InvalidArgumentError("masked top-k: candidate positions exceed the limits");
    }
    if (absl::Status s = cuda::LaunchExpandCandidates(e, main_); !s.ok()) return s;
    return Sparse(args.cache, args.rows, args.q, masked_positions_, masked_counts_,
                  e.out.max_positions, args.topk, args.topk_out);
  }

  absl::Status CopyRows(const CopyRowsArgs& args) override {
    DI_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    return cuda::LaunchCopyRows(args, main_);
  }

  absl::Status ForkExpand(const ExpandArgs& args) override {
    DI_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    // The side stream starts after the main stream's work so far (the candidates it reads,
    // and the previous step's reads of the expansion it overwrites).
    DI_CUDA_RETURN_IF_ERROR(cudaEventRecord(fork_event_, main_), "record fork event");
    DI_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side_, fork_event_, 0), "side waits on fork");
    if (absl::Status s = cuda::LaunchExpandCandidates(args, side_); !s.ok()) return s;
    DI_CUDA_RETURN_IF_ERROR(cudaEventRecord(join_event_, side_), "record join event");
    join_pending_ = true;
    return absl::OkStatus();
  }

  absl::Status JoinExpand() override {
    if (!join_pending_) return absl::OkStatus();
    DI_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    DI_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(main_, join_event_, 0), "main waits on join");
    join_pending_ = false;
    return absl::OkStatus();
  }

  cudaStream_t main_stream() const { return main_; }

 private:
  absl::Status CheckRows(const RowBatch& rows) const {
    if (rows.num_rows > limits_.max_rows || rows.num_requests > limits_.max_requests ||
        rows.max_row_length > limits_.max_context || rows.num_requests <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda: step of ", rows.num_rows, " rows, ", rows.num_requests, " requests, length ",
          rows.max_row_length, " exceeds the backend limits (", limits_.max_rows, ", ",
          limits_.max_requests, ", ", limits_.max_context, ")"));
    }
    return absl::OkStatus();
  }

  absl::Status Sparse(const CacheView& cache, const RowBatch& rows, const QView& q,
                      const int32_t* positions, const int32_t* counts, int32_t max_positions,
                      int32_t topk, int32_t* out) {
    if (max_positions > limits_.max_candidate_positions) {
      return absl::InvalidArgumentError("sparse top-k: max_positions exceeds the limits");
    }
    if (absl::Status s = cuda::LaunchSparseLogits(cache, rows, q, positions, counts, max_positions,
                                                  sparse_logits_, main_);
        !s.ok()) {
      return s;
    }
    cuda::TopKArgs tk;
    tk.num_rows = rows.num_rows;
    tk.values = sparse_logits_;
    tk.stride = max_positions;
    tk.lengths = counts;
    tk.k = topk;
    tk.out = out;
    tk.index_map = positions;
    tk.index_map_stride = max_positions;
    tk.max_length = max_positions;
    return cuda::LaunchRadixTopK(tk, num_sms_, main_);
  }

  const BackendLimits limits_;
  const int device_;
  std::string device_name_;
  int num_sms_ = 0;
  cudaStream_t main_ = nullptr;
  cudaStream_t side_ = nullptr;
  cudaEvent_t fork_event_ = nullptr;
  cudaEvent_t join_event_ = nullptr;
  bool join_pending_ = false;
  int32_t* schedule_ws_ = nullptr;
  cuda::MqaSchedule schedule_;
  float* logits_ = nullptr;
  int64_t logits_stride_cap_ = 0;
  float* scores_ = nullptr;
  int64_t scores_stride_cap_ = 0;
  float* sparse_logits_ = nullptr;
  int32_t* masked_positions_ = nullptr;
  int32_t* masked_counts_ = nullptr;
};

}  // namespace

int CudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // no driver / no device: not an error for callers that probe
    return 0;
  }
  return n;
}

bool CudaBackendAvailable() { return CudaDeviceCount() > 0; }

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(const BackendLimits& limits, int device) {
  const int count = CudaDeviceCount();
  if (device < 0 || device >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuda: device ", device, " requested, ", count, " visible"));
  }
  auto backend = std::make_unique<CudaBackend>(limits, device);
  if (absl::Status s = backend->Init(); !s.ok()) return s;
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace decode_indexer::kernels
