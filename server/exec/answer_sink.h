// Where a step's answer goes, resolved once at the edge (the gRPC handler, a benchmark, a
// serving frontend in process) into one value the executor trusts. The executor writes the
// answer exactly once into it:
//   kHost, page-locked (a registered client region): each rank's device-to-host copy lands
//     straight in the span, no host copy;
//   kHost, pageable (the response's bytes, an unregistered region): the copy lands in the
//     rank's page-locked readback space, then one BulkCopy moves it to the span;
//   kDevice (a client's CUDA IPC buffer in the answering rank's backend memory): the top-k
//     written there in place by the answering rank's top-k kernels where that rank scores
//     every row (an unsharded step) and the span is int32-aligned, else device to device (a
//     sharded step's gathered rows, a misaligned span); candidates device to device;
//   kEncoder (DELTA_VARINT): the rows are handed to the encoder in row order, from the ranks'
//     readback space, only after the step committed;
//   kVector (no sink, and executors that ignore sinks: test doubles): StepResult's vectors.
// A sink with no candidate span sends a source's candidates to StepResult::candidate_blocks.
//
// What a failed step leaves (docs/spec.md section 6): it commits nothing and the encoder is not
// called, no vector is returned; a span sink (kHost, kDevice) may hold rows of the uncommitted
// answer (some or all of them, each row whole or as the previous contents) and nothing is
// written outside [topk, topk + rows * K) and [candidates, candidates + rows * NB).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <utility>

namespace decode_indexer::exec {

class AnswerSink {
 public:
  enum class Kind { kVector, kHost, kDevice, kEncoder };
  // Called with successive blocks of whole rows ([rows, K] int32, row order, covering the
  // answer exactly once); the memory is valid during the call only.
  using Encoder = std::function<void(std::span<const int32_t> topk, int32_t rows)>;

  AnswerSink() = default;  // kVector

  // [rows, K] (and [rows, NB], or null) in host memory; `page_locked`: memory every device may
  // DMA (Device::RegisterHostMemory). A wrong `true` is still correct, only slower.
  static AnswerSink Host(int32_t* topk, int32_t* candidates, bool page_locked) {
    AnswerSink s;
    s.kind_ = Kind::kHost;
    s.topk_ = topk;
    s.candidates_ = candidates;
    s.page_locked_ = page_locked;
    return s;
  }
  // Memory of the answering rank's (rank 0's) backend. `done_event` (or null): a device event
  // of that backend (Device::OpenIpcEvent) recorded on its stream after everything that writes
  // the answer (kernels and copies), so the client's stream can wait for the answer on the GPU.
  static AnswerSink Device(int32_t* topk, int32_t* candidates, void* done_event = nullptr) {
    AnswerSink s;
    s.kind_ = Kind::kDevice;
    s.topk_ = topk;
    s.candidates_ = candidates;
    s.done_event_ = done_event;
    return s;
  }
  // The top-k to `encoder`; candidates (if any) to a host span as in Host.
  static AnswerSink Encoded(Encoder encoder, int32_t* candidates, bool page_locked) {
    AnswerSink s;
    s.kind_ = Kind::kEncoder;
    s.encoder_ = std::move(encoder);
    s.candidates_ = candidates;
    s.page_locked_ = page_locked;
    return s;
  }

  Kind kind() const { return kind_; }
  int32_t* topk() const { return topk_; }              // kHost, kDevice
  int32_t* candidates() const { return candidates_; }  // kHost, kEncoder (host), kDevice
  bool page_locked() const { return page_locked_; }
  const Encoder& encoder() const { return encoder_; }
  void* done_event() const { return done_event_; }  // kDevice

 private:
  Kind kind_ = Kind::kVector;
  int32_t* topk_ = nullptr;
  int32_t* candidates_ = nullptr;
  bool page_locked_ = false;
  void* done_event_ = nullptr;
  Encoder encoder_;
};

}  // namespace decode_indexer::exec
