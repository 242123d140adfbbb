// The rank side of a step: what one rank does with a planned step (decode_rows in the seed)
// and with an append of prefill keys. The executor builds the plan on the host, having checked
// it against the sequence table and reserved its pages; every rank runs the same plan.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "decode_indexer/kernels/types.h"
#include "server/config/profile.h"
#include "server/exec/collective.h"
#include "server/exec/executor.h"
#include "server/exec/page_table_mirror.h"
#include "server/exec/rank.h"
#include "server/exec/step_types.h"

namespace decode_indexer::exec {

// Runs the step on one rank. Every rank runs it, and every rank calls the same collectives
// whatever fails locally, so that none waits forever.
absl::Status DecodeRowsOnRank(Rank& rank, const StepPlan& plan, Collective& collective);

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

}  // namespace decode_indexer::exec
