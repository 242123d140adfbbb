// Device code shared by the keys-as-M paged MQA logits kernels (the exact production kernel,
// sm90_paged_mqa_logits_pipelined.cu; the producer / ring of the fp8 one; and the comparison
// variants under bench/cuda/variants/: keys-M, the warp-specialized Ws2 / Ws4): the e4m3 ->
// f16 widening helpers, the permuted q-tile layout, the schedule cursor and the in-block schedule.
//
// Why one copy: the pipelined kernel promises keys-M's logits bit for bit, which holds only while
// they widen, lay out q and walk the schedule exactly as keys-M does; sharing the code keeps them
// from drifting apart. Everything here is __forceinline__, so each kernel compiles as before.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "kernels/cuda/sm90_device_utils.cuh"
#include "kernels/cuda/sm90_heuristics.h"
#include "kernels/cuda/sm90_launchers.h"
#include "kernels/cuda/sm90_tile_config.h"

namespace decode_indexer::kernels::cuda {

// The in-kernel schedule (the pipelined kernels, keys-M fused): first_row, num_rows, max_len
// [max requests], prefix [+1], scratch (kOwnScheduleMaxRequests: sm90_heuristics.h).
inline constexpr int kOwnScheduleBytes = (4 * kOwnScheduleMaxRequests + 1 + 32) * 4;

// 64 dims of a 64-head row's q in f16: one 128B-swizzled tile.
inline constexpr int kKeysMQHalfBytes = 64 * 128;

// Widen (sm90_tile_config.h): which k-steps take the bit move.
__host__ __device__ constexpr bool BitMoveStep(int widen, int ks) {
  return widen == kWidenBitMove || (widen == kWidenSplit && ((ks >> 1) & 1));
}

// e4m3 code -> f16 bits of its value times 2^-8 (exact: see sm90_paged_mqa_logits_keys_m.cu).
__device__ __forceinline__ uint32_t E4M3ToF16BitsScaled(uint32_t b) {
  return ((b & 0x80u) << 8) | ((b & 0x7Fu) << 7);
}
// Four e4m3 codes b0..b3 (b0 lowest) -> f16x2 (b0, b2) and (b1, b3), each value times 2^-8.
__device__ __forceinline__ void E4M3x4ToF16x2ScaledBitMove(uint32_t q, uint32_t& even,
                                                           uint32_t& odd) {
  odd = (q & 0x80008000u) | ((q >> 1) & 0x3F803F80u);
  const uint32_t q8 = q << 8;
  even = (q8 & 0x80008000u) | ((q8 >> 1) & 0x3F803F80u);
}

// A schedule entry: read-only global loads for the schedule kernel's output, plain loads where
// the block built it in shared memory.
template <bool kShared>
__device__ __forceinline__ int32_t Ld(const int32_t* v) {
  if constexpr (kShared) {
    return *v;
  } else {
    return __ldg(v);
  }
}

// TileCursor over a schedule that may live in shared memory: walks the tiles in order.
template <bool kShared>
struct ScheduleCursor {
  int tile, request, request_end;
  __device__ __forceinline__ void Seek(const int32_t* prefix, int num_requests, int t) {
    int lo = 0, hi = num_requests - 1;  // the last b with prefix[b] <= t
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (Ld<kShared>(&prefix[mid]) <= t) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    tile = t;
    request = lo;
    request_end = Ld<kShared>(&prefix[lo + 1]);
  }
  __device__ __forceinline__ void Next(const int32_t* prefix) {
    ++tile;
    while (tile >= request_end) {
      ++request;
      request_end = Ld<kShared>(&prefix[request + 1]);
    }
  }
};

// Byte offset of q[head][dim] (f16) inside a row's q tile: half dim / 64, 128-byte row per
// head, k index permuted inside each 16-dim step (to match ldmatrix's fragments), 128B swizzle.
// The bit-move steps pair dims (4c, 4c + 2) and (4c + 1, 4c + 3) instead.
__device__ __forceinline__ int QOffset(int head, int dim, bool bit_move) {
  const int step = dim >> 4, p = dim & 15;
  const int e = p & 3;
  const int kk = bit_move ? ((e & 1) ? 8 : 0) + 2 * (p >> 2) + (e >> 1)
                 : e < 2  ? 2 * (p >> 2) + e
                          : 8 + 2 * (p >> 2) + e - 2;
  const int byte = ((step & 3) * 16 + kk) * 2;
  return (step >> 2) * kKeysMQHalfBytes + head * 128 + ((((byte >> 4) ^ (head & 7))) << 4) +
         (byte & 15);
}

// Four e4m3 codes of q (dims 4 quad .. 4 quad + 3 of one head) into the q tile.
template <int kWiden>
__device__ __forceinline__ void StoreQQuad(uint8_t* qt, int head, int quad, uint32_t codes) {
  if constexpr (kWiden == kWidenCvt) {
    *reinterpret_cast<uint32_t*>(qt + QOffset(head, 4 * quad, false)) = E4M3x2ToF16x2(codes);
    *reinterpret_cast<uint32_t*>(qt + QOffset(head, 4 * quad + 2, false)) =
        E4M3x2ToF16x2(codes >> 16);
  } else {
    // Bit-move steps: the keys carry the 2^-8, q is plain f16; cvt steps: q carries it.
    const bool bit_move = BitMoveStep(kWiden, (4 * quad) >> 4);
    const uint32_t lo = E4M3x2ToF16x2(codes), hi = E4M3x2ToF16x2(codes >> 16);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const uint32_t f16 = bit_move ? (((e < 2 ? lo : hi) >> (16 * (e & 1))) & 0xFFFFu)
                                    : E4M3ToF16BitsScaled((codes >> (8 * e)) & 0xFFu);
      *reinterpret_cast<uint16_t*>(qt + QOffset(head, 4 * quad + e, bit_move)) =
          static_cast<uint16_t>(f16);
    }
  }
}

// Keys g and g + 8 of a keys-M wgmma accumulator (acc[4 j + e] and acc[4 j + 2 + e]: heads
// 8 j + 2 c + e) through relu, times the head's weight `weight(j, e)`, summed over this lane's
// heads in keys-M's order; then the 4 lanes of the group complete the 64-head sum (each lane
// ends with it). Every keys-M variant's epilogue, so their logits stay bit for bit equal.
template <typename Weight>
__device__ __forceinline__ void KeysMHeadSums(const float (&acc)[32], Weight&& weight, float& s0,
                                              float& s1) {
  s0 = 0.f;
  s1 = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float wv = weight(j, e);
      s0 += wv * fmaxf(acc[4 * j + e], 0.f);
      s1 += wv * fmaxf(acc[4 * j + 2 + e], 0.f);
    }
  }
  s0 += __shfl_xor_sync(kFullMask, s0, 1);
  s1 += __shfl_xor_sync(kFullMask, s1, 1);
  s0 += __shfl_xor_sync(kFullMask, s0, 2);
  s1 += __shfl_xor_sync(kFullMask, s1, 2);
}

// k-steps 2 sp and 2 sp + 1 of this warp's 16 keys of the page in `kv` as f16 A fragments
// (lo, hi): one ldmatrix, then cvt or bit moves.
template <int kWiden>
__device__ __forceinline__ void WidenKSteps(const uint8_t* kv, int warp, int lane, int sp,
                                            uint32_t (&lo)[4], uint32_t (&hi)[4]) {
  uint32_t r[4];
  const int mi = lane >> 3;
  const int key = warp * 16 + (lane & 7) + 8 * (mi & 1);
  const int chunk = 2 * sp + (mi >> 1);
  LdMatrixX4(r, kv + key * 128 + ((chunk ^ (key & 7)) << 4));
  if (BitMoveStep(kWiden, 2 * sp)) {
    E4M3x4ToF16x2ScaledBitMove(r[0], lo[0], lo[2]);
    E4M3x4ToF16x2ScaledBitMove(r[1], lo[1], lo[3]);
    E4M3x4ToF16x2ScaledBitMove(r[2], hi[0], hi[2]);
    E4M3x4ToF16x2ScaledBitMove(r[3], hi[1], hi[3]);
    return;
  }
  lo[0] = E4M3x2ToF16x2(r[0]);
  lo[2] = E4M3x2ToF16x2(r[0] >> 16);
  lo[1] = E4M3x2ToF16x2(r[1]);
  lo[3] = E4M3x2ToF16x2(r[1] >> 16);
  hi[0] = E4M3x2ToF16x2(r[2]);
  hi[2] = E4M3x2ToF16x2(r[2] >> 16);
  hi[1] = E4M3x2ToF16x2(r[3]);
  hi[3] = E4M3x2ToF16x2(r[3] >> 16);
}

// This warp's 16 keys of the page in `kv` as f16 A fragments, 8 k-steps of 16 dims.
template <int kWiden>
__device__ __forceinline__ void WidenPage(const uint8_t* kv, int warp, int lane,
                                          uint32_t (&a)[8][4]) {
#pragma unroll
  for (int sp = 0; sp < 4; ++sp) WidenKSteps<kWiden>(kv, warp, lane, sp, a[2 * sp], a[2 * sp + 1]);
}

// A producer warp's cp.async copies of one page (64 keys: 8192 e4m3 codes, then 64 fp32 scales)
// into a ring slot: the codes swizzled (16-byte chunk col of key row at col ^ (row & 7): the
// 128B swizzle, conflict-free for ldmatrix and, with the slot 1024-byte aligned, wgmma's SW128
// K-major layout), then the scales; keys at or past `valid` are zero-filled. The pipelined
// kernels (sm90_paged_mqa_logits_pipelined.cu, sm90_paged_mqa_logits_fp8.cu) share it.
__device__ __forceinline__ void CopyPageToStage(const uint8_t* src, uint8_t* dv, uint8_t* ds,
                                                int valid, int lane) {
  constexpr int kValues = kMqaTileKeys * kMqaHeadDim;
  constexpr int kPageBytes = kValues + kMqaTileKeys * 4;
#pragma unroll
  for (int k0 = 0; k0 < (kPageBytes / 16 + 31) / 32; ++k0) {
    const int ch = k0 * 32 + lane;
    if (ch < kValues / 16) {
      const int row = ch >> 3, col = ch & 7;
      CpAsync16(dv + row * 128 + ((col ^ (row & 7)) << 4), src + ch * 16, row < valid);
    } else if (ch < kPageBytes / 16) {
      const int sc = ch - kValues / 16;
      CpAsync16(ds + sc * 16, src + kValues + sc * 16, sc * 4 < valid);
    }
  }
}

// The schedule kernel's work, per block in shared memory `own` (kOwnScheduleBytes; the launcher
// checks that num_requests <= kOwnScheduleMaxRequests), by all kBlockThreads threads. Same
// numbers as the schedule kernel: min / count / max are order-free. Points the four schedule
// pointers at the shared copy. The caller synchronises before reading it.
template <int kBlockThreads>
__device__ __forceinline__ void BuildOwnSchedule(const PagedLogitsArgs& p, int32_t* own, int tid,
                                                 int num_requests, const int32_t*& prefix,
                                                 const int32_t*& req_first_row,
                                                 const int32_t*& req_num_rows,
                                                 const int32_t*& req_max_len) {
  int32_t* first = own;
  int32_t* count = own + kOwnScheduleMaxRequests;
  int32_t* maxlen = own + 2 * kOwnScheduleMaxRequests;
  int32_t* pre = own + 3 * kOwnScheduleMaxRequests;
  uint32_t* scratch = reinterpret_cast<uint32_t*>(pre + kOwnScheduleMaxRequests + 1);
  for (int b = tid; b < num_requests; b += kBlockThreads) {
    first[b] = INT_MAX;
    count[b] = 0;
    maxlen[b] = 0;
  }
  __syncthreads();
  for (int r = tid; r < p.rows.num_rows; r += kBlockThreads) {
    const int b = __ldg(&p.rows.row_request[r]);
    atomicMin(&first[b], r);
    atomicAdd(&count[b], 1);
    atomicMax(&maxlen[b], __ldg(&p.rows.row_length[r]));
  }
  __syncthreads();
  const int per_thread = (num_requests + kBlockThreads - 1) / kBlockThreads;
  const int lo = min(num_requests, tid * per_thread);
  const int hi = min(num_requests, lo + per_thread);
  uint32_t local = 0;
  for (int b = lo; b < hi; ++b) local += (maxlen[b] + kMqaTileKeys - 1) / kMqaTileKeys;
  uint32_t total = 0;
  uint32_t run = BlockExclusiveScan(local, scratch, &total);
  for (int b = lo; b < hi; ++b) {
    pre[b] = static_cast<int32_t>(run);
    run += (maxlen[b] + kMqaTileKeys - 1) / kMqaTileKeys;
  }
  if (tid == 0) pre[num_requests] = static_cast<int32_t>(total);
  prefix = pre;
  req_first_row = first;
  req_num_rows = count;
  req_max_len = maxlen;
}

}  // namespace decode_indexer::kernels::cuda
