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
#include <algorithm>
#include <mutex>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/sm90_device_utils.cuh"
#include "kernels/cuda/sm90_launchers.h"
#include "kernels/cuda/sm90_mqa_tiles.cuh"
#include "kernels/cuda/sm90_tile_config.h"

namespace decode_indexer::kernels::cuda {
namespace {

constexpr int kHeads = 64;
constexpr int kThreads = 128;                        // one warpgroup
constexpr int kValues = kMqaTileKeys * kMqaHeadDim;  // 8192: a page's e4m3 codes
constexpr int kScales = kMqaTileKeys * 4;            // 256: its fp32 scales
constexpr int kPageBytes = kValues + kScales;        // 8448
constexpr int kQBytes = kHeads * kMqaHeadDim * 2;    // one row's q in f16: 16 KB
constexpr int kHalfBytes = kHeads * 128;             // 64 dims of q: one swizzled tile

template <int kRowsPerPass>
constexpr int SmemBytes() {
  return kKeysMStages * kValues + kRowsPerPass * kQBytes + kKeysMStages * kScales +
         kRowsPerPass * kHeads * 4 + 1024;
}

// Byte offset of q[head][dim] (f16) inside a row's q tile: half dim / 64, 128-byte row per
// head, k index permuted inside each 16-dim step (see the file comment), 128B swizzle.
__device__ __forceinline__ int QOffset(int head, int dim) {
  const int step = dim >> 4, p = dim & 15;
  const int kk = (p & 3) < 2 ? 2 * (p >> 2) + (p & 3) : 8 + 2 * (p >> 2) + (p & 3) - 2;
  const int byte = ((step & 3) * 16 + kk) * 2;
  return (step >> 2) * kHalfBytes + head * 128 + ((((byte >> 4) ^ (head & 7))) << 4) + (byte & 15);
}

template <int kRowsPerPass>
__global__ void __launch_bounds__(kThreads, 4) PagedMqaLogitsKeysMKernel(const PagedLogitsArgs p) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint8_t* stage_values = smem;                             // [stages][8192], swizzled
  uint8_t* q_tile = smem + kKeysMStages * kValues;          // [rows][2][64][128 B]
  uint8_t* stage_scales = q_tile + kRowsPerPass * kQBytes;  // [stages][64] fp32
  float* w_smem = reinterpret_cast<float*>(stage_scales + kKeysMStages * kScales);  // [rows][64]

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;
  const int c = lane & 3;

  const int num_requests = p.rows.num_requests;
  const int32_t* __restrict__ prefix = p.schedule.tile_prefix;
  const int total_tiles = __ldg(&prefix[num_requests]);
  const int begin = static_cast<int>(int64_t{total_tiles} * blockIdx.x / gridDim.x);
  const int end = static_cast<int>(int64_t{total_tiles} * (blockIdx.x + 1) / gridDim.x);
  if (begin >= end) return;
  const int num_tiles = end - begin;
  const uint8_t* __restrict__ cache = p.cache.base;

  TileCursor load;
  load.Seek(prefix, num_requests, begin);
  int load_i = 0;
  auto issue = [&]() {
    if (load_i < num_tiles) {
      const int b = load.request;
      const int j = load.tile - __ldg(&prefix[b]);
      const int page = __ldg(&p.rows.page_table[int64_t{b} * p.rows.page_table_stride + j]);
      const int valid = min(kMqaTileKeys, __ldg(&p.schedule.request_max_len[b]) - j * kMqaTileKeys);
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

  int loaded_request = -1, loaded_pass = -1;
  TileCursor cur;
  cur.Seek(prefix, num_requests, begin);
  for (int i = 0; i < num_tiles; ++i) {
    CpAsyncWait<kKeysMStages - 2>();
    __syncthreads();  // the page landed for everyone; everyone is done with the last tile
    issue();

    const int b = cur.request;
    const int base_pos = (cur.tile - __ldg(&prefix[b])) * kMqaTileKeys;
    const int first_row = __ldg(&p.schedule.request_first_row[b]);
    const int nrows = __ldg(&p.schedule.request_num_rows[b]);
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
    const float ks0 = ksc[key0], ks1 = ksc[key0 + 8];

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
          *reinterpret_cast<uint32_t*>(qt + QOffset(head, 4 * quad)) = E4M3x2ToF16x2(codes);
          *reinterpret_cast<uint32_t*>(qt + QOffset(head, 4 * quad + 2)) =
              E4M3x2ToF16x2(codes >> 16);
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
            p.logits[int64_t{row} * p.logits_stride + pos] = c == 0 ? s0 * ks0 : s1 * ks1;
          }
        }
      }
    }
    if (i + 1 < num_tiles) cur.Next(prefix);
  }
  CpAsyncWait<0>();
}

template <int kRowsPerPass>
absl::Status LaunchTyped(const PagedLogitsArgs& args, int num_sms, cudaStream_t stream) {
  auto kernel = PagedMqaLogitsKeysMKernel<kRowsPerPass>;
  constexpr int kSmem = SmemBytes<kRowsPerPass>();
  // The shared-memory opt-in and the occupancy are per device and per instantiation: set
  // them once for each device a rank uses.
  struct PerDevice {
    std::once_flag once;
    int blocks_per_sm = 0;
    cudaError_t err = cudaSuccess;
  };
  static PerDevice per_device[kMaxDevices];
  int device = 0;
  DI_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device), "cudaGetDevice");
  if (device >= kMaxDevices) return absl::UnimplementedError("more than 16 GPUs");
  PerDevice& pd = per_device[device];
  std::call_once(pd.once, [&] {
    pd.err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (pd.err == cudaSuccess) {
      pd.err =
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&pd.blocks_per_sm, kernel, kThreads, kSmem);
    }
  });
  DI_CUDA_RETURN_IF_ERROR(pd.err, "paged mqa logits (keys as M): attributes / occupancy");
  const int blocks_per_sm = pd.blocks_per_sm;
  const int grid = std::max(1, num_sms * std::max(1, blocks_per_sm));
  kernel<<<grid, kThreads, kSmem, stream>>>(args);
  DI_CUDA_RETURN_IF_LAUNCH_ERROR("launch PagedMqaLogitsKeysMKernel");
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchPagedMqaLogitsKeysM(const PagedLogitsArgs& args, int num_sms,
                                       cudaStream_t stream) {
  switch (RowsPerPass(args.rows.num_rows, args.rows.num_requests)) {
    case 1:
      return LaunchTyped<1>(args, num_sms, stream);
    case 2:
      return LaunchTyped<2>(args, num_sms, stream);
    case 3:
      return LaunchTyped<3>(args, num_sms, stream);
    default:
      return LaunchTyped<4>(args, num_sms, stream);
  }
}

}  // namespace decode_indexer::kernels::cuda
