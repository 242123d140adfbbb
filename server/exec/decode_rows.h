// decode_rows (seed): what one rank does with a planned step, in the seed's order: upload ->
// insert keys -> rope_quant_q -> score (decode_schedule.h) -> [all-gather] -> answer. The
// planner (planner.h) builds the plan on the host, having checked it against the sequence
// table and reserved its pages; every rank runs the same plan. A prefill's keys go in through
// insert_keys.h.
#pragma once

#include "absl/status/status.h"
#include "server/exec/collective.h"
#include "server/exec/rank.h"
#include "server/exec/step_types.h"

namespace decode_indexer::exec {

// Runs the step on one rank. Every rank runs it, and every rank calls the same collectives
// whatever fails locally, so that none waits forever.
absl::Status DecodeRowsOnRank(Rank& rank, const StepPlan& plan, Collective& collective);

}  // namespace decode_indexer::exec
