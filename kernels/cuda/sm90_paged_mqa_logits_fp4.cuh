// The FP4 tensor-core paged MQA logits kernel, as a template of its shape choices, and its
// launcher: sm90_paged_mqa_logits_fp4.cu instantiates the production choices (sm90_heuristics.h;
// reached through LaunchPagedMqaLogits, kFp4DenseWgmma), bench/cuda/variants/ others to time
// beside it. The kernel: dense logits of MXFP4 caches with 32 heads (the v41 profile's dense and
// candidate-source layers) on the fp8 kernel's structure (sm90_paged_mqa_logits_fp8.cuh): a
// persistent grid over the step's key tiles, one request's run at a time; a producer lane that
// fills a ring of page slots with one bulk copy a page (the whole 4352-byte page: 64 keys x 64
// bytes of e2m1 codes, then their 4 ue8m0 group scales each); one consumer warpgroup that scores
// each page against the pass's rows with fp8 wgmma, the keys widened into A in registers and q
// in shared memory.
//
// Why: before it, these layers ran the sparse consumer's mma.sync kernel over the dense rows
// (f16 widening, cp.async a lane; sm90_sparse_logits_mma.cuh), ~3x their key-byte floor.
// Hopper has no FP4 tensor-core path, but every e2m1 value is an e4m3 value, so:
// - each consumer thread widens its own A fragments from the ring slot in registers (per 32-dim
//   scale group one 4-byte load a key: 8 codes, 4 to a register, two prmt lookups each), and
//   the wgmmas take A from registers: no widened copy in shared memory, no barrier a page
//   (widening into a shared-memory tile for SS wgmmas, tried first, needed a proxy fence and a
//   warpgroup barrier a page and measured 0.8x this kernel's speed at 64 x 32K next_n 1, H100);
// - the fragment's 32 k columns hold the group's dims in the order the 4-byte loads give them
//   (a thread's low 4 columns its word's first 4 dims, its high 4 columns the next 4), and q's
//   tile in shared memory holds each group's dims in the same order (FillPass), widened once
//   per request pass, with the row's per-group q scales folded in where that is exact (below);
// - each 32-dim scale group is one m64n32k32 (B = one row's 32 heads) into its own accumulators
//   (accumulate = 0), so every (key, head, group) dot comes out of the tensor core on its own.
//
// Numerics: exact group dots, then the sparse kernel's (kMma's) arithmetic in kMma's order, so
// the logits are kMma's bit for bit (gpu_test checks; the CPU's within the exact tolerance).
// A group dot of e2m1 values is a sum of 32 products that are multiples of 2^-2 below 2^6: the
// fp8 tensor core's alignment to the largest product keeps them all (~13 fraction bits, docs/
// spec.md section 6), so each accumulator is the exact dot. With q folded (every group scale
// of every head of the row within 2^8 of the head's largest, 2^A; the folded codes e2m1 x
// 2^-(A - a_g) are then exact e4m3, subnormals included, and w' = w x 2^A stays a normal float),
// an accumulator is the exact dot times 2^(a_g - A). Then per key and head: the group dots times
// k_scale[g] (folded) or times q_scale[h, g] x k_scale[g] (not), summed over the groups
// ascending by FMA; relu, times w (or w'), summed over this lane's 8 heads in head order; the 4
// lanes of a group complete the 32-head sum in kMma's order (Fp8ReduceScatter1: (P0 + P1) +
// (P2 + P3)). Each step is kMma's value times a power of two (its keys carry 2^-14, its folded q
// 2^(a_g - A)), so no step rounds differently. Every logit is computed by the same lanes in the
// same order wherever its page sits in the schedule: bit-identical across runs, grids and batch
// compositions.
#pragma once

#include <cuda.h>
#include <cuda_fp8.h>

#include "absl/status/status.h"
#include "kernels/cuda/sm90_launch_setup.cuh"
#include "kernels/cuda/sm90_launchers.h"
#include "kernels/cuda/sm90_paged_mqa_logits_fp8.cuh"
#include "kernels/cuda/sm90_sparse_logits_mma.cuh"

namespace decode_indexer::kernels::cuda {
namespace fp4_logits {

constexpr int kHeads = 32;
constexpr int kGroups = kMqaHeadDim / 32;                       // MXFP4 scale groups
constexpr int kKeyCodeBytes = kMqaHeadDim / 2;                  // 64
constexpr int kPageValueBytes = kMqaTileKeys * kKeyCodeBytes;   // 4096
constexpr int kPageBytes = kPageValueBytes + kMqaTileKeys * 4;  // 4352
constexpr int kQRowBytes = kHeads * kMqaHeadDim;                // a row's q widened: 4096
constexpr int kRowParams = kHeads + kGroups * kHeads;           // weights, then q scales
constexpr int kConsumerThreads = kPipeConsumerThreads;
constexpr int kThreads = kPipeThreads;
constexpr int kConsumerWarps = kPipeConsumerWarps;
constexpr int kQBarrier = kPipeQBarrier;

static_assert(kPageBytes % 16 == 0 && kQRowBytes % 1024 == 0);

// Shared memory: [rows] q tiles | [stages] page slots | [rows] weights and q scales | [rows]
// fold flags (16 B) | barriers | the own schedule.
template <int kRows, bool kOwnSchedule, int kStages>
constexpr int SmemBytes() {
  return kRows * kQRowBytes + kStages * kPageBytes + kRows * kRowParams * 4 + 16 + 2 * kStages * 8 +
         (kOwnSchedule ? kOwnScheduleBytes : 0) + 1024;
}

// Where head h's weight (and each group's q scale) sits among a row's 32: lane c of a group
// reads heads 8 j + 2 c + e (j < 4, e < 2), the heads of its wgmma accumulators, as 8
// contiguous floats, k = 2 j + e.
__device__ __forceinline__ int HeadSlot(int head) {
  return ((head & 7) >> 1) * 8 + (head >> 3) * 2 + (head & 1);
}

// prmt.b32 in its default mode: byte i of the result is byte (s_i & 7) of {b, a} (a lowest),
// or that byte's sign bit replicated when s_i has bit 3 set (s_i: nibble i of s).
__device__ __forceinline__ uint32_t Prmt(uint32_t a, uint32_t b, uint32_t s) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(s));
  return d;
}

// Four e2m1 codes (the low 16 bits of h, the first in the lowest nibble) as four e4m3 bytes,
// the first lowest: exact. The magnitude through a lookup of its 3 bits (0, .5, 1, 1.5, 2, 3,
// 4, 6 are e4m3 0x00, 0x30, 0x38, 0x3C, 0x40, 0x44, 0x48, 0x4C); the sign through prmt's sign
// mode on bytes 0x80: 0x80 where the code is positive, 0xFF (0x80's sign replicated) where
// negative, so bit 6 of each byte, moved to bit 7, is the code's sign.
// (kSignSplit below needs only the lookup: a code with its sign bit set selects in sign mode,
// and every table byte is positive, so it reads 0x00.)
constexpr uint32_t kE2M1MagLo = 0x3C383000u;  // e4m3 of 0, .5, 1, 1.5
constexpr uint32_t kE2M1MagHi = 0x4C484440u;  // 2, 3, 4, 6
__device__ __forceinline__ uint32_t E2M1x4ToE4M3(uint32_t h) {
  const uint32_t mag = Prmt(kE2M1MagLo, kE2M1MagHi, h & 0x7777u);
  const uint32_t sgn = Prmt(0x80808080u, 0x80808080u, h);
  return mag | ((sgn << 1) & 0x80808080u);
}

// Sixteen e4m3 codes, each times 2^-d (0 <= d <= 8): exact (every such value of an e2m1 code is
// an e4m3 normal or subnormal), through fp32.
__device__ __forceinline__ uint4 ScaleE4M3x16(uint4 v, int d) {
  const float m = __uint_as_float(static_cast<uint32_t>(127 - d) << 23);
  uint32_t* words = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    uint32_t out = 0;
#pragma unroll
    for (int b = 0; b < 4; b += 2) {
      const __nv_fp8x2_storage_t pair = static_cast<__nv_fp8x2_storage_t>(words[k] >> (8 * b));
      const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
      const __nv_fp8x2_storage_t r =
          __nv_cvt_float2_to_fp8x2(make_float2(f.x * m, f.y * m), __NV_SATFINITE, __NV_E4M3);
      out |= static_cast<uint32_t>(r) << (8 * b);
    }
    words[k] = out;
  }
  return v;
}

// The pass's rows' parameters and q (consumer threads, between two kQBarrier syncs; the caller
// fences the q tiles for the async proxy). Thread tid < 32 kRows takes head tid % 32 of pass row
// tid / 32: its weight, its 4 group scales and whether the row folds (every head of it: a warp
// vote, the warp being the row); rows past the request's last get zero weights and q. Then all
// consumer threads widen q into the row tiles (SW128: head n's 128 bytes, 16-byte chunk o at
// o ^ (n & 7)), folded rows' groups times 2^(a_g - A).
template <int kRows>
__device__ __forceinline__ void FillPass(const PagedLogitsArgs& p, uint8_t* q_tile, float* params,
                                         int* fold_s, int tid, int pass, int first_row, int nrows) {
  if (tid < 32 * kRows) {
    const int rr = tid >> 5, head = tid & 31;
    const int rin = pass * kRows + rr;
    float* w_s = params + rr * kRowParams;
    float* qs_s = w_s + kHeads;
    const int slot = HeadSlot(head);
    bool ok = true;
    float w = 0.f;
    uint32_t sc = 0;
    if (rin < nrows) {
      const int64_t rh = int64_t{first_row + rin} * kHeads + head;
      w = __ldg(&p.q.weights[rh]);
      sc = __ldg(reinterpret_cast<const uint32_t*>(p.q.scales) + rh);
    }
    uint32_t top = 1;
#pragma unroll
    for (int grp = 0; grp < kGroups; ++grp) top = max(top, (sc >> (8 * grp)) & 0xFFu);
#pragma unroll
    for (int grp = 0; grp < kGroups; ++grp) {
      const uint32_t b = (sc >> (8 * grp)) & 0xFFu;
      ok = ok && b >= 1u && b <= 254u && top - b <= 8u;
      qs_s[grp * kHeads + slot] = rin < nrows ? sparse_mma::Ue8m0(b) : 0.f;
    }
    const float wf = w * __uint_as_float(min(top, 254u) << 23);
    ok = ok && isfinite(wf) && (w == 0.f || fabsf(wf) >= 1.17549435e-38f);
    const bool fold = rin >= nrows || __all_sync(kFullMask, ok);
    w_s[slot] = fold && rin < nrows ? wf : w;
    if (head == 0) fold_s[rr] = fold ? 1 : 0;
  }
  NamedBarrierSync(kQBarrier, kConsumerThreads);  // fold flags and scales for the widening
  // One item: a row's head's 32-dim group (16 bytes of codes in, two 16-byte chunks of the SW128
  // row out), its 8 e4m3 words in the A fragments' column order: dims word u (dims 4 u .. 4 u +
  // 3 of the group) at column word u / 2 + 4 (u % 2).
  constexpr int kItems = kRows * kHeads * kGroups;
#pragma unroll 1
  for (int it = tid; it < kItems; it += kConsumerThreads) {
    const int rr = it / (kHeads * kGroups), head = (it / kGroups) % kHeads, grp = it % kGroups;
    const int rin = pass * kRows + rr;
    uint4 lo = make_uint4(0u, 0u, 0u, 0u), hi = lo;
    if (rin < nrows) {
      const int64_t rh = int64_t{first_row + rin} * kHeads + head;
      const uint4 codes =
          __ldg(reinterpret_cast<const uint4*>(p.q.codes + rh * kKeyCodeBytes) + grp);
      const uint32_t x[4] = {codes.x, codes.y, codes.z, codes.w};
      uint32_t wd[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) wd[u] = E2M1x4ToE4M3(x[u / 2] >> (16 * (u % 2)));
      lo = make_uint4(wd[0], wd[2], wd[4], wd[6]);
      hi = make_uint4(wd[1], wd[3], wd[5], wd[7]);
      if (fold_s[rr] != 0) {
        const uint32_t sc = __ldg(reinterpret_cast<const uint32_t*>(p.q.scales) + rh);
        uint32_t top = 0;
#pragma unroll
        for (int g = 0; g < kGroups; ++g) top = max(top, (sc >> (8 * g)) & 0xFFu);
        const uint32_t b = (sc >> (8 * grp)) & 0xFFu;
        if (top != b) {
          lo = ScaleE4M3x16(lo, static_cast<int>(top - b));
          hi = ScaleE4M3x16(hi, static_cast<int>(top - b));
        }
      }
    }
    const int n = rr * kHeads + head;  // B row of the pass's tiles
    uint8_t* row = q_tile + n * 128;
    *reinterpret_cast<uint4*>(row + (((2 * grp) ^ (n & 7)) << 4)) = lo;
    *reinterpret_cast<uint4*>(row + (((2 * grp + 1) ^ (n & 7)) << 4)) = hi;
  }
}

// kRows: rows of a request per pass (RowsPerPass); kMinBlocks, kStages: blocks per SM the
// register cap is sized for, ring slots; kGroupRounds: the 4 group wgmmas of a row in 1 round
// (64 accumulators live) or 2 (32: fewer registers, a second wait); kSignSplit: each group's
// A as two fragments, the positive codes' magnitudes and the negative codes' (one prmt lookup
// per 4 codes each), the second wgmma subtracting its products (scale-a -1), instead of one
// fragment with the signs (E2M1x4ToE4M3: five instructions per 4 codes). The group dot stays
// exact: the first wgmma's exact partial (a multiple of 2^-2 below 2^11) and the second's
// products align within the tensor core's ~13 fraction bits. The production choices are
// sm90_heuristics.h's PipeFp4MinBlocks, kPipeFp4Stages, PipeFp4GroupRounds, kPipeFp4SignSplit;
// every choice gives the same logits bit for bit (gpu_variants_test).
template <int kRows, bool kOwnSchedule, int kMinBlocks, int kStages, int kGroupRounds,
          bool kSignSplit>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    PagedMqaLogitsFp4Kernel(const PagedLogitsArgs p) {
  static_assert(kGroupRounds == 1 || kGroupRounds == 2);
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = AlignSmem1024(smem_raw);
  uint8_t* q_tile = smem;                        // [rows][32 heads][128 B] e4m3, SW128
  uint8_t* slots = q_tile + kRows * kQRowBytes;  // [stages][4352 B] pages as they are
  float* params = reinterpret_cast<float*>(slots + kStages * kPageBytes);  // [rows][160]
  int* fold_s = reinterpret_cast<int*>(params + kRows * kRowParams);       // [rows], 16 B
  uint64_t* full = reinterpret_cast<uint64_t*>(fold_s + 4);
  uint64_t* empty = full + kStages;
  int32_t* own = reinterpret_cast<int32_t*>(empty + kStages);
  static_assert(kRows <= 4, "fold flags: 16 bytes");

  const int tid = threadIdx.x;
  const int warp = __shfl_sync(kFullMask, tid >> 5, 0);  // warp-uniform to the compiler
  const int lane = tid & 31;
  if (tid == 0) {
    const PageRing<kStages> ring{nullptr, nullptr, full, empty};
    ring.InitBarriers(1, kConsumerThreads);
  }
  BlockSchedule<kOwnSchedule> sched;
  sched.template SetUp<kThreads>(p, own, tid);
  if (sched.num_tiles == 0) return;

  if (warp == kConsumerWarps) {
    if (lane == 0) {
      const uint8_t* __restrict__ cache = p.cache.base;
      fp8_logits::WalkRunPages<kRows>(p, sched, [&](int i, int page) {
        const int st = i % kStages;
        if (i >= kStages) MbarWait(&empty[st], ((i / kStages) + 1) & 1);
        MbarArriveExpectTx(&full[st], kPageBytes);
        BulkLoad(slots + st * kPageBytes, cache + int64_t{page} * kPageBytes, kPageBytes,
                 &full[st]);
      });
    }
    return;
  }

  // ---- Consumer warpgroup. ----
  const int g = lane >> 2;
  const int c = lane & 3;
  const int key0 = warp * 16 + g;       // this thread's accumulator keys: key0 and key0 + 8
  const int kkey = key0 + 8 * (c & 1);  // the one this lane stores (Fp8ReduceScatter1)
  const int64_t stride = p.logits_stride;
  int len_r[kRows];
  float* out_r[kRows];
  bool fold_r[kRows];
  auto load_pass = [&](int b, int pass) {
    NamedBarrierSync(kQBarrier, kConsumerThreads);  // every warp's wgmmas on the old q are done
    const int first_row = Ld<kOwnSchedule>(&sched.first_row[b]);
    const int nrows = Ld<kOwnSchedule>(&sched.num_rows[b]);
    FillPass<kRows>(p, q_tile, params, fold_s, tid, pass, first_row, nrows);
#pragma unroll
    for (int rr = 0; rr < kRows; ++rr) {
      const int rin = pass * kRows + rr;
      const bool valid = rin < nrows;
      len_r[rr] = valid ? __ldg(&p.rows.row_length[first_row + rin]) : 0;
      out_r[rr] = p.logits + (valid ? int64_t{first_row + rin} * stride : 0) + kkey;
      fold_r[rr] = fold_s[rr] != 0;
    }
    FenceProxyAsyncShared();  // st.shared of q before the wgmmas' (async proxy) reads
    NamedBarrierSync(kQBarrier, kConsumerThreads);
  };

  const uint32_t desc_q = __shfl_sync(kFullMask, fp8_logits::Sw128DescLo(q_tile), 0);
  int st = 0;
  uint32_t phase = 0;

  // One page (ring slot st, the request's tile at base_pos) against the pass's rows, its
  // logits stored, the slot released.
  auto score_page = [&](int base_pos) {
    const uint8_t* slot = slots + st * kPageBytes;
    // This thread's A fragments of the 4 groups: keys key0 and key0 + 8, each group's word c
    // (kSignSplit: [grp][0] the positive codes' magnitudes, [grp][1] the negative codes').
    constexpr int kParts = kSignSplit ? 2 : 1;
    uint32_t a[kGroups][kParts][4];
    {
      const uint8_t* k0 = slot + key0 * kKeyCodeBytes + 4 * c;
#pragma unroll
      for (int grp = 0; grp < kGroups; ++grp) {
        const uint32_t x0 = *reinterpret_cast<const uint32_t*>(k0 + 16 * grp);
        const uint32_t x1 = *reinterpret_cast<const uint32_t*>(k0 + 8 * kKeyCodeBytes + 16 * grp);
        if constexpr (kSignSplit) {
          const uint32_t n0 = x0 ^ 0x88888888u, n1 = x1 ^ 0x88888888u;  // signs flipped
          a[grp][0][0] = Prmt(kE2M1MagLo, kE2M1MagHi, x0);
          a[grp][0][1] = Prmt(kE2M1MagLo, kE2M1MagHi, x1);
          a[grp][0][2] = Prmt(kE2M1MagLo, kE2M1MagHi, x0 >> 16);
          a[grp][0][3] = Prmt(kE2M1MagLo, kE2M1MagHi, x1 >> 16);
          a[grp][1][0] = Prmt(kE2M1MagLo, kE2M1MagHi, n0);
          a[grp][1][1] = Prmt(kE2M1MagLo, kE2M1MagHi, n1);
          a[grp][1][2] = Prmt(kE2M1MagLo, kE2M1MagHi, n0 >> 16);
          a[grp][1][3] = Prmt(kE2M1MagLo, kE2M1MagHi, n1 >> 16);
        } else {
          a[grp][0][0] = E2M1x4ToE4M3(x0);
          a[grp][0][1] = E2M1x4ToE4M3(x1);
          a[grp][0][2] = E2M1x4ToE4M3(x0 >> 16);
          a[grp][0][3] = E2M1x4ToE4M3(x1 >> 16);
        }
      }
    }
    // The keys' group scales (the slot's scale words of key0 and key0 + 8).
    const uint32_t sc0 = reinterpret_cast<const uint32_t*>(slot + kPageValueBytes)[key0];
    const uint32_t sc1 = reinterpret_cast<const uint32_t*>(slot + kPageValueBytes)[key0 + 8];
    float ks0[kGroups], ks1[kGroups];
    ks0[0] = sparse_mma::Ue8m0Of<0>(sc0), ks0[1] = sparse_mma::Ue8m0Of<1>(sc0);
    ks0[2] = sparse_mma::Ue8m0Of<2>(sc0), ks0[3] = sparse_mma::Ue8m0Of<3>(sc0);
    ks1[0] = sparse_mma::Ue8m0Of<0>(sc1), ks1[1] = sparse_mma::Ue8m0Of<1>(sc1);
    ks1[2] = sparse_mma::Ue8m0Of<2>(sc1), ks1[3] = sparse_mma::Ue8m0Of<3>(sc1);
    const int pos = base_pos + kkey;
#pragma unroll
    for (int rr = 0; rr < kRows; ++rr) {
      // Every row is issued, even past the request's last (nothing is stored then): a branch
      // around a wgmma makes ptxas serialize every wgmma in the kernel.
      // Per head (this lane's 8: 8 j + 2 c + e) and key: the group dots scaled and summed
      // ascending (tot[j][e]: key0, tot[j][2 + e]: key0 + 8), kMma's group_sums.
      const float* w_s = params + rr * kRowParams;
      float tot[4][4];
#pragma unroll
      for (int j = 0; j < 4; ++j) tot[j][0] = tot[j][1] = tot[j][2] = tot[j][3] = 0.f;
      constexpr int kPerRound = kGroups / kGroupRounds;
#pragma unroll
      for (int round = 0; round < kGroupRounds; ++round) {
        float acc[kPerRound][16];
        WgmmaFence();
#pragma unroll
        for (int gi = 0; gi < kPerRound; ++gi) {
          const int grp = round * kPerRound + gi;
          const uint64_t desc_b = fp8_logits::Sw128Desc(desc_q + rr * (kQRowBytes / 16) + 2 * grp);
          WgmmaM64N32K32E4M3RS(acc[gi], a[grp][0], desc_b, 0);
          if constexpr (kSignSplit) WgmmaM64N32K32E4M3RS<-1>(acc[gi], a[grp][1], desc_b, 1);
        }
        WgmmaCommit();
        WgmmaWait<0>();
        if (fold_r[rr]) {
#pragma unroll
          for (int gi = 0; gi < kPerRound; ++gi) {
            const int grp = round * kPerRound + gi;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              tot[j][0] = fmaf(acc[gi][4 * j], ks0[grp], tot[j][0]);
              tot[j][1] = fmaf(acc[gi][4 * j + 1], ks0[grp], tot[j][1]);
              tot[j][2] = fmaf(acc[gi][4 * j + 2], ks1[grp], tot[j][2]);
              tot[j][3] = fmaf(acc[gi][4 * j + 3], ks1[grp], tot[j][3]);
            }
          }
        } else {
#pragma unroll
          for (int gi = 0; gi < kPerRound; ++gi) {
            const int grp = round * kPerRound + gi;
            const float4* qs4 =
                reinterpret_cast<const float4*>(w_s + kHeads + grp * kHeads + 8 * c);
            const float4 qa = qs4[0], qb = qs4[1];
            const float qs[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              tot[j][0] = fmaf(acc[gi][4 * j], qs[2 * j] * ks0[grp], tot[j][0]);
              tot[j][1] = fmaf(acc[gi][4 * j + 1], qs[2 * j + 1] * ks0[grp], tot[j][1]);
              tot[j][2] = fmaf(acc[gi][4 * j + 2], qs[2 * j] * ks1[grp], tot[j][2]);
              tot[j][3] = fmaf(acc[gi][4 * j + 3], qs[2 * j + 1] * ks1[grp], tot[j][3]);
            }
          }
        }
      }
      // relu, times the weight, summed over this lane's heads in head order (kMma's
      // AddWeightedHeads), then the group's 4 lanes (Fp8ReduceScatter1).
      const float4* w4 = reinterpret_cast<const float4*>(w_s + 8 * c);
      const float4 wa = w4[0], wb = w4[1];
      const float w[8] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
      float part[2] = {0.f, 0.f};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          part[0] = fmaf(w[2 * j + e], fmaxf(tot[j][e], 0.f), part[0]);
          part[1] = fmaf(w[2 * j + e], fmaxf(tot[j][2 + e], 0.f), part[1]);
        }
      }
      const float sum = fp8_logits::Fp8ReduceScatter1(part, c);
      if (pos < len_r[rr]) out_r[rr][base_pos] = sum;
    }
    // The slot's codes were widened and its scales used above: hand it back.
    MbarArrive(&empty[st]);
  };

  int tile = sched.begin;
  const int end_tile = sched.begin + sched.num_tiles;
  ScheduleCursor<kOwnSchedule> seek;
  seek.Seek(sched.prefix, sched.num_requests, tile);
  int b = seek.request;
  int pass = 0;
  while (tile < end_tile) {
    const int tile0 = Ld<kOwnSchedule>(&sched.prefix[b]);
    const int run_end = min(end_tile, Ld<kOwnSchedule>(&sched.prefix[b + 1]));
    if (tile >= run_end) {  // no tiles of request b here
      ++b;
      continue;
    }
    load_pass(b, pass);
    const int run_begin = tile;
    for (int base_pos = (tile - tile0) * kMqaTileKeys; tile < run_end;
         ++tile, base_pos += kMqaTileKeys) {
      // The bulk copy wrote the slot through the async proxy; the phase orders the loads.
      MbarWait(&full[st], phase);
      score_page(base_pos);
      if (++st == kStages) {
        st = 0;
        phase ^= 1;
      }
    }
    if (++pass < fp8_logits::RunPasses<kRows>(Ld<kOwnSchedule>(&sched.num_rows[b]))) {
      tile = run_begin;  // the run again, for the request's next rows
    } else {
      pass = 0;
      ++b;
    }
  }
}

// One instantiation's launch on a persistent grid (its blocks per SM from the occupancy query).
template <int kRows, bool kOwnSchedule, int kMinBlocks, int kStages, int kGroupRounds,
          bool kSignSplit>
absl::Status Launch(const PagedLogitsArgs& args, int num_sms, cudaStream_t stream) {
  static KernelDeviceSetup per_device[kMaxDevices];
  return LaunchPersistentGrid(
      per_device, "paged mqa logits (fp4)",
      PagedMqaLogitsFp4Kernel<kRows, kOwnSchedule, kMinBlocks, kStages, kGroupRounds, kSignSplit>,
      kThreads, SmemBytes<kRows, kOwnSchedule, kStages>(), num_sms, stream, args);
}

// Whether `args` is a shape the kernel takes (PagedMqaLogitsFp4Takes).
inline bool Takes(const PagedLogitsArgs& args) {
  const CacheGeometry& geo = args.cache.geometry;
  return geo.format == CacheFormat::kFp4 && geo.page_size == kMqaTileKeys &&
         geo.head_dim == kMqaHeadDim && geo.page_bytes() == kPageBytes &&
         args.q.num_heads == kHeads && args.q.scales != nullptr && args.cache.base != nullptr &&
         reinterpret_cast<uintptr_t>(args.cache.base) % 16 == 0;
}

}  // namespace fp4_logits
}  // namespace decode_indexer::kernels::cuda
