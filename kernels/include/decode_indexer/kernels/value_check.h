// Value checks of step inputs that live in device memory, where the edge cannot read them
// (q, q_scales, weights, new keys and their scales in a client's CUDA IPC buffer): the same
// rule the edge applies to host bytes (server/service/request_decode.cc), as one predicate for
// the CPU twin and the CUDA kernel. A bad element is a NaN or Inf in fp32 / bf16, a NaN code in
// FP8 e4m3 (S.1111.111; e4m3fn has no Inf) or a NaN scale in UE8M0 (0xFF); FP4 codes and
// integers are always finite. A check of fp32 scales (`positive`: FP8 keys' scales) also
// flags a value that is not > 0 (-0, +0, negatives), as the edge refuses a non-positive scale.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "absl/status/status.h"
#include "decode_indexer/kernels/types.h"

#if defined(__CUDACC__)
#define DI_HOST_DEVICE __host__ __device__
#else
#define DI_HOST_DEVICE
#endif

// The host scan's 16-byte compares (SSE2: every x86-64 CPU); other hosts take the portable loop.
#if defined(__SSE2__) && !defined(__CUDA_ARCH__)
#include <emmintrin.h>
#define DI_VALUE_CHECK_SSE2 1
#endif

namespace decode_indexer::kernels {

// Bytes one element of `type` takes in a checked tensor (FP4: two codes a byte, checked as
// bytes); 0 for a type with nothing to check.
DI_HOST_DEVICE constexpr int32_t CheckedElemBytes(ElemType type) {
  switch (type) {
    case ElemType::kF32:
      return 4;
    case ElemType::kBF16:
      return 2;
    case ElemType::kFp8E4M3:
    case ElemType::kUE8M0:
      return 1;
    default:
      return 0;
  }
}

// Whether the element with these bits (its CheckedElemBytes low bytes) is a NaN / Inf, or
// with `positive` (fp32 only) not > 0: the sign bit set or zero (on the bits, so a device that
// flushes denormals to zero judges them as the host does: positive).
DI_HOST_DEVICE constexpr bool IsBadValue(ElemType type, uint32_t bits, bool positive = false) {
  switch (type) {
    case ElemType::kF32:
      return (bits & 0x7F800000u) == 0x7F800000u ||
             (positive && ((bits & 0x80000000u) != 0 || bits == 0));
    case ElemType::kBF16:
      return (bits & 0x7F80u) == 0x7F80u;
    case ElemType::kFp8E4M3:
      return (bits & 0x7Fu) == 0x7Fu;
    case ElemType::kUE8M0:
      return (bits & 0xFFu) == 0xFFu;
    default:
      return false;
  }
}

// One tensor to check: `count` elements of `type` at `data` (the backend's memory). A bad
// element sets flag `bit` (one bit of a mask, naming the tensor: word ValueFlagWord(bit) of
// the flag words). `positive`: fp32 scales, whose values must be > 0.
struct ValueCheck {
  const void* data = nullptr;
  int64_t count = 0;
  ElemType type = ElemType::kFp8E4M3;
  uint32_t bit = 0;
  bool positive = false;
};

// The flags as words, one per bit of the mask: a check that finds a bad element writes 1 to
// its word with a plain store, so no atomic is needed and the words may lie in page-locked
// host memory the device writes through its mapping (Device::AllocateMapped), which the host
// then reads after the stream's Synchronize with no copy (and clears itself, with no launch).
inline constexpr int kValueFlagWords = 32;
DI_HOST_DEVICE constexpr int ValueFlagWord(uint32_t bit) {
  int w = 0;
  while (w < kValueFlagWords - 1 && ((bit >> w) & 1u) == 0) ++w;
  return w;
}
// The mask the words hold: bit w set where word w is not zero.
inline uint32_t ValueFlagsMask(const volatile uint32_t* words) {
  uint32_t mask = 0;
  for (int w = 0; w < kValueFlagWords; ++w) mask |= words[w] != 0 ? 1u << w : 0u;
  return mask;
}

// Up to kMaxChecks tensors (a step's device inputs: new keys and their scales, q, q_scales,
// weights); `flags` is kValueFlagWords uint32 words the backend's kernels can write (its
// memory, or mapped host memory), cleared by the call (kept with `accumulate`: a step's later
// checks add to earlier ones, or the caller cleared them), then word ValueFlagWord(bit) set
// to 1 for every tensor holding a bad element (ordered on the main stream: read them after a
// Synchronize).
struct ValueCheckArgs {
  static constexpr int kMaxChecks = 8;
  ValueCheck checks[kMaxChecks];
  int32_t num_checks = 0;
  uint32_t* flags = nullptr;
  bool accumulate = false;
};

// Whether any of `n` words of T at `data` matches (word & kMask) == kWant, or with
// kNonPositive (fp32 scales) has its sign bit set or is zero. Every q byte of every step is
// scanned (0.5 MiB at 64 rows of v32: by the edge for host inputs, by the host backends' check),
// so this must run at memory speed. On x86-64 it compares 16 bytes at a time with SSE2, four
// loads a step: ~7.5 us for 0.5 MiB of FP8 on the development machine, against ~37 us for the
// portable loop below at -O3 (256-byte chunks with a fixed-count branch-free inner loop, which
// the compiler vectorizes only partly: its 32-bit hit accumulator widens every byte). A caller
// that must name the element finds it with an exact loop after a hit.
template <typename T, T kMask, T kWant, bool kNonPositive = false>
bool AnyWordMatches(const void* data, size_t n) {
  static_assert(sizeof(T) == 1 || sizeof(T) == 2 || sizeof(T) == 4);
  static_assert(!kNonPositive || sizeof(T) == 4, "non-positive: fp32 words only");
  constexpr T kSign = static_cast<T>(T{1} << (8 * sizeof(T) - 1));
  const auto* bytes = static_cast<const char*>(data);
  auto bad = [](T word) {
    uint32_t hit = static_cast<uint32_t>((word & kMask) == kWant);
    if constexpr (kNonPositive) hit |= static_cast<uint32_t>((word & kSign) != 0 || word == 0);
    return hit;
  };
  uint32_t hit = 0;
  size_t i = 0;  // words scanned
#if defined(DI_VALUE_CHECK_SSE2)
  auto splat = [](T v) {
    if constexpr (sizeof(T) == 1) return _mm_set1_epi8(static_cast<char>(v));
    if constexpr (sizeof(T) == 2) return _mm_set1_epi16(static_cast<short>(v));
    if constexpr (sizeof(T) == 4) return _mm_set1_epi32(static_cast<int>(v));
  };
  const __m128i mask = splat(kMask);
  const __m128i want = splat(kWant);
  // All-ones in the lanes of bad words.
  auto bad16 = [&](const char* p) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i masked = _mm_and_si128(x, mask);
    __m128i m;
    if constexpr (sizeof(T) == 1) m = _mm_cmpeq_epi8(masked, want);
    if constexpr (sizeof(T) == 2) m = _mm_cmpeq_epi16(masked, want);
    if constexpr (sizeof(T) == 4) m = _mm_cmpeq_epi32(masked, want);
    // Sign bit set or zero: not > 0 as a signed word, i.e. < 1.
    if constexpr (kNonPositive) m = _mm_or_si128(m, _mm_cmplt_epi32(x, _mm_set1_epi32(1)));
    return m;
  };
  const size_t total = n * sizeof(T);
  size_t at = 0;  // bytes
  __m128i acc = _mm_setzero_si128();
  for (; at + 64 <= total; at += 64) {
    acc = _mm_or_si128(acc,
                       _mm_or_si128(_mm_or_si128(bad16(bytes + at), bad16(bytes + at + 16)),
                                    _mm_or_si128(bad16(bytes + at + 32), bad16(bytes + at + 48))));
  }
  for (; at + 16 <= total; at += 16) acc = _mm_or_si128(acc, bad16(bytes + at));
  hit = static_cast<uint32_t>(_mm_movemask_epi8(acc) != 0);
  i = at / sizeof(T);
#else
  constexpr size_t kChunk = 256 / sizeof(T);
  for (; i + kChunk <= n; i += kChunk) {
    T buf[kChunk];
    std::memcpy(buf, bytes + i * sizeof(T), sizeof(buf));
    for (size_t j = 0; j < kChunk; ++j) hit |= bad(buf[j]);
  }
#endif
  for (; i < n; ++i) {
    T word;
    std::memcpy(&word, bytes + i * sizeof(T), sizeof(T));
    hit |= bad(word);
  }
  return hit != 0;
}

// Whether `count` elements of `type` at `data` (host memory) hold a bad one (IsBadValue).
inline bool HostAnyBadValue(ElemType type, const void* data, int64_t count, bool positive) {
  const auto n = static_cast<size_t>(count);
  switch (type) {
    case ElemType::kF32:
      return positive ? AnyWordMatches<uint32_t, 0x7F800000u, 0x7F800000u, true>(data, n)
                      : AnyWordMatches<uint32_t, 0x7F800000u, 0x7F800000u>(data, n);
    case ElemType::kBF16:
      return AnyWordMatches<uint16_t, 0x7F80u, 0x7F80u>(data, n);
    case ElemType::kFp8E4M3:
      return AnyWordMatches<uint8_t, 0x7F, 0x7F>(data, n);
    case ElemType::kUE8M0:
      return AnyWordMatches<uint8_t, 0xFF, 0xFF>(data, n);
    default:
      return false;
  }
}

// The check on host memory: the CPU twin (cpu::CheckValues) and Backend's default. Inline, so
// that every library defining a Backend has it without a link dependency on the CPU backend.
inline absl::Status HostCheckValues(const ValueCheckArgs& args) {
  if (args.flags == nullptr || args.num_checks < 0 ||
      args.num_checks > ValueCheckArgs::kMaxChecks) {
    return absl::InvalidArgumentError("CheckValues: bad arguments");
  }
  for (int32_t c = 0; c < args.num_checks; ++c) {
    const ValueCheck& v = args.checks[c];
    if (CheckedElemBytes(v.type) == 0 || v.count <= 0) continue;
    if (v.data == nullptr) return absl::InvalidArgumentError("CheckValues: null tensor");
  }
  if (!args.accumulate) std::memset(args.flags, 0, kValueFlagWords * sizeof(uint32_t));
  for (int32_t c = 0; c < args.num_checks; ++c) {
    const ValueCheck& v = args.checks[c];
    if (CheckedElemBytes(v.type) == 0 || v.count <= 0 || v.bit == 0) continue;
    if (HostAnyBadValue(v.type, v.data, v.count, v.positive)) args.flags[ValueFlagWord(v.bit)] = 1;
  }
  return absl::OkStatus();
}

}  // namespace decode_indexer::kernels
