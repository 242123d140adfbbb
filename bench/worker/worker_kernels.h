// The attention worker's own GPU work (bench/worker): q, weights and the new indexer keys of a
// layer, produced deterministically from (token, layer) so that every path of the benchmark
// sends the indexer the same inputs; and a stand-in attention that reads the indexer's answer
// (gathers 16 bytes of a device buffer at each top-k index of a row and reduces them), so that
// the answer is consumed on the worker's stream as a serving stack's attention would.
//
// Every function has a host twin with the same results (the CPU smoke run, and the checks):
// the values are integer hashes and single float multiplies (no contraction differences).
#pragma once

#include <cstddef>
#include <cstdint>

#ifdef __CUDACC__
#define DI_WORKER_HD __host__ __device__
#else
#define DI_WORKER_HD
#endif

namespace decode_indexer::bench_worker {

struct Shape {
  int32_t rows = 0;   // requests x next_n (one row a request here)
  int32_t heads = 0;  // H
  int32_t dim = 0;    // D
  int32_t topk = 0;   // K
};

// One layer's inputs in one buffer: q fp8 [rows, H, D] | weights fp32 [rows, H] | new keys
// fp8 [rows, D] | key scales fp32 [rows]; each part 256-byte aligned.
struct InputLayout {
  uint64_t q = 0, weights = 0, keys = 0, key_scales = 0, bytes = 0;
  static uint64_t Align(uint64_t v) { return (v + 255) / 256 * 256; }
  static InputLayout For(const Shape& s) {
    InputLayout l;
    const uint64_t rows = static_cast<uint64_t>(s.rows);
    l.q = 0;
    l.weights = Align(rows * s.heads * s.dim);
    l.keys = l.weights + Align(rows * s.heads * 4);
    l.key_scales = l.keys + Align(rows * s.dim);
    l.bytes = l.key_scales + Align(rows * 4);
    return l;
  }
};

// What the stand-in attention leaves per (layer, row): the sum of the gathered words, an
// order-independent hash of the indices, the indices out of [0, length) other than the -1
// padding (bad), and the valid ones. Equal across paths when the answers are.
struct AttnOut {
  uint32_t sum = 0;
  uint32_t hash = 0;
  uint32_t bad = 0;
  uint32_t valid = 0;
};

DI_WORKER_HD inline uint64_t Mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
// kind: 1 q, 2 weights, 3 keys, 4 key scales, 5 the stand-in's device buffer, 6 the prefill.
DI_WORKER_HD inline uint64_t ValueHash(uint32_t kind, int32_t token, int32_t layer,
                                       uint64_t index) {
  return Mix64((uint64_t{kind} << 58) ^ (uint64_t(uint32_t(token)) << 38) ^
               (uint64_t(uint32_t(layer)) << 32) ^ index);
}
// An e4m3 code that is never NaN (S.1111.111).
DI_WORKER_HD inline uint8_t Fp8Code(uint64_t h) {
  uint8_t b = static_cast<uint8_t>(h);
  if ((b & 0x7F) == 0x7F) b ^= 1;
  return b;
}
// Weights in about [-0.1, 0.1]: an exact integer times one constant.
DI_WORKER_HD inline float WeightValue(uint64_t h) {
  return static_cast<float>(static_cast<int32_t>(h & 0xFFFF) - 32768) * (1.0f / 327680.0f);
}
// Key scales in [0.001, 0.011): positive, exact integer times one constant.
DI_WORKER_HD inline float KeyScaleValue(uint64_t h) {
  return static_cast<float>((h & 1023) + 100) * (1.0f / 102400.0f);
}
DI_WORKER_HD inline uint32_t IndexHash(int32_t idx) {
  return static_cast<uint32_t>(Mix64(0x51ED27ull ^ uint64_t(uint32_t(idx))) >> 17);
}

// Host twins.
void ProduceHost(const Shape& s, int32_t token, int32_t layer, uint8_t* q, float* weights,
                 uint8_t* keys, float* key_scales);
// The keys and their scales only (what ProduceHost writes there): the ring-ipc-events path,
// whose new keys still go through the ring's host region.
void ProduceKeysHost(const Shape& s, int32_t token, int32_t layer, uint8_t* keys,
                     float* key_scales);
void FillKvHost(uint32_t* kv, int32_t rows, int64_t kv_len);
void AttentionHost(const Shape& s, const int32_t* answer, const uint32_t* kv, int64_t kv_len,
                   int64_t length, AttnOut* out);
// The prefill's keys: `count` fp8 codes rows [count, dim] and scales [count], from `first`.
void FillPrefillHost(uint64_t first, int64_t count, int32_t dim, uint8_t* keys, float* scales);

// CUDA launches on `stream` (a cudaStream_t); answer the cudaError_t (0: success).
int LaunchProduce(const Shape& s, int32_t token, int32_t layer, uint8_t* q, float* weights,
                  uint8_t* keys, float* key_scales, void* stream);
int LaunchFillKv(uint32_t* kv, int32_t rows, int64_t kv_len, void* stream);
int LaunchAttention(const Shape& s, const int32_t* answer, const uint32_t* kv, int64_t kv_len,
                    int64_t length, AttnOut* out, void* stream);

}  // namespace decode_indexer::bench_worker
