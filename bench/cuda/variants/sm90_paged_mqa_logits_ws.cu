// A comparison variant, built only with the benchmarks (MqaVariant::kWgmmaKeysMPipelinedWs2 /
// Ws4, mqa_variants.h): the exact pipelined kernel's one-row math with a producer warpgroup and
// 2 or 4 consumer warpgroups (setmaxnreg). Its logits are the production exact kernel's bit for
// bit (gpu_variants_test); measured slower (docs/notes/cuda.md v7, docs/results/cuda-bench.md
// 14:54), kept to time against while the consumer gets leaner.
#include <algorithm>
#include <climits>

#include "absl/strings/str_cat.h"
#include "bench/cuda/variants/mqa_variants.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/sm90_device_utils.cuh"
#include "kernels/cuda/sm90_heuristics.h"
#include "kernels/cuda/sm90_launch_setup.cuh"
#include "kernels/cuda/sm90_launchers.h"
#include "kernels/cuda/sm90_mqa_keys_m.cuh"
#include "kernels/cuda/sm90_mqa_pipeline.cuh"
#include "kernels/cuda/sm90_tile_config.h"

namespace decode_indexer::kernels::cuda {
namespace {

constexpr int kHeads = 64;
constexpr int kConsumerThreads = kPipeConsumerThreads;  // one warpgroup
constexpr int kConsumerWarps = kPipeConsumerWarps;
constexpr int kValues = kPipeSlotValues;           // 8192: a page's e4m3 codes
constexpr int kScales = kPipeSlotScales;           // 256: its fp32 scales
constexpr int kPageBytes = kPipePageBytes;         // 8448
constexpr int kQBytes = kHeads * kMqaHeadDim * 2;  // one row's q in f16: 16 KB
constexpr int kHalfBytes = kHeads * 128;           // 64 dims of q: one swizzled tile
constexpr int kQBarrier = kPipeQBarrier;           // named barriers kQBarrier + consumer
static_assert(kHalfBytes == kKeysMQHalfBytes, "QOffset's q tile layout");

// The producer warpgroup drops to kWsProducerRegs registers (setmaxnreg) and the 2 (2 blocks per
// SM) or 4 (1 block) consumer warpgroups take the rest, alternating tiles over one ring of
// kWsStagesPerConsumer slots per consumer. Producer registers: at 32 / 48 its unrolled cp.async
// loop spilled (ptxas -v: 330 / 200 bytes); at 64 the kernel spills ~30-100 bytes and the
// half-page consumer still fits (88 registers with 2 consumers, 104 with 4).
constexpr int kWsProducerRegs = 64;
constexpr int kWsStagesPerConsumer = 4;

template <bool kShared>
using Cursor = ScheduleCursor<kShared>;

// Half `kHalf` of WidenPage: k-steps 4 kHalf .. 4 kHalf + 3 into a[0..3] (the same instructions).
template <int kWiden, int kHalf>
__device__ __forceinline__ void WidenHalfPage(const uint8_t* kv, int warp, int lane,
                                              uint32_t (&a)[4][4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
    WidenKSteps<kWiden>(kv, warp, lane, 2 * kHalf + h, a[2 * h], a[2 * h + 1]);
}

// ---- v7: a producer warpgroup and several consumer warpgroups (setmaxnreg) ----
//
// Why: v6 is latency bound with 3 consumer warpgroups per SM (its producer warp costs as many
// registers per lane as a consumer, docs/notes/cuda.md v6). Here the producer is a whole
// warpgroup that gives registers back (setmaxnreg.dec; its 4 warps fill the ring, tiles pw,
// pw + 4, ...) and kConsumers consumer warpgroups take them (setmaxnreg.inc), so an SM runs 4
// consumer warpgroups. Tile i of the block goes to consumer i % kConsumers through ring slot
// i % stages (stages a multiple of 4 and of kConsumers: one producer warp and one consumer per
// slot); each consumer keeps its own q. One row per pass only (next_n 1): the per-entry math is
// v6's one-row path (split widening, 8 wgmma in order, the same epilogue; the A fragments are
// widened half a page at a time), so the logits are keys-M's bit for bit.
// Measured slower than v6 (docs/notes/cuda.md, v7): selectable, not the default.
template <int kConsumers>
struct WsConfig {
  static constexpr int kThreads = kConsumerThreads * (kConsumers + 1);
  static constexpr int kMinBlocks = kConsumers == 2 ? 2 : 1;
  static constexpr int kStages = kWsStagesPerConsumer * kConsumers;
  // What __launch_bounds__ gives every thread, and the split after setmaxnreg: the consumers
  // take what the producer warpgroup gives back (the pool is per block).
  static constexpr int kLaunchRegs = std::min(248, (65536 / (kThreads * kMinBlocks)) & ~7);
  static constexpr int kProducerRegs = kWsProducerRegs;
  static constexpr int kConsumerRegs =
      std::min(240, ((kThreads * kLaunchRegs - kConsumerThreads * kProducerRegs) /
                     (kConsumerThreads * kConsumers)) &
                        ~7);
  static_assert(kConsumerRegs >= kLaunchRegs, "setmaxnreg.inc below the launch count");
};

template <int kConsumers, bool kOwnSchedule>
constexpr int WsSmemBytes() {
  constexpr int kS = WsConfig<kConsumers>::kStages;
  return kS * kValues + kConsumers * kQBytes + kS * kScales + kConsumers * kHeads * 4 +
         kConsumers * 16 + 2 * kS * 8 + (kOwnSchedule ? kOwnScheduleBytes : 0) + 1024;
}

template <int kConsumers, bool kOwnSchedule>
__global__ void __launch_bounds__(WsConfig<kConsumers>::kThreads, WsConfig<kConsumers>::kMinBlocks)
    PagedMqaLogitsWsKernel(const PagedLogitsArgs p) {
  using Cfg = WsConfig<kConsumers>;
  constexpr int kS = Cfg::kStages;
  constexpr int kThreadsWs = Cfg::kThreads;
  constexpr int kWiden = kWidenSplit;  // v6's one-row choice
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint8_t* stage_values = smem;                            // [stages][8192], swizzled
  uint8_t* q_tiles = smem + kS * kValues;                  // [consumers][2][64][128 B]
  uint8_t* stage_scales = q_tiles + kConsumers * kQBytes;  // [stages][64] fp32
  float* w_all = reinterpret_cast<float*>(stage_scales + kS * kScales);        // [consumers][64]
  int32_t* len_all = reinterpret_cast<int32_t*>(w_all + kConsumers * kHeads);  // [consumers][4]
  uint64_t* full = reinterpret_cast<uint64_t*>(len_all + 4 * kConsumers);
  uint64_t* empty = full + kS;
  int32_t* own = reinterpret_cast<int32_t*>(empty + kS);

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;

  if (tid == 0) {
    for (int s = 0; s < kS; ++s) {
      MbarInit(&full[s], 32);               // one cp.async arrival per producer lane
      MbarInit(&empty[s], kConsumerWarps);  // one arrival per warp of the consuming warpgroup
    }
  }

  const int num_requests = p.rows.num_requests;
  const int32_t* prefix = p.schedule.tile_prefix;
  const int32_t* req_first_row = p.schedule.request_first_row;
  const int32_t* req_num_rows = p.schedule.request_num_rows;
  const int32_t* req_max_len = p.schedule.request_max_len;
  if constexpr (kOwnSchedule) {
    // As v6 (and keys-M fused): the schedule kernel's numbers, built in shared memory.
    BuildOwnSchedule<kThreadsWs>(p, own, tid, num_requests, prefix, req_first_row, req_num_rows,
                                 req_max_len);
  }
  __syncthreads();  // barriers initialised (and the schedule built) for everyone
  const int total_tiles = Ld<kOwnSchedule>(&prefix[num_requests]);
  const int begin = static_cast<int>(int64_t{total_tiles} * blockIdx.x / gridDim.x);
  const int end = static_cast<int>(int64_t{total_tiles} * (blockIdx.x + 1) / gridDim.x);
  if (begin >= end) return;  // the whole block: no setmaxnreg is left waiting
  const int num_tiles = end - begin;
  const int wg = tid / kConsumerThreads;

  if (wg == kConsumers) {
    // ---- Producer warpgroup: registers back to the pool; v6's producer loop per warp. ----
    SetMaxNRegDec<Cfg::kProducerRegs>();
    // Four producer warps, tiles pw, pw + 4, ... each (one warp fed 2-4 consumers too slowly:
    // measured 11:10, 2.4x slower than v6). Stages are a multiple of 4, so each slot has one
    // producer warp.
    const int pw = warp - kConsumers * kConsumerWarps;
    if (pw >= num_tiles) return;
    const uint8_t* __restrict__ cache = p.cache.base;
    Cursor<kOwnSchedule> load;
    load.Seek(prefix, num_requests, begin + pw);
    auto locate = [&](int& page, int& valid) {
      const int b = load.request;
      const int j = load.tile - Ld<kOwnSchedule>(&prefix[b]);
      page = __ldg(&p.rows.page_table[PageRowBase(p.rows, b) + j]);
      valid = min(kMqaTileKeys, Ld<kOwnSchedule>(&req_max_len[b]) - j * kMqaTileKeys);
    };
    int next_page, next_valid;
    locate(next_page, next_valid);
    for (int i = pw; i < num_tiles; i += kConsumerWarps) {
      const int page = next_page, valid = next_valid;
      if (i + kConsumerWarps < num_tiles) {
        for (int k = 0; k < kConsumerWarps; ++k) load.Next(prefix);
        locate(next_page, next_valid);
      }
      const int st = i % kS;
      if (i >= kS) MbarWait(&empty[st], ((i / kS) + 1) & 1);
      const uint8_t* src = cache + int64_t{page} * kPageBytes;
      uint8_t* dv = stage_values + st * kValues;
      uint8_t* ds = stage_scales + st * kScales;
      CopyPageToStage(src, dv, ds, valid, lane);
      CpAsyncMbarArrive(&full[st]);
    }
    CpAsyncWait<0>();
    return;
  }

  // ---- Consumer warpgroup `wg`: tiles wg, wg + kConsumers, ... of the block. ----
  SetMaxNRegInc<Cfg::kConsumerRegs>();
  const int cw = warp % kConsumerWarps;  // warp inside the warpgroup: its 16 keys of a page
  const int ctid = tid % kConsumerThreads;
  const int q_barrier = kQBarrier + wg;
  // This consumer's q tile and thread index pass through an opaque move at each use: otherwise
  // nvcc hoists the q store addresses (64 of them) and the 8 wgmma descriptors out of the loop as
  // invariants, and the consumer spilled ~1 KB; they are cheap to recompute (q loads are rare).
  auto opaque = [](int v) {
    int r;
    asm volatile("mov.b32 %0, %1;\n" : "=r"(r) : "r"(v));
    return r;
  };
  const int q_offset = wg * kQBytes;
  auto my_q_tile = [&]() { return q_tiles + opaque(q_offset); };
  float* w_smem = w_all + wg * kHeads;
  int32_t* len_smem = len_all + 4 * wg;
  const int g = lane >> 2;
  const int c = lane & 3;
  int loaded_request = -1, loaded_row = -1;
  // Row `row`'s q, weights and length into this consumer's slots (v6's load_q for one row).
  auto load_q = [&](int b, int row) {
    NamedBarrierSync(q_barrier, kConsumerThreads);
    uint8_t* q_tile = my_q_tile();
    const int qtid = opaque(ctid);
    loaded_request = b;
    loaded_row = row;
    constexpr int kItems = kHeads * 8;  // 16 codes each: 4 per thread
    static_assert(kItems == 4 * kConsumerThreads, "one round of q loads");
    uint4 codes[4];
    float wv[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int it = u * kConsumerThreads + qtid;
      const int head = it / 8, oct = it % 8;
      codes[u] = __ldg(
          reinterpret_cast<const uint4*>(p.q.codes + (int64_t{row} * kHeads + head) * kMqaHeadDim) +
          oct);
      wv[u] = oct == 0 ? __ldg(&p.q.weights[int64_t{row} * kHeads + head]) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int it = u * kConsumerThreads + qtid;
      const int head = it / 8, oct = it % 8;
      StoreQQuad<kWiden>(q_tile, head, 4 * oct + 0, codes[u].x);
      StoreQQuad<kWiden>(q_tile, head, 4 * oct + 1, codes[u].y);
      StoreQQuad<kWiden>(q_tile, head, 4 * oct + 2, codes[u].z);
      StoreQQuad<kWiden>(q_tile, head, 4 * oct + 3, codes[u].w);
      if (oct == 0) w_smem[head] = wv[u];
    }
    if (qtid == 0) len_smem[0] = __ldg(&p.rows.row_length[row]);
    FenceProxyAsyncShared();  // st.shared before the wgmmas' (async proxy) reads of q
    NamedBarrierSync(q_barrier, kConsumerThreads);
  };

  // The loop runs over this consumer's tiles only (a branch around the wgmmas would make ptxas
  // serialize them, C7520); the cursor steps over the other consumers' tiles.
  Cursor<kOwnSchedule> cur;
  cur.Seek(prefix, num_requests, min(begin + wg, end - 1));
  for (int i = wg; i < num_tiles; i += kConsumers) {
    const int b = cur.request;
    const int base_pos = (cur.tile - Ld<kOwnSchedule>(&prefix[b])) * kMqaTileKeys;
    const int first_row = Ld<kOwnSchedule>(&req_first_row[b]);
    const int nrows = Ld<kOwnSchedule>(&req_num_rows[b]);
    const int st = i % kS;
    MbarWait(&full[st], (i / kS) & 1);
    const uint8_t* kv = stage_values + st * kValues;
    const float* ksc = reinterpret_cast<const float*>(stage_scales + st * kScales);
    const int key0 = cw * 16 + g;
    // Bit moves: the sums are 2^-8 times the true ones (exactly); 256 * ks is exact too.
    const float ks0 = 256.f * ksc[key0];
    const float ks1 = 256.f * ksc[key0 + 8];

    for (int rin = 0; rin < nrows; ++rin) {
      const int row = first_row + rin;
      if (row != loaded_row) load_q(b, row);  // warpgroup-uniform
      const uint8_t* q_tile = my_q_tile();
      // Half a page of A fragments at a time (16 registers fewer than v6's 32, so the consumer
      // fits its setmaxnreg share): k-steps 0-3, wait, then 4-7 into the same accumulators in
      // the same order as v6, so the same sums.
      float acc[32];
      uint32_t a[4][4];
      WidenHalfPage<kWiden, 0>(kv, cw, lane, a);
      WgmmaFence();
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        WgmmaM64N64K16F16(acc, a[ks], SmemDescSw128(q_tile + ks * 32), ks);
      }
      WgmmaCommit();
      WgmmaWait<0>();  // the wgmmas read a[] until they complete
      WidenHalfPage<kWiden, 1>(kv, cw, lane, a);
      WgmmaFence();
#pragma unroll
      for (int ks = 4; ks < 8; ++ks) {
        WgmmaM64N64K16F16(acc, a[ks - 4], SmemDescSw128(q_tile + kHalfBytes + (ks & 3) * 32), ks);
      }
      WgmmaCommit();
      WgmmaWait<0>();
      // v6's epilogue: relu * w over this thread's heads, then the 4 lanes of the group.
      // (16 fewer live registers than v6)
      float s0, s1;
      KeysMHeadSums(
          acc, [&](int j, int e) { return w_smem[8 * j + 2 * c + e]; }, s0, s1);
      if (c < 2) {
        const int pos = base_pos + key0 + 8 * c;
        if (pos < len_smem[0])
          p.logits[int64_t{row} * p.logits_stride + pos] = c == 0 ? s0 * ks0 : s1 * ks1;
      }
    }
    // The slot is no longer read: back to the producer (here, not inside the row loop: a branch
    // between the wgmmas made ptxas serialize them, C7520).
    __syncwarp();
    if (lane == 0) MbarArrive(&empty[st]);
    for (int k = 1; k <= kConsumers && i + k < num_tiles; ++k) cur.Next(prefix);
  }
}

template <int kConsumers, bool kOwnSchedule>
absl::Status LaunchWs(const PagedLogitsArgs& args, int num_sms, cudaStream_t stream) {
  using Cfg = WsConfig<kConsumers>;
  auto kernel = PagedMqaLogitsWsKernel<kConsumers, kOwnSchedule>;
  constexpr int kSmem = WsSmemBytes<kConsumers, kOwnSchedule>();
  static KernelDeviceSetup per_device[kMaxDevices];
  const absl::StatusOr<const KernelDeviceSetup*> setup =
      SetUpOncePerDevice(per_device, "paged mqa logits (warp-specialized): attributes / occupancy",
                         [&](KernelDeviceSetup& d) {
                           cudaError_t err = cudaFuncSetAttribute(
                               kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
                           cudaFuncAttributes attr{};
                           if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, kernel);
                           d.regs = attr.numRegs;
                           if (err == cudaSuccess) {
                             err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                                 &d.blocks_per_sm, kernel, Cfg::kThreads, kSmem);
                           }
                           return err;
                         });
  if (!setup.ok()) return setup.status();
  const KernelDeviceSetup& pd = **setup;
  // setmaxnreg.inc waits for registers the block does not have if ptxas allocated fewer than
  // planned: that would hang, so refuse instead.
  if (pd.regs * Cfg::kThreads <
      kConsumerThreads * (Cfg::kProducerRegs + kConsumers * Cfg::kConsumerRegs)) {
    return absl::InternalError(absl::StrCat("paged mqa logits (warp-specialized): ", pd.regs,
                                            " registers per thread, fewer than the plan's ",
                                            Cfg::kLaunchRegs));
  }
  const int grid = std::max(1, num_sms * std::max(1, pd.blocks_per_sm));
  kernel<<<grid, Cfg::kThreads, kSmem, stream>>>(args);
  DI_CUDA_RETURN_IF_LAUNCH_ERROR("launch PagedMqaLogitsWsKernel");
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchPagedMqaLogitsWs(MqaVariant v, const PagedLogitsArgs& args, int num_sms,
                                    cudaStream_t stream) {
  // One row per pass only; several rows per pass run the production exact kernel.
  if (DenseRowsPerPass(args.rows) != 1) return LaunchPagedMqaLogitsPipelined(args, num_sms, stream);
  const bool own = DenseComputesOwnSchedule(args.rows);
  if (v == MqaVariant::kWgmmaKeysMPipelinedWs2) {
    return own ? LaunchWs<2, true>(args, num_sms, stream)
               : LaunchWs<2, false>(args, num_sms, stream);
  }
  return own ? LaunchWs<4, true>(args, num_sms, stream) : LaunchWs<4, false>(args, num_sms, stream);
}

}  // namespace decode_indexer::kernels::cuda
