// Keys into a rank's replica of a cache pool: a step's new keys (a few per sequence, gathered
// into one staging chunk), a prefill's (chunked, or broadcast from rank 0), and the page
// copies (copy-on-write) that go before them.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "decode_indexer/kernels/types.h"
#include "server/exec/collective.h"
#include "server/exec/rank.h"
#include "server/exec/step_io.h"
#include "server/exec/step_types.h"

namespace decode_indexer::exec {

// Writes keys into one pool of this rank's replica, in chunks of the staging size.
absl::Status InsertKeysOnRank(Rank& rank, int32_t pool, const std::vector<KeyWrite>& writes,
                              bool hadamard);

// InsertKeysOnRank for prefill with a device broadcast: rank 0 uploads each chunk of keys
// once and the collective broadcasts it (NVLink) into every rank's staging buffer, instead of
// one host copy per rank. Every rank calls it with the same writes.
absl::Status BroadcastInsertKeysOnRank(Rank& rank, int32_t pool,
                                       const std::vector<KeyWrite>& writes, bool hadamard,
                                       Collective& collective);

// Copies whole pages (src, dst) of one pool of this rank's replica, in stream order before
// whatever the rank issues next.
absl::Status CopyPagesOnRank(Rank& rank, int32_t pool,
                             std::span<const std::pair<int32_t, int32_t>> copies);

// Bytes of one key (values) and of its scale in a given input form.
int64_t KeyValueBytes(kernels::ElemType type, int32_t head_dim);
int64_t KeyScaleBytes(kernels::ElemType type, int32_t head_dim);

// The step's new keys (StepPlan::key_writes) into `pool` through the step's staging, unless
// `packed` holds them in the step's ring slot (then nothing: the kernel section inserts them,
// InsertPackedKeys); keys in device memory device to device, their staged copies queued on
// `checks` (launched before the staging is reused, the last run's left pending for the
// caller's Flush).
absl::Status InsertStepKeys(Rank& rank, Staging& staging, int32_t pool,
                            const std::vector<KeyWrite>& writes, bool hadamard,
                            const StepUploads& packed, DeviceChecks& checks);

// The keys `packed` holds in the step's ring slot (packed.keys) into `pool`, with the
// section's page-table edits (step_io.h kSectionEdits): launches only, their arguments fixed
// by the step's shape, for the kernel section (captured into its graph).
absl::Status InsertPackedKeys(Rank& rank, int32_t pool, bool hadamard, const StepUploads& packed);

}  // namespace decode_indexer::exec
