// A comparison variant, built only with the benchmarks (MqaVariant::kWgmmaKeysM / Split / Fused /
// BitMove, mqa_variants.h): the first keys-as-M kernel, the exact production kernel's ancestor
// (kernels/cuda/sm90_paged_mqa_logits_pipelined.cu gives its logits bit for bit;
// gpu_variants_test checks every entry) and the only one with the threshold-filter histogram hook.
//
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
// kKeysMStages: measured at 64 x 32K (H200): 4 stages / 3 blocks per SM 135 us, 3 / 4 blocks
// 143 us, 6 / 3 blocks 174 us - the kernel is latency bound (docs/notes/cuda.md).
//
// The MMA's k order inside each 16-dim step is permuted (ldmatrix hands each thread dims
// 4c..4c+3; the f16 A fragment wants pairs 2c and 2c + 8): q is written to shared memory with
// the same permutation, so the products pair the same dims.
//
// Variants (MqaVariant, same math, bit-identical logits):
// - kWgmmaKeysMSplit: the widening cvt (F2FP, a 16/clk/SM pipe: 4096 of them per page, 256
//   cycles per page per SM, ~45% of the ~590-cycle budget a page has at 85% of copy
//   bandwidth) is done for half the k-steps with integer ops instead: the bits of an e4m3
//   code moved into an f16 ((b & 0x80) << 8 | (b & 0x7f) << 7) are exactly its value times
//   2^-8 (normals and subnormals alike). Those steps pair with q in plain f16, the cvt steps
//   with q times 2^-8 (the same bit move on q's codes), so every product is the true one
//   times 2^-8 and the fp32 sums are the cvt path's sums times 2^-8, exactly (power-of-two
//   scaling, far from fp32's range ends); the epilogue's key scale times 256 undoes it.
// - kWgmmaKeysMFused (the default until the pipelined kernel): each block derives the schedule from
// the row table itself
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

#include "bench/cuda/variants/mqa_variants.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/sm90_device_utils.cuh"
#include "kernels/cuda/sm90_heuristics.h"
#include "kernels/cuda/sm90_launch_setup.cuh"
#include "kernels/cuda/sm90_launchers.h"
#include "kernels/cuda/sm90_mqa_keys_m.cuh"
#include "kernels/cuda/sm90_mqa_tiles.cuh"
#include "kernels/cuda/sm90_tile_config.h"
#include "kernels/cuda/sm90_topk_bucket.cuh"

namespace decode_indexer::kernels::cuda {
namespace {

constexpr int kKeysMStages = 3;
constexpr int kHeads = 64;
constexpr int kThreads = 128;                        // one warpgroup
constexpr int kValues = kMqaTileKeys * kMqaHeadDim;  // 8192: a page's e4m3 codes
constexpr int kScales = kMqaTileKeys * 4;            // 256: its fp32 scales
constexpr int kPageBytes = kValues + kScales;        // 8448
constexpr int kQBytes = kHeads * kMqaHeadDim * 2;    // one row's q in f16: 16 KB
constexpr int kHalfBytes = kHeads * 128;             // 64 dims of q: one swizzled tile
static_assert(kHalfBytes == kKeysMQHalfBytes, "QOffset's q tile layout");

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
    // The schedule kernel's work, per block in shared memory (see BuildOwnSchedule).
    BuildOwnSchedule<kThreads>(p, own, tid, num_requests, prefix, req_first_row, req_num_rows,
                               req_max_len);
    __syncthreads();
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
      const int page = __ldg(&p.rows.page_table[PageRowBase(p.rows, b) + j]);
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
    WidenPage<kWiden>(kv, warp, lane, a);
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
          // Bit-move steps: keys carry the 2^-8, q is plain f16 (cvt); the other steps: q
          // carries it (the bit move on q's own codes).
          StoreQQuad<kWiden>(qt, head, quad, codes);
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
        float s0, s1;
        KeysMHeadSums(
            acc, [&](int j, int e) { return w[8 * j + 2 * c + e]; }, s0, s1);
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
  static KernelDeviceSetup per_device[kMaxDevices];
  const absl::StatusOr<const KernelDeviceSetup*> setup =
      SetUpOncePerDevice(per_device, "paged mqa logits (keys as M): attributes / occupancy",
                         [&](KernelDeviceSetup& d) {
                           cudaError_t err = cudaFuncSetAttribute(
                               kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemHist);
                           if (err == cudaSuccess) {
                             err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                                 &d.blocks_per_sm, kernel, kThreads, kSmem);
                           }
                           if (err == cudaSuccess) {
                             err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                                 &d.blocks_per_sm_hist, kernel, kThreads, kSmemHist);
                           }
                           return err;
                         });
  if (!setup.ok()) return setup.status();
  const KernelDeviceSetup& pd = **setup;
  const bool hist = args.row_histogram != nullptr;
  const int blocks_per_sm = hist ? pd.blocks_per_sm_hist : pd.blocks_per_sm;
  const int grid = std::max(1, num_sms * std::max(1, blocks_per_sm));
  kernel<<<grid, kThreads, hist ? kSmemHist : kSmem, stream>>>(args);
  DI_CUDA_RETURN_IF_LAUNCH_ERROR("launch PagedMqaLogitsKeysMKernel");
  return absl::OkStatus();
}

template <int kWiden, bool kOwnSchedule>
absl::Status LaunchVariant(const PagedLogitsArgs& args, int num_sms, cudaStream_t stream) {
  return WithDenseRowsPerPass(args.rows, [&](auto rows) {
    return LaunchTyped<decltype(rows)::value, kWiden, kOwnSchedule>(args, num_sms, stream);
  });
}

}  // namespace

bool KeysMComputesOwnSchedule(MqaVariant v, const PagedLogitsArgs& args) {
  return v == MqaVariant::kWgmmaKeysMFused && DenseComputesOwnSchedule(args.rows);
}

absl::Status LaunchPagedMqaLogitsKeysM(MqaVariant v, const PagedLogitsArgs& args, int num_sms,
                                       cudaStream_t stream) {
  // Fused: the split widening only where a page serves one row per pass. Measured on the H200
  // (docs/results/cuda-bench.md, 08:20): split is 7-10% faster than cvt at next_n 1 and
  // 1-3% slower at next_n 2, where two wgmma rounds per page hide the widening anyway.
  const bool one_row = DenseRowsPerPass(args.rows) == 1;
  if (KeysMComputesOwnSchedule(v, args)) {
    return one_row ? LaunchVariant<kWidenSplit, true>(args, num_sms, stream)
                   : LaunchVariant<kWidenCvt, true>(args, num_sms, stream);
  }
  switch (v) {
    case MqaVariant::kWgmmaKeysMSplit:
      return LaunchVariant<kWidenSplit, false>(args, num_sms, stream);
    case MqaVariant::kWgmmaKeysMFused:
      return one_row ? LaunchVariant<kWidenSplit, false>(args, num_sms, stream)
                     : LaunchVariant<kWidenCvt, false>(args, num_sms, stream);
    case MqaVariant::kWgmmaKeysMBitMove:
      return LaunchVariant<kWidenBitMove, false>(args, num_sms, stream);
    default:
      return LaunchVariant<kWidenCvt, false>(args, num_sms, stream);
  }
}

}  // namespace decode_indexer::kernels::cuda
