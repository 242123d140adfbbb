// Paged MQA logits for FP8 caches with 64 heads (the v32 dense layers) on SM90, keys as the
// MMA's M dimension: one warpgroup takes a whole 64-entry page as A (from registers) against
// a row's 64 heads of q as B (f16 in shared memory, written once per request).
//
// Why this shape: each warp then holds all 64 heads of its 16 keys, so the ReLU * weight *
// head-sum epilogue is 32 FMAs and 2 shuffle rounds per key pair, with no cross-warp
// reduction and one block barrier per page. The e4m3 codes are widened to f16 on the way from
// shared memory into registers (exact; ldmatrix + cvt), and the f16 tensor cores sum in full
// fp32, so the logits match the CPU reference to rounding (the fp8 wgmma path sums in reduced
// precision). The same tile walk as sm90_paged_mqa_logits.cu: a persistent grid over the
// device-computed schedule, cp.async pages kKeysMStages deep in the 128B swizzle.
//
// The MMA's k order inside each 16-dim step is permuted (ldmatrix hands each thread dims
// 4c..4c+3; the f16 A fragment wants pairs 2c and 2c + 8): q is written to shared memory with
// the same permutation, so the products pair the same dims.
//
// Variants (MqaMath, same math, bit-identical logits):
// - kWgmmaKeysMSplit: the widening cvt (F2FP, a 16/clk/SM pipe: 4096 of them per page, 256
//   cycles per page per SM, ~45% of the ~590-cycle budget a page has at 85% of copy
//   bandwidth) is done for half the k-steps with integer ops instead: the bits of an e4m3
//   code moved into an f16 ((b & 0x80) << 8 | (b & 0x7f) << 7) are exactly its value times
//   2^-8 (normals and subnormals alike). Those steps pair with q in plain f16, the cvt steps
//   with q times 2^-8 (the same bit move on q's codes), so every product is the true one
//   times 2^-8 and the fp32 sums are the cvt path's sums times 2^-8, exactly (power-of-two
//   scaling, far from fp32's range ends); the epilogue's key scale times 256 undoes it.
// - kWgmmaKeysMFused (the default): each block derives the schedule from the row table itself
//   (shared memory; up to kOwnScheduleMaxRequests requests), so the separate schedule launch
//   (a kernel boundary on the critical path of small steps) is not needed; split widening
//   where a page serves one row per pass (next_n 1), cvt otherwise (measured, see below).
// - kWgmmaKeysMBitMove: every k-step by the bit move (a measurement: one pipe alone).
//
// Threshold filter (optional, PagedLogitsArgs::row_histogram): the epilogue also counts the
// logits at positions that are multiples of kTopKSampleStride into their row's TopKBucket
// histogram: the radix top-k's sample, so the top-k need not read the row for it. Counts go to
// shared memory first (16-bit, two bins a word, one 2048-bin histogram per row of a pass: 4 KB
// each, which leaves the blocks per SM as they were) and are added to the global histogram when the
// block moves to another request (or every kHistFlushTiles tiles, before a 16-bit count could
// overflow). Counts are order-free, so the histogram is the same whatever the grid or the timing.
#include <algorithm>
#include <climits>
#include <mutex>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/sm90_device_utils.cuh"
#include "kernels/cuda/sm90_launchers.h"
#include "kernels/cuda/sm90_mqa_tiles.cuh"
#include "kernels/cuda/sm90_tile_config.h"
#include "kernels/cuda/sm90_topk_bucket.cuh"

namespace decode_indexer::kernels::cuda {
namespace {

constexpr int kHeads = 64;
constexpr int kThreads = 128;                        // one warpgroup
constexpr int kValues = kMqaTileKeys * kMqaHeadDim;  // 8192: a page's e4m3 codes
constexpr int kScales = kMqaTileKeys * 4;            // 256: its fp32 scales
constexpr int kPageBytes = kValues + kScales;        // 8448
constexpr int kQBytes = kHeads * kMqaHeadDim * 2;    // one row's q in f16: 16 KB
constexpr int kHalfBytes = kHeads * 128;             // 64 dims of q: one swizzled tile
constexpr int kOwnScheduleMaxRequests = 256;
// The in-kernel schedule: first_row, num_rows, max_len [max requests], prefix [+1], scratch.
constexpr int kOwnScheduleBytes = (4 * kOwnScheduleMaxRequests + 1 + 32) * 4;

// Threshold-filter histogram in shared memory: [rows per pass][kTopKBins / 2] words.
template <int kRowsPerPass>
constexpr int HistBytes() {
  return kRowsPerPass * kTopKBins * 2;
}
// At most 64 counts per bin per tile: flush before a 16-bit count could pass 65535.
constexpr int kHistFlushTiles = 65535 / kMqaTileKeys;

template <int kRowsPerPass, bool kOwnSchedule>
constexpr int SmemBytes() {
  return kKeysMStages * kValues + kRowsPerPass * kQBytes + kKeysMStages * kScales +
         kRowsPerPass * kHeads * 4 + (kOwnSchedule ? kOwnScheduleBytes : 0) + 1024;
}

// How the keys are widened: all by cvt (the default), half the k-steps (2, 3, 6, 7) by the
// integer bit move (kWgmmaKeysMSplit / Fused: the two pipes share the work), or all of them
// (kWgmmaKeysMBitMove: the measurement that says whether the integer pipe alone keeps up).
enum Widen { kWidenCvt = 0, kWidenSplit = 1, kWidenBitMove = 2 };
__host__ __device__ constexpr bool BitMoveStep(int widen, int ks) {
  return widen == kWidenBitMove || (widen == kWidenSplit && ((ks >> 1) & 1));
}

// e4m3 code -> f16 bits of its value times 2^-8 (exact; see the file comment).
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

// A schedule entry: read-only global loads for the schedule kernel's output (as before), plain
// loads where the block built it in shared memory.
template <bool kShared>
__device__ __forceinline__ int32_t Ld(const int32_t* v) {
  if constexpr (kShared) {
    return *v;
  } else {
    return __ldg(v);
  }
}

// TileCursor over a schedule that may live in shared memory.
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
// head, k index permuted inside each 16-dim step (see the file comment), 128B swizzle. The
// bit-move steps pair dims (4c, 4c + 2) and (4c + 1, 4c + 3) instead.
__device__ __forceinline__ int QOffset(int head, int dim, bool bit_move) {
  const int step = dim >> 4, p = dim & 15;
  const int e = p & 3;
  const int kk = bit_move ? ((e & 1) ? 8 : 0) + 2 * (p >> 2) + (e >> 1)
                 : e < 2  ? 2 * (p >> 2) + e
                          : 8 + 2 * (p >> 2) + e - 2;
  const int byte = ((step & 3) * 16 + kk) * 2;
  return (step >> 2) * kHalfBytes + head * 128 + ((((byte >> 4) ^ (head & 7))) << 4) + (byte & 15);
}

template <int kRowsPerPass, int kWiden, bool kOwnSchedule>
__global__ void __launch_bounds__(kThreads, 4) PagedMqaLogitsKeysMKernel(const PagedLogitsArgs p) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint8_t* stage_values = smem;                             // [stages][8192], swizzled
  uint8_t* q_tile = smem + kKeysMStages * kValues;          // [rows][2][64][128 B]
  uint8_t* stage_scales = q_tile + kRowsPerPass * kQBytes;  // [stages][64] fp32
  float* w_smem = reinterpret_cast<float*>(stage_scales + kKeysMStages * kScales);  // [rows][64]
  int32_t* own = reinterpret_cast<int32_t*>(w_smem + kRowsPerPass * kHeads);
  // Only when p.row_histogram is set (the launch then adds HistBytes to the shared memory).
  uint32_t* hist_smem =
      reinterpret_cast<uint32_t*>(own + (kOwnSchedule ? kOwnScheduleBytes / 4 : 0));
  const bool hist_on = p.row_histogram != nullptr;

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;
  const int c = lane & 3;

  const int num_requests = p.rows.num_requests;
  const int32_t* prefix = p.schedule.tile_prefix;
  const int32_t* req_first_row = p.schedule.request_first_row;
  const int32_t* req_num_rows = p.schedule.request_num_rows;
  const int32_t* req_max_len = p.schedule.request_max_len;
  if constexpr (kOwnSchedule) {
    // The schedule kernel's work, per block in shared memory (the launcher checks that
    // num_requests <= kOwnScheduleMaxRequests). Same numbers: min / count / max are order-free.
    int32_t* first = own;
    int32_t* count = own + kOwnScheduleMaxRequests;
    int32_t* maxlen = own + 2 * kOwnScheduleMaxRequests;
    int32_t* pre = own + 3 * kOwnScheduleMaxRequests;
    uint32_t* scratch = reinterpret_cast<uint32_t*>(pre + kOwnScheduleMaxRequests + 1);
    for (int b = tid; b < num_requests; b += kThreads) {
      first[b] = INT_MAX;
      count[b] = 0;
      maxlen[b] = 0;
    }
    __syncthreads();
    for (int r = tid; r < p.rows.num_rows; r += kThreads) {
      const int b = __ldg(&p.rows.row_request[r]);
      atomicMin(&first[b], r);
      atomicAdd(&count[b], 1);
      atomicMax(&maxlen[b], __ldg(&p.rows.row_length[r]));
    }
    __syncthreads();
    const int per_thread = (num_requests + kThreads - 1) / kThreads;
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
    __syncthreads();
    prefix = pre;
    req_first_row = first;
    req_num_rows = count;
    req_max_len = maxlen;
  }
  const int total_tiles = Ld<kOwnSchedule>(&prefix[num_requests]);
  const int begin = static_cast<int>(int64_t{total_tiles} * blockIdx.x / gridDim.x);
  const int end = static_cast<int>(int64_t{total_tiles} * (blockIdx.x + 1) / gridDim.x);
  if (begin >= end) return;
  const int num_tiles = end - begin;
  const uint8_t* __restrict__ cache = p.cache.base;

  ScheduleCursor<kOwnSchedule> load;
  load.Seek(prefix, num_requests, begin);
  int load_i = 0;
  auto issue = [&]() {
    if (load_i < num_tiles) {
      const int b = load.request;
      const int j = load.tile - Ld<kOwnSchedule>(&prefix[b]);
      const int page = __ldg(&p.rows.page_table[int64_t{b} * p.rows.page_table_stride + j]);
      const int valid = min(kMqaTileKeys, Ld<kOwnSchedule>(&req_max_len[b]) - j * kMqaTileKeys);
      const uint8_t* src = cache + int64_t{page} * kPageBytes;
      const int st = load_i % kKeysMStages;
      uint8_t* dv = stage_values + st * kValues;
      uint8_t* ds = stage_scales + st * kScales;
#pragma unroll
      for (int k0 = 0; k0 < (kPageBytes / 16 + kThreads - 1) / kThreads; ++k0) {
        const int ch = k0 * kThreads + tid;
        if (ch < kValues / 16) {
          const int row = ch >> 3, col = ch & 7;
          CpAsync16(dv + row * 128 + ((col ^ (row & 7)) << 4), src + ch * 16, row < valid);
        } else if (ch < kPageBytes / 16) {
          const int sc = ch - kValues / 16;
          CpAsync16(ds + sc * 16, src + kValues + sc * 16, sc * 4 < valid);
        }
      }
      if (load_i + 1 < num_tiles) load.Next(prefix);
    }
    ++load_i;
    CpAsyncCommit();
  };
#pragma unroll
  for (int s = 0; s < kKeysMStages - 1; ++s) issue();

  // The request whose first kRowsPerPass rows hist_smem counts (-1: none yet).
  int hist_request = -1, hist_first_row = 0, hist_rows = 0, hist_tiles = 0;
  auto flush_hist = [&]() {
    for (int s = 0; s < hist_rows; ++s) {
      uint32_t* g = p.row_histogram + int64_t{hist_first_row + s} * kTopKBins;
      uint32_t* h = hist_smem + s * (kTopKBins / 2);
      for (int w = tid; w < kTopKBins / 2; w += kThreads) {
        const uint32_t x = h[w];
        if (x != 0u) {
          if ((x & 0xFFFFu) != 0u) atomicAdd(&g[2 * w], x & 0xFFFFu);
          if ((x >> 16) != 0u) atomicAdd(&g[2 * w + 1], x >> 16);
          h[w] = 0u;
        }
      }
    }
  };
  if (hist_on) {
    for (int w = tid; w < kRowsPerPass * kTopKBins / 2; w += kThreads) hist_smem[w] = 0u;
  }

  int loaded_request = -1, loaded_pass = -1;
  ScheduleCursor<kOwnSchedule> cur;
  cur.Seek(prefix, num_requests, begin);
  for (int i = 0; i < num_tiles; ++i) {
    CpAsyncWait<kKeysMStages - 2>();
    __syncthreads();  // the page landed for everyone; everyone is done with the last tile
    issue();

    const int b = cur.request;
    const int base_pos = (cur.tile - Ld<kOwnSchedule>(&prefix[b])) * kMqaTileKeys;
    const int first_row = Ld<kOwnSchedule>(&req_first_row[b]);
    const int nrows = Ld<kOwnSchedule>(&req_num_rows[b]);
    if (hist_on) {  // block-uniform
      if (b != hist_request || hist_tiles == kHistFlushTiles) {
        flush_hist();  // the loop's barrier above ordered the last tile's counts before this
        __syncthreads();
        hist_request = b;
        hist_first_row = first_row;
        hist_rows = min(nrows, kRowsPerPass);
        hist_tiles = 0;
      }
      ++hist_tiles;
    }
    const int st = i % kKeysMStages;
    const uint8_t* kv = stage_values + st * kValues;
    const float* ksc = reinterpret_cast<const float*>(stage_scales + st * kScales);

    // This warp's 16 keys as f16 A fragments, 8 k-steps of 16 dims.
    uint32_t a[8][4];
#pragma unroll
    for (int sp = 0; sp < 4; ++sp) {
      uint32_t r[4];
      const int mi = lane >> 3;
      const int key = warp * 16 + (lane & 7) + 8 * (mi & 1);
      const int chunk = 2 * sp + (mi >> 1);
      LdMatrixX4(r, kv + key * 128 + ((chunk ^ (key & 7)) << 4));
      if (BitMoveStep(kWiden, 2 * sp)) {
        E4M3x4ToF16x2ScaledBitMove(r[0], a[2 * sp][0], a[2 * sp][2]);
        E4M3x4ToF16x2ScaledBitMove(r[1], a[2 * sp][1], a[2 * sp][3]);
        E4M3x4ToF16x2ScaledBitMove(r[2], a[2 * sp + 1][0], a[2 * sp + 1][2]);
        E4M3x4ToF16x2ScaledBitMove(r[3], a[2 * sp + 1][1], a[2 * sp + 1][3]);
        continue;
      }
      a[2 * sp][0] = E4M3x2ToF16x2(r[0]);
      a[2 * sp][2] = E4M3x2ToF16x2(r[0] >> 16);
      a[2 * sp][1] = E4M3x2ToF16x2(r[1]);
      a[2 * sp][3] = E4M3x2ToF16x2(r[1] >> 16);
      a[2 * sp + 1][0] = E4M3x2ToF16x2(r[2]);
      a[2 * sp + 1][2] = E4M3x2ToF16x2(r[2] >> 16);
      a[2 * sp + 1][1] = E4M3x2ToF16x2(r[3]);
      a[2 * sp + 1][3] = E4M3x2ToF16x2(r[3] >> 16);
    }
    const int key0 = warp * 16 + g;
    // Bit moves: the sums are 2^-8 times the true ones (exactly); 256 * ks is exact too.
    constexpr bool kSplit = kWiden != kWidenCvt;
    const float ks0 = kSplit ? 256.f * ksc[key0] : ksc[key0];
    const float ks1 = kSplit ? 256.f * ksc[key0 + 8] : ksc[key0 + 8];

    const int passes = (nrows + kRowsPerPass - 1) / kRowsPerPass;
    for (int pass = 0; pass < passes; ++pass) {
      if (b != loaded_request || pass != loaded_pass) {  // block-uniform
        if (pass > 0) __syncthreads();  // every warp's wgmma has read the previous q
        loaded_request = b;
        loaded_pass = pass;
        // q of this pass's rows: e4m3 -> f16 (exact) into the permuted, swizzled B tiles.
#pragma unroll 4
        for (int it = tid; it < kRowsPerPass * kHeads * 32; it += kThreads) {
          const int rr = it / (kHeads * 32);
          const int head = (it / 32) % kHeads;
          const int quad = it % 32;  // dims 4 quad .. 4 quad + 3
          const int rin = pass * kRowsPerPass + rr;
          if (rin >= nrows) continue;
          const int64_t row = first_row + rin;
          const uint32_t codes = __ldg(reinterpret_cast<const uint32_t*>(
              p.q.codes + (row * kHeads + head) * kMqaHeadDim + 4 * quad));
          uint8_t* qt = q_tile + rr * kQBytes;
          if (!kSplit) {
            *reinterpret_cast<uint32_t*>(qt + QOffset(head, 4 * quad, false)) =
                E4M3x2ToF16x2(codes);
            *reinterpret_cast<uint32_t*>(qt + QOffset(head, 4 * quad + 2, false)) =
                E4M3x2ToF16x2(codes >> 16);
          } else {
            // Bit-move steps: keys carry the 2^-8, q is plain f16 (cvt); the other steps:
            // q carries it (the bit move on q's own codes). One f16 at a time: the pairing
            // differs between the two kinds of step.
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
          if (quad == 0) w_smem[rr * kHeads + head] = __ldg(&p.q.weights[row * kHeads + head]);
        }
        FenceProxyAsyncShared();
        __syncthreads();
      }
      for (int rr = 0; rr < kRowsPerPass; ++rr) {
        const int rin = pass * kRowsPerPass + rr;
        if (rin >= nrows) break;
        const int row = first_row + rin;
        float acc[32];
        WgmmaFence();
#pragma unroll
        for (int ks = 0; ks < 8; ++ks) {
          WgmmaM64N64K16F16(
              acc, a[ks],
              SmemDescSw128(q_tile + rr * kQBytes + (ks >> 2) * kHalfBytes + (ks & 3) * 32), ks);
        }
        WgmmaCommit();
        WgmmaWait<0>();
        // Keys key0 and key0 + 8 against heads 8 j + 2 c + e: relu * w, then the 4 lanes of
        // the group complete the 64-head sum.
        const float* w = w_smem + rr * kHeads;
        float s0 = 0.f, s1 = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float wv = w[8 * j + 2 * c + e];
            s0 += wv * fmaxf(acc[4 * j + e], 0.f);
            s1 += wv * fmaxf(acc[4 * j + 2 + e], 0.f);
          }
        }
        s0 += __shfl_xor_sync(kFullMask, s0, 1);
        s1 += __shfl_xor_sync(kFullMask, s1, 1);
        s0 += __shfl_xor_sync(kFullMask, s0, 2);
        s1 += __shfl_xor_sync(kFullMask, s1, 2);
        if (c < 2) {
          const int key = key0 + 8 * c;
          const int pos = base_pos + key;
          if (pos < __ldg(&p.rows.row_length[row])) {
            const float logit = c == 0 ? s0 * ks0 : s1 * ks1;
            p.logits[int64_t{row} * p.logits_stride + pos] = logit;
            if (hist_on && pos % kTopKSampleStride == 0) {  // lane 0 of each warp
              const uint32_t bucket = TopKBucket(TopKOrderedKey(logit));
              if (rin < kRowsPerPass) {
                atomicAdd(&hist_smem[rin * (kTopKBins / 2) + (bucket >> 1)],
                          1u << (16 * (bucket & 1u)));
              } else {  // rows past the first pass of a request: straight to global memory
                atomicAdd(&p.row_histogram[int64_t{row} * kTopKBins + bucket], 1u);
              }
            }
          }
        }
      }
    }
    if (i + 1 < num_tiles) cur.Next(prefix);
  }
  CpAsyncWait<0>();
  if (hist_on) {
    __syncthreads();  // every warp's last counts are in
    flush_hist();
  }
}

template <int kRowsPerPass, int kWiden, bool kOwnSchedule>
absl::Status LaunchTyped(const PagedLogitsArgs& args, int num_sms, cudaStream_t stream) {
  auto kernel = PagedMqaLogitsKeysMKernel<kRowsPerPass, kWiden, kOwnSchedule>;
  constexpr int kSmem = SmemBytes<kRowsPerPass, kOwnSchedule>();
  constexpr int kSmemHist = kSmem + HistBytes<kRowsPerPass>();
  // The shared-memory opt-in and the occupancy are per device and per instantiation: set
  // them once for each device a rank uses (occupancy with and without the histogram).
  struct PerDevice {
    std::once_flag once;
    int blocks_per_sm = 0;
    int blocks_per_sm_hist = 0;
    cudaError_t err = cudaSuccess;
  };
  static PerDevice per_device[kMaxDevices];
  int device = 0;
  DI_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device), "cudaGetDevice");
  if (device >= kMaxDevices) return absl::UnimplementedError("more than 16 GPUs");
  PerDevice& pd = per_device[device];
  std::call_once(pd.once, [&] {
    pd.err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemHist);
    if (pd.err == cudaSuccess) {
      pd.err =
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&pd.blocks_per_sm, kernel, kThreads, kSmem);
    }
    if (pd.err == cudaSuccess) {
      pd.err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&pd.blocks_per_sm_hist, kernel,
                                                             kThreads, kSmemHist);
    }
  });
  DI_CUDA_RETURN_IF_ERROR(pd.err, "paged mqa logits (keys as M): attributes / occupancy");
  const bool hist = args.row_histogram != nullptr;
  const int blocks_per_sm = hist ? pd.blocks_per_sm_hist : pd.blocks_per_sm;
  const int grid = std::max(1, num_sms * std::max(1, blocks_per_sm));
  kernel<<<grid, kThreads, hist ? kSmemHist : kSmem, stream>>>(args);
  DI_CUDA_RETURN_IF_LAUNCH_ERROR("launch PagedMqaLogitsKeysMKernel");
  return absl::OkStatus();
}

template <int kWiden, bool kOwnSchedule>
absl::Status LaunchVariant(const PagedLogitsArgs& args, int num_sms, cudaStream_t stream) {
  switch (RowsPerPass(args.rows.num_rows, args.rows.num_requests, args.rows.rows_per_request)) {
    case 1:
      return LaunchTyped<1, kWiden, kOwnSchedule>(args, num_sms, stream);
    case 2:
      return LaunchTyped<2, kWiden, kOwnSchedule>(args, num_sms, stream);
    case 3:
      return LaunchTyped<3, kWiden, kOwnSchedule>(args, num_sms, stream);
    default:
      return LaunchTyped<4, kWiden, kOwnSchedule>(args, num_sms, stream);
  }
}

}  // namespace

bool PagedLogitsFillsHistogram(const PagedLogitsArgs& args) {
  const CacheGeometry& geo = args.cache.geometry;
  const bool keys_m_math =
      args.math == MqaMath::kWgmmaKeysM || args.math == MqaMath::kWgmmaKeysMSplit ||
      args.math == MqaMath::kWgmmaKeysMFused || args.math == MqaMath::kWgmmaKeysMBitMove;
  return keys_m_math && geo.format == CacheFormat::kFp8 && args.q.num_heads == 64 &&
         geo.page_size == kMqaTileKeys && geo.head_dim == kMqaHeadDim;
}

bool KeysMComputesOwnSchedule(const PagedLogitsArgs& args) {
  return args.math == MqaMath::kWgmmaKeysMFused &&
         args.rows.num_requests <= kOwnScheduleMaxRequests;
}

absl::Status LaunchPagedMqaLogitsKeysM(const PagedLogitsArgs& args, int num_sms,
                                       cudaStream_t stream) {
  // Fused: the split widening only where a page serves one row per pass. Measured on the H200
  // (docs/results/cuda-bench.md, 08:20): split is 7-10% faster than cvt at next_n 1 and
  // 1-3% slower at next_n 2, where two wgmma rounds per page hide the widening anyway.
  const bool one_row =
      RowsPerPass(args.rows.num_rows, args.rows.num_requests, args.rows.rows_per_request) == 1;
  if (KeysMComputesOwnSchedule(args)) {
    return one_row ? LaunchVariant<kWidenSplit, true>(args, num_sms, stream)
                   : LaunchVariant<kWidenCvt, true>(args, num_sms, stream);
  }
  switch (args.math) {
    case MqaMath::kWgmmaKeysMSplit:
      return LaunchVariant<kWidenSplit, false>(args, num_sms, stream);
    case MqaMath::kWgmmaKeysMFused:
      return one_row ? LaunchVariant<kWidenSplit, false>(args, num_sms, stream)
                     : LaunchVariant<kWidenCvt, false>(args, num_sms, stream);
    case MqaMath::kWgmmaKeysMBitMove:
      return LaunchVariant<kWidenBitMove, false>(args, num_sms, stream);
    default:
      return LaunchVariant<kWidenCvt, false>(args, num_sms, stream);
  }
}

}  // namespace decode_indexer::kernels::cuda
