// Device: the memory, copies, stream, graphs, events, IPC and host registration of one
// rank's compute device (kernels/include/decode_indexer/kernels/backend.h joins it with the
// IndexerOps that run on it). What the executor's staging, readback, collectives and the
// data plane need, and nothing of the indexer's math.
//
// Every pointer an operation receives lives in the device's memory (host memory for the CPU
// backend, device memory for CUDA), allocated with Allocate(). Copies are ordered on the
// device's main stream and may return before they are done; Synchronize() waits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace decode_indexer::kernels {

class Device {
 public:
  virtual ~Device() = default;

  // "cpu" or "cuda".
  virtual std::string_view name() const = 0;
  // A one-line description for logs and ServerInfo ("cpu (2 threads)", "cuda:0 NVIDIA H200").
  virtual std::string description() const = 0;

  // Memory in this device's address space, zero-filled.
  virtual absl::StatusOr<void*> Allocate(size_t bytes) = 0;
  virtual void Free(void* ptr) = 0;
  // Ordered on the main stream; host memory must stay valid until Synchronize(). A step's
  // packed upload (its small arrays in one slot of the rank's staging ring) is one
  // CopyToDevice.
  virtual absl::Status CopyToDevice(void* dst, const void* host_src, size_t bytes) = 0;
  virtual absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes) = 0;
  virtual absl::Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes) = 0;
  virtual absl::Status Synchronize() = 0;

  // Host memory for staging a step's uploads. A GPU device page-locks it (and makes it usable
  // from every device), so CopyToDevice from it is a true asynchronous DMA instead of a bounce
  // through a driver buffer that may wait for the stream. It is host memory: pass it as the
  // host side of CopyToDevice / CopyToHost. The default is plain, zero-filled host memory.
  virtual absl::StatusOr<void*> AllocateHost(size_t bytes) {
    void* p = std::calloc(1, bytes > 0 ? bytes : 1);
    if (p == nullptr) return absl::ResourceExhaustedError("cannot allocate host staging memory");
    return p;
  }
  virtual void FreeHost(void* ptr) { std::free(ptr); }

  // Host memory the device's kernels read and write in place, through `device` (a GPU maps
  // page-locked memory into its address space; a host device hands the same pointer twice):
  // words a kernel sets and the host reads after a Synchronize, or clears before a launch,
  // with no copy. Zero-filled. Free with FreeMapped(host).
  struct Mapped {
    void* host = nullptr;
    void* device = nullptr;
  };
  virtual absl::StatusOr<Mapped> AllocateMapped(size_t bytes) {
    void* p = std::calloc(1, bytes > 0 ? bytes : 1);
    if (p == nullptr) return absl::ResourceExhaustedError("cannot allocate mapped host memory");
    return Mapped{p, p};
  }
  virtual void FreeMapped(void* host) { std::free(host); }

  // CUDA graphs (seed: warm). Between BeginCapture and EndCapture the operations called on
  // the main stream (IndexerOps' included) are recorded, not run; EndCapture(key)
  // instantiates the recording and keeps it under `key` without running it (so a failed
  // capture can still run eagerly); Replay(key) launches the graph kept under `key` and
  // answers whether there was one. AbortCapture ends a capture whose calls failed and drops
  // it. DropGraph(key) frees the graph kept under `key` (none there: nothing happens); a replay
  // of it already queued on the stream still runs. While capturing, call no copy, Synchronize,
  // Allocate, ForkExpand or JoinExpand. Every pointer and size a recorded call received is baked
  // into the graph: the caller replays a key only for calls with the same arguments. The default
  // device has no graphs (SupportsGraphs false; the others fail or answer false).
  virtual bool SupportsGraphs() const { return false; }
  virtual absl::Status BeginCapture() {
    return absl::UnimplementedError("this backend has no graphs");
  }
  virtual absl::Status EndCapture(uint64_t key) {
    (void)key;
    return absl::UnimplementedError("this backend has no graphs");
  }
  virtual void AbortCapture() {}
  virtual absl::StatusOr<bool> Replay(uint64_t key) {
    (void)key;
    return false;
  }
  virtual void DropGraph(uint64_t key) { (void)key; }

  // Data plane (serving). A client's device buffer exported with cudaIpcGetMemHandle:
  // `handle` is the cudaIpcMemHandle_t's bytes, `bytes` the size the client declares and
  // `device` its device ordinal (must be this device's). Answers a pointer in this device's
  // memory (CopyDeviceToDevice may write there) until CloseIpcMemory. Devices without
  // device memory answer FAILED_PRECONDITION.
  virtual absl::StatusOr<void*> OpenIpcMemory(std::string_view handle, size_t bytes, int device) {
    (void)handle, (void)bytes, (void)device;
    return absl::FailedPreconditionError("the " + std::string(name()) +
                                         " backend has no device memory to share through CUDA IPC");
  }
  virtual absl::Status CloseIpcMemory(void* ptr) {
    (void)ptr;
    return absl::OkStatus();
  }
  // A client's CUDA IPC event (the cudaIpcEventHandle_t's bytes) on `device` (must be this
  // device's), for GPU-side ordering with the client's stream: WaitEvent makes the main
  // stream wait on the event's latest record (as of the call), RecordEvent records it on the
  // main stream. Devices without events answer FAILED_PRECONDITION (open) and
  // UNIMPLEMENTED (wait, record).
  virtual absl::StatusOr<void*> OpenIpcEvent(std::string_view handle, int device) {
    (void)handle, (void)device;
    return absl::FailedPreconditionError("the " + std::string(name()) +
                                         " backend has no device events to share through CUDA IPC");
  }
  virtual absl::Status CloseIpcEvent(void* event) {
    (void)event;
    return absl::OkStatus();
  }
  virtual absl::Status WaitEvent(void* event) {
    (void)event;
    return absl::UnimplementedError("this backend has no device events");
  }
  virtual absl::Status RecordEvent(void* event) {
    (void)event;
    return absl::UnimplementedError("this backend has no device events");
  }
  // Page-locks host memory the device copies from/to (a client's shared-memory region), so
  // CopyToDevice/CopyToHost there are direct DMA. No-op where there is nothing to pin.
  virtual absl::Status RegisterHostMemory(void* ptr, size_t bytes) {
    (void)ptr, (void)bytes;
    return absl::OkStatus();
  }
  virtual absl::Status UnregisterHostMemory(void* ptr) {
    (void)ptr;
    return absl::OkStatus();
  }
  // Device memory in use on this device (total - free); 0 for host devices.
  virtual int64_t DeviceMemoryBytes() const { return 0; }
};

}  // namespace decode_indexer::kernels
