// Paged MQA logits on SM90 (spec section 3): for every row r of a request and every key t
// below the row's length, logit = k_scale[t] * sum_h w[r,h] * relu(q[r,h,:] . k[t,:]).
//
// Design (ideas from DeepGEMM's fp8_paged_mqa_logits; the code is ours):
// - A persistent grid walks the step's key tiles (one tile = one 64-entry page) in contiguous
//   ranges of the device-computed schedule, so every SM gets the same number of pages whatever
//   the mix of lengths, and the host never waits.
// - Pages stream through shared memory with cp.async, kMqaStages deep, swizzled (16-byte chunk
//   c of row r at c ^ (r % 8)) so the MMA operand loads (ldmatrix) are bank-conflict free.
// - All rows of a request (next_n) are scored from the same tile in shared memory: each key is
//   read from HBM once per request. One warp owns 16 heads of one row; its q fragment lives in
//   registers for as long as the block stays on that request.
// - Tensor cores: FP8 with 64 heads (v32) goes to one of the two keys-as-M wgmma kernels
//   (sm90_paged_mqa_logits_pipelined.cu exact, sm90_paged_mqa_logits_fp8.cu fp8; which one:
//   sm90_heuristics.h), FP4 with 32 heads to the FP4 kernel (sm90_paged_mqa_logits_fp4.cuh),
//   other FP4 shapes and head counts to the sparse tensor-core kernel over the dense rows; this
//   file holds the dispatch and the mma.sync m16n8k32 e4m3 kernel, their fallback for
//   every shape. FP4 codes are widened to e4m3 (exact) and each 32-wide group is its own MMA
//   step scaled by q_scale * k_scale. (Heads-as-M wgmma variants, f16 and fp8, were measured
//   slower than keys-M and removed: docs/results/cuda-bench.md, 07:44 to 11:27.)
// - Epilogue: relu * w, a shuffle reduce-scatter over the 16 heads of the warp, then a fixed-
//   order sum over the row's warps in shared memory, times the key scale. The order of every
//   floating-point operation depends only on the row's own data, never on the schedule, so the
//   logits are bit-identical across runs, rank counts and batch compositions.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "decode_indexer/kernels/quant.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/sm90_device_utils.cuh"
#include "kernels/cuda/sm90_heuristics.h"
#include "kernels/cuda/sm90_launch_setup.cuh"
#include "kernels/cuda/sm90_launchers.h"
#include "kernels/cuda/sm90_mqa_tiles.cuh"
#include "kernels/cuda/sm90_tile_config.h"

namespace decode_indexer::kernels::cuda {
namespace {

template <bool kFp4>
struct TileBytes {
  static constexpr int kValueBytes = kFp4 ? kMqaHeadDim / 2 : kMqaHeadDim;  // per entry
  static constexpr int kValues = kMqaTileKeys * kValueBytes;
  static constexpr int kScales = kMqaTileKeys * 4;  // FP8: fp32; FP4: 4 ue8m0 bytes
  static constexpr int kPage = kValues + kScales;   // a cache page
};

// Shared memory: the stages' values (1024-byte aligned), then their scales, the per-warp
// partial sums and (FP4) the widened e4m3 tile.
template <int kHeads, bool kFp4, int kRowsPerPass>
constexpr int SmemBytes() {
  constexpr int kWarps = kRowsPerPass * kHeads / 16;
  return kMqaStages * (TileBytes<kFp4>::kValues + TileBytes<kFp4>::kScales) +
         kWarps * kMqaTileKeys * 4 + (kFp4 ? kMqaTileKeys * kMqaHeadDim : 0) + 1024;
}

// mma.sync m16n8k32 e4m3 per warp (sm_90 runs it as f16 HMMA plus F2FP conversions), one warp
// per 16 heads of a row.
template <int kHeads, bool kFp4, int kRowsPerPass>
__global__ void __launch_bounds__(kRowsPerPass* kHeads / 16 * 32, (kRowsPerPass > 2 ? 1 : 2))
    PagedMqaLogitsKernel(const PagedLogitsArgs p) {
  using TB = TileBytes<kFp4>;
  constexpr int kSlabsPerRow = kHeads / 16;
  constexpr int kWarps = kRowsPerPass * kSlabsPerRow;
  constexpr int kThreads = kWarps * 32;
  constexpr int kValueChunks = TB::kValues / 16;
  constexpr int kScaleChunks = TB::kScales / 16;

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = AlignSmem1024(smem_raw);
  uint8_t* stage_values = smem;                             // [kMqaStages][kValues]
  uint8_t* stage_scales = smem + kMqaStages * TB::kValues;  // [kMqaStages][kScales]
  float* red = reinterpret_cast<float*>(stage_scales + kMqaStages * TB::kScales);  // [warps][64]
  uint8_t* widened = reinterpret_cast<uint8_t*>(red + kWarps * kMqaTileKeys);      // FP4 only

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;  // MMA group: head row g (and g + 8), key column of B
  const int c = lane & 3;   // thread in group

  const int num_requests = p.rows.num_requests;
  const int32_t* __restrict__ prefix = p.schedule.tile_prefix;
  const int total_tiles = __ldg(&prefix[num_requests]);
  const int begin = static_cast<int>(int64_t{total_tiles} * blockIdx.x / gridDim.x);
  const int end = static_cast<int>(int64_t{total_tiles} * (blockIdx.x + 1) / gridDim.x);
  if (begin >= end) return;
  const int num_tiles = end - begin;

  const uint8_t* __restrict__ cache = p.cache.base;

  // Loads run kMqaStages - 1 tiles ahead of the compute.
  TileCursor load;
  load.Seek(prefix, num_requests, begin);
  int load_i = 0;
  auto issue = [&]() {
    if (load_i < num_tiles) {
      const int b = load.request;
      const int j = load.tile - __ldg(&prefix[b]);
      const int page = __ldg(&p.rows.page_table[PageRowBase(p.rows, b) + j]);
      const int valid = min(kMqaTileKeys, __ldg(&p.schedule.request_max_len[b]) - j * kMqaTileKeys);
      const uint8_t* src = cache + int64_t{page} * TB::kPage;
      const int st = load_i % kMqaStages;
      uint8_t* dv = stage_values + st * TB::kValues;
      uint8_t* ds = stage_scales + st * TB::kScales;
#pragma unroll
      for (int k0 = 0; k0 < (kValueChunks + kScaleChunks + kThreads - 1) / kThreads; ++k0) {
        const int ch = k0 * kThreads + tid;
        if (ch < kValueChunks) {
          if constexpr (kFp4) {
            CpAsync16(dv + ch * 16, src + ch * 16, (ch >> 2) < valid);
          } else {
            const int row = ch >> 3, col = ch & 7;
            CpAsync16(dv + row * 128 + ((col ^ (row & 7)) << 4), src + ch * 16, row < valid);
          }
        } else if (ch < kValueChunks + kScaleChunks) {
          const int sc = ch - kValueChunks;
          CpAsync16(ds + sc * 16, src + TB::kValues + sc * 16, sc * 4 < valid);
        }
      }
      if (load_i + 1 < num_tiles) load.Next(prefix);
    }
    ++load_i;
    CpAsyncCommit();
  };

#pragma unroll
  for (int s = 0; s < kMqaStages - 1; ++s) issue();

  // The warp's q fragment: 16 heads x 128 dims as four k-steps of A registers.
  int loaded_row = -1;
  uint32_t a[4][4];
  float w0 = 0.f, w1 = 0.f;
  float qs0[4] = {0.f, 0.f, 0.f, 0.f}, qs1[4] = {0.f, 0.f, 0.f, 0.f};
  const int slab = warp % kSlabsPerRow;
  const int head0 = slab * 16 + g;
  const int head1 = head0 + 8;

  TileCursor cur;
  cur.Seek(prefix, num_requests, begin);
  for (int i = 0; i < num_tiles; ++i) {
    CpAsyncWait<kMqaStages - 2>();  // this thread's copies of tile i have landed
    __syncthreads();                // everyone's copies landed; everyone is done with tile i - 1
    issue();                        // refills the stage tile i - 1 used

    const int b = cur.request;
    const int base_pos = (cur.tile - __ldg(&prefix[b])) * kMqaTileKeys;
    const int first_row = __ldg(&p.schedule.request_first_row[b]);
    const int nrows = __ldg(&p.schedule.request_num_rows[b]);
    const int st = i % kMqaStages;
    const uint8_t* kv = stage_values + st * TB::kValues;
    const uint8_t* ksc_base = stage_scales + st * TB::kScales;
    if constexpr (kFp4) {
      // Widen the page's e2m1 codes into a swizzled e4m3 tile (exact).
      for (int it = tid; it < kMqaTileKeys * 8; it += kThreads) {
        const int row = it >> 3, col = it & 7;
        const uint2 src = *reinterpret_cast<const uint2*>(kv + row * 64 + col * 8);
        uint4 out;
        out.x = WidenFp4x4(src.x & 0xFFFFu);
        out.y = WidenFp4x4(src.x >> 16);
        out.z = WidenFp4x4(src.y & 0xFFFFu);
        out.w = WidenFp4x4(src.y >> 16);
        *reinterpret_cast<uint4*>(widened + row * 128 + ((col ^ (row & 7)) << 4)) = out;
      }
      __syncthreads();
      kv = widened;
    }
    const int passes = (nrows + kRowsPerPass - 1) / kRowsPerPass;
    for (int pass = 0; pass < passes; ++pass) {
      const int row_in_request = pass * kRowsPerPass + warp / kSlabsPerRow;
      if (row_in_request < nrows) {  // warp-uniform
        const int row = first_row + row_in_request;
        if (row != loaded_row) {
          loaded_row = row;
          const int64_t h0 = int64_t{row} * kHeads + head0;
          const int64_t h1 = int64_t{row} * kHeads + head1;
          w0 = __ldg(&p.q.weights[h0]);
          w1 = __ldg(&p.q.weights[h1]);
#pragma unroll
          for (int ks = 0; ks < 4; ++ks) {
            if constexpr (kFp4) {
              const uint8_t* q0 = p.q.codes + h0 * 64 + ks * 16;
              const uint8_t* q1 = p.q.codes + h1 * 64 + ks * 16;
              a[ks][0] = WidenFp4x4(__ldg(reinterpret_cast<const uint16_t*>(q0 + 2 * c)));
              a[ks][1] = WidenFp4x4(__ldg(reinterpret_cast<const uint16_t*>(q1 + 2 * c)));
              a[ks][2] = WidenFp4x4(__ldg(reinterpret_cast<const uint16_t*>(q0 + 8 + 2 * c)));
              a[ks][3] = WidenFp4x4(__ldg(reinterpret_cast<const uint16_t*>(q1 + 8 + 2 * c)));
              qs0[ks] = DecodeUE8M0(__ldg(&p.q.scales[h0 * 4 + ks]));
              qs1[ks] = DecodeUE8M0(__ldg(&p.q.scales[h1 * 4 + ks]));
            } else {
              const uint8_t* q0 = p.q.codes + h0 * 128 + ks * 32;
              const uint8_t* q1 = p.q.codes + h1 * 128 + ks * 32;
              a[ks][0] = __ldg(reinterpret_cast<const uint32_t*>(q0 + 4 * c));
              a[ks][1] = __ldg(reinterpret_cast<const uint32_t*>(q1 + 4 * c));
              a[ks][2] = __ldg(reinterpret_cast<const uint32_t*>(q0 + 16 + 4 * c));
              a[ks][3] = __ldg(reinterpret_cast<const uint32_t*>(q1 + 16 + 4 * c));
            }
          }
        }

        // part[2 * nt + e]: this thread's heads (g, g + 8) summed for key 8 nt + 2 c + e.
        float part[16];
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          uint32_t bl[4], bh[4];
          const int krow = nt * 8 + (lane & 7);
          const int mat = lane >> 3;
          LdMatrixX4(bl, kv + krow * 128 + ((mat ^ (lane & 7)) << 4));
          LdMatrixX4(bh, kv + krow * 128 + (((mat + 4) ^ (lane & 7)) << 4));
          const uint32_t bfrag[8] = {bl[0], bl[1], bl[2], bl[3], bh[0], bh[1], bh[2], bh[3]};
          if constexpr (kFp4) {
            const uint8_t* ksc = ksc_base + (nt * 8 + 2 * c) * 4;
            float t[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int ks = 0; ks < 4; ++ks) {
              float acc[4] = {0.f, 0.f, 0.f, 0.f};
              MmaE4M3(acc, a[ks], bfrag[2 * ks], bfrag[2 * ks + 1]);
              const float k0 = DecodeUE8M0(ksc[ks]);
              const float k1 = DecodeUE8M0(ksc[4 + ks]);
              t[0] += acc[0] * (qs0[ks] * k0);
              t[1] += acc[1] * (qs0[ks] * k1);
              t[2] += acc[2] * (qs1[ks] * k0);
              t[3] += acc[3] * (qs1[ks] * k1);
            }
            part[2 * nt] = w0 * fmaxf(t[0], 0.f) + w1 * fmaxf(t[2], 0.f);
            part[2 * nt + 1] = w0 * fmaxf(t[1], 0.f) + w1 * fmaxf(t[3], 0.f);
          } else {
            float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int ks = 0; ks < 4; ++ks) {
              MmaE4M3(acc, a[ks], bfrag[2 * ks], bfrag[2 * ks + 1]);
            }
            part[2 * nt] = w0 * fmaxf(acc[0], 0.f) + w1 * fmaxf(acc[2], 0.f);
            part[2 * nt + 1] = w0 * fmaxf(acc[1], 0.f) + w1 * fmaxf(acc[3], 0.f);
          }
        }
        // Reduce-scatter over the 8 head groups (lane bits 2..4): 14 shuffles instead of 48.
        // Afterwards lane (g, c) holds keys 8 g + 2 c and 8 g + 2 c + 1.
#pragma unroll
        for (int i2 = 0; i2 < 8; ++i2) {
          const bool up = lane & 16;
          const float send = up ? part[i2] : part[i2 + 8];
          const float keep = up ? part[i2 + 8] : part[i2];
          part[i2] = keep + __shfl_xor_sync(kFullMask, send, 16);
        }
#pragma unroll
        for (int i2 = 0; i2 < 4; ++i2) {
          const bool up = lane & 8;
          const float send = up ? part[i2] : part[i2 + 4];
          const float keep = up ? part[i2 + 4] : part[i2];
          part[i2] = keep + __shfl_xor_sync(kFullMask, send, 8);
        }
#pragma unroll
        for (int i2 = 0; i2 < 2; ++i2) {
          const bool up = lane & 4;
          const float send = up ? part[i2] : part[i2 + 2];
          const float keep = up ? part[i2 + 2] : part[i2];
          part[i2] = keep + __shfl_xor_sync(kFullMask, send, 4);
        }
        *reinterpret_cast<float2*>(red + warp * kMqaTileKeys + 8 * g + 2 * c) =
            make_float2(part[0], part[1]);
      }
      __syncthreads();
      // Head sum over the row's slabs in ascending order, key scale, store below the length.
      for (int idx = tid; idx < kRowsPerPass * kMqaTileKeys; idx += kThreads) {
        const int rr = idx / kMqaTileKeys;
        const int key = idx % kMqaTileKeys;
        const int rin = pass * kRowsPerPass + rr;
        if (rin >= nrows) continue;
        const int row = first_row + rin;
        const int pos = base_pos + key;
        if (pos >= __ldg(&p.rows.row_length[row])) continue;
        float sum = red[(rr * kSlabsPerRow) * kMqaTileKeys + key];
#pragma unroll
        for (int s = 1; s < kSlabsPerRow; ++s) {
          sum += red[(rr * kSlabsPerRow + s) * kMqaTileKeys + key];
        }
        if constexpr (!kFp4) sum *= reinterpret_cast<const float*>(ksc_base)[key];
        p.logits[int64_t{row} * p.logits_stride + pos] = sum;
      }
      if (pass + 1 < passes) __syncthreads();  // red is rewritten by the next pass
    }
    if (i + 1 < num_tiles) cur.Next(prefix);
  }
  CpAsyncWait<0>();
}

template <int kHeads, bool kFp4, int kRowsPerPass>
absl::Status LaunchTyped(const PagedLogitsArgs& args, int num_sms, cudaStream_t stream) {
  // The shared-memory opt-in and the occupancy are per device and per instantiation: set
  // them once for each device a rank uses.
  static KernelDeviceSetup per_device[kMaxDevices];
  return LaunchPersistentGrid(per_device, "paged mqa logits (mma.sync)",
                              PagedMqaLogitsKernel<kHeads, kFp4, kRowsPerPass>,
                              kRowsPerPass * kHeads / 16 * 32,
                              SmemBytes<kHeads, kFp4, kRowsPerPass>(), num_sms, stream, args);
}

template <int kHeads, bool kFp4>
absl::Status LaunchRows(const PagedLogitsArgs& args, int num_sms, cudaStream_t stream) {
  return WithDenseRowsPerPass(args.rows, [&](auto rows) {
    return LaunchTyped<kHeads, kFp4, decltype(rows)::value>(args, num_sms, stream);
  });
}

// FP8 with 64 heads, page size 64, head dim 128: the keys-as-M kernels' shape.
bool KeysMShape(const PagedLogitsArgs& args) {
  const CacheGeometry& geo = args.cache.geometry;
  return geo.format == CacheFormat::kFp8 && args.q.num_heads == 64 &&
         geo.page_size == kMqaTileKeys && geo.head_dim == kMqaHeadDim;
}

}  // namespace

// FP4 / 32 heads on the FP4 kernel (kFp4DenseWgmma) unless another path is asked for by name.
bool TakesFp4Kernel(const PagedLogitsArgs& args) {
  return kFp4DenseWgmma && args.math != MqaMath::kMmaSync &&
         args.math != MqaMath::kSparseMmaDense && PagedMqaLogitsFp4Takes(args);
}

bool PagedLogitsNeedsSchedule(const PagedLogitsArgs& args) {
  const bool keys_m = KeysMShape(args) && (args.math == MqaMath::kWgmmaKeysMPipelined ||
                                           args.math == MqaMath::kWgmmaKeysMPipelinedFp8);
  return !((keys_m || TakesFp4Kernel(args)) && DenseComputesOwnSchedule(args.rows));
}

absl::Status LaunchPagedMqaLogits(const PagedLogitsArgs& args, int num_sms, cudaStream_t stream) {
  const CacheGeometry& geo = args.cache.geometry;
  if (geo.page_size != kMqaTileKeys || geo.head_dim != kMqaHeadDim) {
    return absl::UnimplementedError(absl::StrCat("paged mqa logits: page size ", geo.page_size,
                                                 " / head dim ", geo.head_dim,
                                                 " (the CUDA kernels need 64 / 128)"));
  }
  if (args.rows.num_rows <= 0 || args.rows.num_requests <= 0) return absl::OkStatus();
  const bool fp4 = geo.format == CacheFormat::kFp4;
  if (TakesFp4Kernel(args)) return LaunchPagedMqaLogitsFp4(args, num_sms, stream);
  // Other FP4 shapes, and FP8 with other than 64 heads, have no keys-M kernel: the sparse
  // consumer's tensor-core kernel scores the dense rows (no position list: position = index),
  // in place of
  // the mma.sync kernel below, which stays reachable as MqaMath::kMmaSync (sm90_heuristics.h).
  if ((fp4 || args.q.num_heads != 64 || args.math == MqaMath::kSparseMmaDense) &&
      args.math != MqaMath::kMmaSync && args.logits_stride <= INT32_MAX &&
      SparseLogitsMmaTakes(args.cache, args.q)) {
    return LaunchSparseLogitsMma(args.cache, args.rows, args.q, /*positions=*/nullptr,
                                 args.rows.row_length, static_cast<int32_t>(args.logits_stride),
                                 args.logits, stream, kSparseLogitsMathDefault);
  }
  switch (args.q.num_heads) {
    case 32:
      return fp4 ? LaunchRows<32, true>(args, num_sms, stream)
                 : LaunchRows<32, false>(args, num_sms, stream);
    case 64:
      if (fp4) return LaunchRows<64, true>(args, num_sms, stream);
      switch (args.math) {
        case MqaMath::kWgmmaKeysMPipelined:
          return LaunchPagedMqaLogitsPipelined(args, num_sms, stream);
        case MqaMath::kWgmmaKeysMPipelinedFp8:
          return LaunchPagedMqaLogitsFp8(args, num_sms, stream);
        case MqaMath::kMmaSync:
        case MqaMath::kSparseMmaDense:  // where the sparse kernel does not take the shape
          break;
      }
      return LaunchRows<64, false>(args, num_sms, stream);
    default:
      return absl::UnimplementedError(
          absl::StrCat("paged mqa logits: ", args.q.num_heads, " heads (32 or 64 supported)"));
  }
}

}  // namespace decode_indexer::kernels::cuda
