// Collectives between the ranks of one executor. Buffers live in each rank's backend memory.
// The in-process one serves CPU ranks (and works, slowly, for any backend: it bounces through
// host memory with the backends' own copies); an NCCL one drops in behind the same interface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "decode_indexer/kernels/backend.h"

namespace decode_indexer::exec {

class Collective {
 public:
  virtual ~Collective() = default;
  virtual int32_t world_size() const = 0;

  // Every rank calls it with the same bytes_per_rank; afterwards recv[r * bytes_per_rank ...)
  // holds rank r's send on every rank. send may alias recv + rank * bytes_per_rank. Every rank
  // must call it even after a local failure (pass its buffers anyway), so that no rank waits
  // forever; the step is then discarded.
  virtual absl::Status AllGather(int32_t rank, const void* send, void* recv,
                                 size_t bytes_per_rank) = 0;
  virtual absl::Status Barrier(int32_t rank) = 0;
};

// backends[r] is rank r's backend (not owned). max_bytes bounds world * bytes_per_rank; the
// host bounce buffer is allocated once here.
std::unique_ptr<Collective> MakeInProcessCollective(std::vector<kernels::Backend*> backends,
                                                    size_t max_bytes);

}  // namespace decode_indexer::exec
