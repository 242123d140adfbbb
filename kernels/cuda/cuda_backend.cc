// The CUDA backend: one instance per rank and device. It owns the rank's streams (main + a
// side stream for CandidateOverlap), its workspaces (sized once from the limits, so a decode
// step allocates nothing and never waits on the host), and strings the SM90 launchers together.
#include <cuda.h>  // types of the driver entry point looked up at run time (no libcuda link)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "decode_indexer/kernels/backend.h"
#include "decode_indexer/kernels/bench_clocks.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/sm90_heuristics.h"
#include "kernels/cuda/sm90_launchers.h"
#include "kernels/cuda/sm90_tile_config.h"

namespace decode_indexer::kernels {
namespace {

using cuda::CudaStatus;

int64_t RoundUp4(int64_t n) { return (n + 3) / 4 * 4; }

// DenseTopK at a candidate source, CandidateSelect::kAuto: take the cooperative single launch
// (sm90_cooperative_topk.cu) where its gate holds. Verified on the H200 (12:34 run: equal
// to the CPU twin and the general path bit for bit); 1.04-1.71x the general path at 8 of the 9
// measured shapes, 0.92x at 1 x 32K (docs/results/cuda-bench.md, 12:34). false: the general two
// launches everywhere (a switch-off).
constexpr bool kCooperativeCandidatesByDefault = true;

// Smallest candidate block the scores workspace is sized for (v41 uses 8).
constexpr int32_t kMinCandidateBlock = 8;

class CudaBackend final : public Backend, public BenchClocks {
 public:
  CudaBackend(const BackendLimits& limits, int device)
      : limits_(limits),
        device_(device),
        dense_math_(cuda::DenseMqaMath(limits.logits_precision)) {}

  ~CudaBackend() override {
    cudaSetDevice(device_);
    if (main_ != nullptr) cudaStreamSynchronize(main_);
    if (side_ != nullptr) cudaStreamSynchronize(side_);
    for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
    for (void* p : {static_cast<void*>(schedule_ws_), static_cast<void*>(logits_),
                    static_cast<void*>(scores_), static_cast<void*>(sparse_logits_),
                    static_cast<void*>(masked_positions_), static_cast<void*>(masked_counts_)}) {
      if (p != nullptr) cudaFree(p);
    }
    if (fork_event_ != nullptr) cudaEventDestroy(fork_event_);
    if (join_event_ != nullptr) cudaEventDestroy(join_event_);
    if (join_reached_event_ != nullptr) cudaEventDestroy(join_reached_event_);
    if (score_start_ != nullptr) cudaEventDestroy(score_start_);
    if (score_end_ != nullptr) cudaEventDestroy(score_end_);
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
    // Timed events: LastOverlapTiming reads the fork, the side's end and the main stream's
    // arrival at the join (three records a source/consumer pair; nobody synchronises on them).
    DI_CUDA_RETURN_IF_ERROR(cudaEventCreate(&fork_event_), "create fork event");
    DI_CUDA_RETURN_IF_ERROR(cudaEventCreate(&join_event_), "create join event");
    DI_CUDA_RETURN_IF_ERROR(cudaEventCreate(&join_reached_event_), "create join-reached event");
    DI_CUDA_RETURN_IF_ERROR(cudaEventCreate(&score_start_), "create scoring-start event");
    DI_CUDA_RETURN_IF_ERROR(cudaEventCreate(&score_end_), "create scoring-end event");
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
    return TimedScoring([&] { return DenseTopKUntimed(args); });
  }
  absl::Status DenseTopKUntimed(const DenseArgs& args) {
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
    la.math = dense_math_;
    absl::Status s;
    // The FP8 / 64-head kernels derive the schedule themselves: one launch fewer per step.
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
    // The cooperative single launch where its gate holds on host values every rank shares
    // (the row count, the longest possible row, K_c), so a step's ranks and its CUDA graph
    // buckets decide alike; the general two launches otherwise. Same answer either way.
    const int32_t max_blocks = static_cast<int32_t>(
        std::min<int64_t>(std::numeric_limits<int32_t>::max(),
                          (std::max<int64_t>(1, limits_.max_context) + bs - 1) / bs));
    const bool cooperative_fits =
        cuda::CooperativeCandidatesSupported(rows.num_rows, max_blocks, args.num_candidate_blocks);
    bool cooperative = false;
    switch (args.candidate_select) {
      case CandidateSelect::kAuto:
        cooperative = kCooperativeCandidatesByDefault && cooperative_fits;
        break;
      case CandidateSelect::kGeneral:
        break;
      case CandidateSelect::kCooperative:
        if (!cooperative_fits) {
          return absl::InvalidArgumentError(absl::StrCat(
              "cooperative candidate selection: ", rows.num_rows, " rows of up to ", max_blocks,
              " blocks, K_c ", args.num_candidate_blocks, " (its gate refuses)"));
        }
        cooperative = true;
        break;
    }
    if (cooperative) {
      cuda::CooperativeCandidatesArgs cc;
      cc.num_rows = rows.num_rows;
      cc.logits = logits_;
      cc.logits_stride = stride;
      cc.row_length = rows.row_length;
      cc.block_size = bs;
      // The step's own bound (<= max_blocks, so the gate still holds) sizes shared memory.
      cc.max_blocks_per_row =
          static_cast<int32_t>((std::max<int64_t>(1, rows.max_row_length) + bs - 1) / bs);
      cc.k = args.num_candidate_blocks;
      cc.out = args.candidates_out;
      return cuda::LaunchCooperativeCandidates(cc, main_);
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
    ck.algo = cuda::TopKArgs::Algo::kGeneral;  // this path is the switch-off: radix kernels only
    return cuda::LaunchRadixTopK(ck, num_sms_, main_);
  }

  absl::Status SparseTopK(const SparseArgs& args) override {
    return TimedScoring([&] { return SparseTopKUntimed(args); });
  }
  absl::Status SparseTopKUntimed(const SparseArgs& args) {
    DI_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    if (args.rows.num_rows == 0) return absl::OkStatus();
    if (absl::Status s = CheckRows(args.rows); !s.ok()) return s;
    return Sparse(args.cache, args.rows, args.q, args.positions, args.counts, args.max_positions,
                  args.topk, args.topk_out, args.topk_select);
  }

  absl::Status MaskedTopK(const MaskedArgs& args) override {
    return TimedScoring([&] { return MaskedTopKUntimed(args); });
  }
  absl::Status MaskedTopKUntimed(const MaskedArgs& args) {
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

  absl::Status CheckValues(const ValueCheckArgs& args) override {
    DI_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    return cuda::LaunchCheckValues(args, num_sms_, main_);
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
    // Timestamp where the main stream reached the join, for LastOverlapTiming.
    DI_CUDA_RETURN_IF_ERROR(cudaEventRecord(join_reached_event_, main_), "record join reached");
    DI_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(main_, join_event_, 0), "main waits on join");
    join_pending_ = false;
    overlap_timed_ = true;
    return absl::OkStatus();
  }

  void SetScoringTiming(bool on) override { scoring_timing_ = on; }
  absl::StatusOr<double> LastScoringUs() override {
    if (!scoring_timed_) return absl::FailedPreconditionError("no eager scoring call yet");
    DI_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    float ms = 0;
    DI_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, score_start_, score_end_),
                            "scoring time: elapsed");
    return 1000.0 * ms;
  }

  absl::StatusOr<OverlapTiming> LastOverlapTiming() override {
    if (!overlap_timed_) return absl::FailedPreconditionError("no fork/join pair has completed");
    DI_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    float side_ms = 0, main_ms = 0;
    DI_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&side_ms, fork_event_, join_event_),
                            "overlap timing: fork to side end");
    DI_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&main_ms, fork_event_, join_reached_event_),
                            "overlap timing: fork to join reached");
    return OverlapTiming{1000.0 * side_ms, 1000.0 * main_ms};
  }

  // Page-locked, portable (every device's DMA engine may read it: a rank's staging can be
  // filled by any thread and uploaded by any rank).
  absl::StatusOr<void*> AllocateHost(size_t bytes) override {
    DI_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    void* ptr = nullptr;
    const cudaError_t err = cudaHostAlloc(&ptr, std::max<size_t>(bytes, 16), cudaHostAllocPortable);
    if (err != cudaSuccess) {
      cudaGetLastError();  // not sticky
      return absl::ResourceExhaustedError(absl::StrCat("cuda:", device_, ": cannot page-lock ",
                                                       bytes,
                                                       " host bytes: ", cudaGetErrorString(err)));
    }
    std::memset(ptr, 0, std::max<size_t>(bytes, 16));
    return ptr;
  }
  void FreeHost(void* ptr) override {
    if (ptr == nullptr) return;
    cudaSetDevice(device_);
    cudaFreeHost(ptr);
  }
  // Page-locked and mapped: kernels on this device read and write it over the bus through the
  // device pointer (the same address under unified addressing).
  absl::StatusOr<Mapped> AllocateMapped(size_t bytes) override {
    DI_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    const size_t n = std::max<size_t>(bytes, 16);
    void* host = nullptr;
    if (const cudaError_t err =
            cudaHostAlloc(&host, n, cudaHostAllocPortable | cudaHostAllocMapped);
        err != cudaSuccess) {
      cudaGetLastError();  // not sticky
      return absl::ResourceExhaustedError(absl::StrCat("cuda:", device_, ": cannot map ", bytes,
                                                       " host bytes: ", cudaGetErrorString(err)));
    }
    std::memset(host, 0, n);
    void* device = nullptr;
    if (const cudaError_t err = cudaHostGetDevicePointer(&device, host, 0); err != cudaSuccess) {
      cudaGetLastError();
      cudaFreeHost(host);
      return absl::FailedPreconditionError(
          absl::StrCat("cuda:", device_,
                       ": no device address for mapped host memory: ", cudaGetErrorString(err)));
    }
    return Mapped{host, device};
  }
  void FreeMapped(void* host) override { FreeHost(host); }

  // Graphs: the main stream's launches between BeginCapture and EndCapture. Thread-local
  // capture mode: another rank's thread (another device) may allocate or synchronize at the
  // same time without invalidating this capture.
  bool SupportsGraphs() const override { return true; }
  absl::Status BeginCapture() override {
    DI_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    DI_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(main_, cudaStreamCaptureModeThreadLocal),
                            "begin graph capture on the main stream");
    capturing_ = true;
    return absl::OkStatus();
  }
  // Ends the capture and instantiates the graph, keeping it under `key` (replacing any graph
  // there). Nothing runs: the caller replays it. A failure leaves no graph and the stream out
  // of capture mode, so the caller can run the same calls eagerly instead.
  absl::Status EndCapture(uint64_t key) override {
    DI_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    cudaGraph_t graph = nullptr;
    const cudaError_t end = cudaStreamEndCapture(main_, &graph);
    capturing_ = false;
    if (end != cudaSuccess || graph == nullptr) {
      if (graph != nullptr) cudaGraphDestroy(graph);
      cudaGetLastError();  // a capture error is not sticky: clear it for the eager fallback
      return absl::FailedPreconditionError(
          absl::StrCat("cuda:", device_, ": graph capture failed: ", cudaGetErrorName(end), " (",
                       cudaGetErrorString(end), ")"));
    }
    cudaGraphExec_t exec = nullptr;
    const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    if (inst != cudaSuccess) {
      cudaGetLastError();
      return absl::FailedPreconditionError(
          absl::StrCat("cuda:", device_, ": graph instantiation failed: ", cudaGetErrorName(inst)));
    }
    if (auto it = graphs_.find(key); it != graphs_.end()) {
      cudaGraphExecDestroy(it->second);
      it->second = exec;
    } else {
      graphs_.emplace(key, exec);
    }
    return absl::OkStatus();
  }
  void AbortCapture() override {
    capturing_ = false;
    cudaSetDevice(device_);
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(main_, &status) == cudaSuccess &&
        status != cudaStreamCaptureStatusNone) {
      cudaGraph_t graph = nullptr;
      cudaStreamEndCapture(main_, &graph);
      if (graph != nullptr) cudaGraphDestroy(graph);
    }
    cudaGetLastError();
  }
  absl::StatusOr<bool> Replay(uint64_t key) override {
    auto it = graphs_.find(key);
    if (it == graphs_.end()) return false;
    DI_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    DI_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(it->second, main_), "launch a captured step graph");
    return true;
  }
  // A graph still running (a replay queued before) is not stopped: the driver frees it when
  // it completes (cuGraphExecDestroy's documented behaviour for an in-flight graph).
  void DropGraph(uint64_t key) override {
    auto it = graphs_.find(key);
    if (it == graphs_.end()) return;
    if (cudaSetDevice(device_) == cudaSuccess) cudaGraphExecDestroy(it->second);
    graphs_.erase(it);
  }

  // Data plane: a client's exported device buffer, opened once per registration.
  absl::StatusOr<void*> OpenIpcMemory(std::string_view handle, size_t bytes, int device) override {
    if (device != device_) {
      return absl::InvalidArgumentError(absl::StrCat("device: the buffer is on cuda:", device,
                                                     ", the answering rank on cuda:", device_));
    }
    if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
      return absl::InvalidArgumentError(
          absl::StrCat("handle: expected ", sizeof(cudaIpcMemHandle_t),
                       " bytes (a cudaIpcMemHandle_t), got ", handle.size()));
    }
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    DI_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    void* ptr = nullptr;
    if (const cudaError_t err = cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess);
        err != cudaSuccess) {
      cudaGetLastError();  // a bad handle is the caller's error, not a sticky device fault
      return absl::InvalidArgumentError(
          absl::StrCat("handle: cudaIpcOpenMemHandle failed: ", cudaGetErrorName(err), " (",
                       cudaGetErrorString(err), ")"));
    }
    // The handle maps the whole allocation: refuse a declared size beyond it, so an answer
    // can never be written past the client's buffer.
    const int64_t allocated = AllocationBytes(ptr);
    if (allocated >= 0 && bytes > static_cast<size_t>(allocated)) {
      cudaIpcCloseMemHandle(ptr);
      return absl::InvalidArgumentError(absl::StrCat(
          "size: ", bytes, " bytes exceed the exported allocation's ", allocated, " bytes"));
    }
    return ptr;
  }
  absl::Status CloseIpcMemory(void* ptr) override {
    DI_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    DI_CUDA_RETURN_IF_ERROR(cudaIpcCloseMemHandle(ptr), "cudaIpcCloseMemHandle");
    return absl::OkStatus();
  }
  // A client's CUDA IPC event; the caller names the field in the message.
  absl::StatusOr<void*> OpenIpcEvent(std::string_view handle, int device) override {
    if (device != device_) {
      return absl::InvalidArgumentError(
          absl::StrCat("the event is on cuda:", device, ", the answering rank on cuda:", device_));
    }
    if (handle.size() != sizeof(cudaIpcEventHandle_t)) {
      return absl::InvalidArgumentError(absl::StrCat("expected ", sizeof(cudaIpcEventHandle_t),
                                                     " bytes (a cudaIpcEventHandle_t), got ",
                                                     handle.size()));
    }
    cudaIpcEventHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    DI_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    cudaEvent_t event = nullptr;
    if (const cudaError_t err = cudaIpcOpenEventHandle(&event, h); err != cudaSuccess) {
      cudaGetLastError();  // a bad handle is the caller's error, not a sticky device fault
      return absl::InvalidArgumentError(
          absl::StrCat("cudaIpcOpenEventHandle failed: ", cudaGetErrorName(err), " (",
                       cudaGetErrorString(err), ")"));
    }
    return static_cast<void*>(event);
  }
  absl::Status CloseIpcEvent(void* event) override {
    DI_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    DI_CUDA_RETURN_IF_ERROR(cudaEventDestroy(static_cast<cudaEvent_t>(event)),
                            "destroy an opened IPC event");
    return absl::OkStatus();
  }
  // The event may belong to another device's backend (rank 0 opened it): a stream may wait on
  // an event of any device.
  absl::Status WaitEvent(void* event) override {
    DI_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    DI_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(main_, static_cast<cudaEvent_t>(event), 0),
                            "wait on the client's inputs event");
    return absl::OkStatus();
  }
  absl::Status RecordEvent(void* event) override {
    DI_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    DI_CUDA_RETURN_IF_ERROR(cudaEventRecord(static_cast<cudaEvent_t>(event), main_),
                            "record the client's answer event");
    return absl::OkStatus();
  }
  absl::Status RegisterHostMemory(void* ptr, size_t bytes) override {
    DI_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    // Portable: every rank's context copies q from the region, not only this one.
    if (const cudaError_t err = cudaHostRegister(ptr, bytes, cudaHostRegisterPortable);
        err != cudaSuccess) {
      cudaGetLastError();  // not sticky: the region simply stays pageable
      return absl::FailedPreconditionError(absl::StrCat("cudaHostRegister of ", bytes,
                                                        " bytes: ", cudaGetErrorName(err), " (",
                                                        cudaGetErrorString(err), ")"));
    }
    return absl::OkStatus();
  }
  absl::Status UnregisterHostMemory(void* ptr) override {
    DI_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    DI_CUDA_RETURN_IF_ERROR(cudaHostUnregister(ptr), "cudaHostUnregister");
    return absl::OkStatus();
  }
  int64_t DeviceMemoryBytes() const override {
    size_t free = 0, total = 0;
    if (cudaSetDevice(device_) != cudaSuccess || cudaMemGetInfo(&free, &total) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return static_cast<int64_t>(total - free);
  }

  cudaStream_t main_stream() const { return main_; }

 private:
  // Bytes of the allocation holding `ptr` from `ptr` on (cuMemGetAddressRange, through the
  // runtime's driver entry point so the build needs no libcuda); -1 where it cannot say.
  static int64_t AllocationBytes(void* ptr) {
    using GetRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess || fn == nullptr) {
      cudaGetLastError();
      return -1;
    }
    CUdeviceptr base = 0;
    size_t size = 0;
    const CUdeviceptr at = reinterpret_cast<CUdeviceptr>(ptr);
    if (reinterpret_cast<GetRange>(fn)(&base, &size, at) != CUDA_SUCCESS) return -1;
    return static_cast<int64_t>(size - (at - base));
  }

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
                      int32_t topk, int32_t* out, TopKSelect topk_select = TopKSelect::kAuto) {
    if (max_positions > limits_.max_candidate_positions) {
      return absl::InvalidArgumentError("sparse top-k: max_positions exceeds the limits");
    }
    // Tensor cores (kMmaPairLeanOcc: kMma's logits bit for bit; for FP4 <= 32 heads two
    // 16-position tiles per warp step, a lean copy issue, key scales decoded once, 4 blocks per
    // SM: 51.7 us vs kMmaPair's 55.2 on the H200, 13:04 run; other shapes run kMma, and those it
    // does not take fall back to the grid kernel inside).
    if (absl::Status s =
            cuda::LaunchSparseLogits(cache, rows, q, positions, counts, max_positions,
                                     sparse_logits_, main_, cuda::kSparseLogitsMathDefault);
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
    // kAuto: LaunchRadixTopK's measured choice (the cooperative top-k where
    // CooperativeTopKPreferred holds); kCooperative is refused where its gate does not hold.
    tk.algo = topk_select == TopKSelect::kGeneral       ? cuda::TopKArgs::Algo::kGeneral
              : topk_select == TopKSelect::kCooperative ? cuda::TopKArgs::Algo::kCooperative
                                                        : cuda::TopKArgs::Algo::kAuto;
    return cuda::LaunchRadixTopK(tk, num_sms_, main_);
  }

  const BackendLimits limits_;
  const int device_;
  // The dense FP8 / 64-head logits kernel: the exact or the fp8 one (sm90_heuristics.h).
  const cuda::MqaMath dense_math_;
  std::string device_name_;
  int num_sms_ = 0;
  cudaStream_t main_ = nullptr;
  cudaStream_t side_ = nullptr;
  cudaEvent_t fork_event_ = nullptr;
  cudaEvent_t join_event_ = nullptr;
  cudaEvent_t join_reached_event_ = nullptr;
  // LastScoringUs: events around the last eager scoring call (none while capturing: a graph
  // would bake the records in).
  cudaEvent_t score_start_ = nullptr;
  cudaEvent_t score_end_ = nullptr;
  bool scoring_timed_ = false;
  bool scoring_timing_ = false;  // SetScoringTiming
  bool capturing_ = false;
  template <typename F>
  absl::Status TimedScoring(F&& scoring) {
    const bool timed = scoring_timing_ && !capturing_ && score_start_ != nullptr;
    if (timed) {
      DI_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
      DI_CUDA_RETURN_IF_ERROR(cudaEventRecord(score_start_, main_), "record scoring start");
    }
    absl::Status s = scoring();
    if (timed && s.ok()) {
      DI_CUDA_RETURN_IF_ERROR(cudaEventRecord(score_end_, main_), "record scoring end");
      scoring_timed_ = true;
    }
    return s;
  }
  bool join_pending_ = false;
  bool overlap_timed_ = false;  // a fork/join pair completed: LastOverlapTiming has events
  int32_t* schedule_ws_ = nullptr;
  cuda::MqaSchedule schedule_;
  float* logits_ = nullptr;
  int64_t logits_stride_cap_ = 0;
  float* scores_ = nullptr;
  int64_t scores_stride_cap_ = 0;
  float* sparse_logits_ = nullptr;
  int32_t* masked_positions_ = nullptr;
  int32_t* masked_counts_ = nullptr;
  // Instantiated step graphs by the caller's key (one rank thread uses a backend).
  std::unordered_map<uint64_t, cudaGraphExec_t> graphs_;
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
