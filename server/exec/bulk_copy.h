// Large host copies on the step's critical path (q into page-locked staging, answers out of the
// readback space) split over a few helper threads. One thread's memcpy moves ~10-15 GB/s; a
// 64-row v32 step copies 0.5-1 MB each way, 35-125 us a step on the H200 machine's host
// (docs/results/step-host.md), where four threads share the work.
#pragma once

#include <cstddef>

namespace decode_indexer::exec {

// memcpy(dst, src, bytes) for non-overlapping buffers. At kBulkCopyMin bytes and up the copy is
// split into page-aligned chunks: the caller copies one, idle helpers the others (spinning a
// short while after each copy so the next step's copies find them awake, then sleeping). When
// the helpers are busy with another caller's copy, the caller copies alone.
void BulkCopy(void* dst, const void* src, size_t bytes);

inline constexpr size_t kBulkCopyMin = size_t{256} << 10;

// Helper threads (default: DI_BULK_COPY_HELPERS if set, else hardware threads / 4, at most 3;
// 0: every copy is a plain memcpy).
// Call before the first copy, or between copies (tests and benchmarks).
void SetBulkCopyHelpers(int helpers);
int BulkCopyHelpers();

}  // namespace decode_indexer::exec
