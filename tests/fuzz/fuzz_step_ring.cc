// The step ring's descriptor parser (server/service/step_ring.cc, ReadDescriptor: what the
// poller does with a descriptor slot a client wrote into shared memory) on arbitrary bytes:
// byte 0 picks the profile, the ring's geometry and the step data after the ring, byte 1 the
// descriptor's number; the rest is the slot (descriptor and columns; zeros past the input).
// The slot is a buffer of exactly slot_bytes, so ASan sees any read past it. Parsing must never
// crash, refuse only with INVALID_ARGUMENT naming a field, and an accepted descriptor must be
// the request its slot says (columns copied, region id set) with every offset it uses past the
// ring, and every tensor the region's bounds check (SharedMemoryRegion::Span) lets through
// inside the region.
#include <sys/mman.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "absl/strings/match.h"
#include "common/step_ring.h"
#include "server/config/profile.h"
#include "server/service/data_plane.h"
#include "server/service/step_ring.h"

namespace {

using decode_indexer::config::Profile;
namespace ring = decode_indexer::ring;
namespace service = decode_indexer::service;
namespace v1 = decode_indexer::v1;

void Check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz_step_ring: %s\n", what);
    std::abort();
  }
}

// The fields a refusal may name (its message starts "<field>: ").
bool NamesAField(const absl::Status& s) {
  static const char* const kFields[] = {"sequence",
                                        "sequence_count",
                                        "row_lengths_count",
                                        "flags",
                                        "answer_encoding",
                                        "shared_memory.q_offset",
                                        "shared_memory.q_scales_offset",
                                        "shared_memory.weights_offset",
                                        "shared_memory.positions_offset",
                                        "shared_memory.new_keys_offset",
                                        "shared_memory.new_key_scales_offset",
                                        "shared_memory.answer_offset",
                                        "shared_memory.candidates_offset"};
  for (const char* f : kFields) {
    if (absl::StartsWith(s.message(), std::string(f) + ": ")) return true;
  }
  return false;
}

// A tensor's bytes from its shape, saturating (the bounds check must refuse a huge span).
uint64_t Bytes(const v1::Tensor& t) {
  uint64_t elem_num = 1, elem_den = 1;
  switch (t.dtype()) {
    case v1::DTYPE_FP32:
    case v1::DTYPE_INT32:
      elem_num = 4;
      break;
    case v1::DTYPE_BF16:
      elem_num = 2;
      break;
    case v1::DTYPE_FP4_E2M1:
      elem_den = 2;
      break;
    case v1::DTYPE_INT64:
      elem_num = 8;
      break;
    default:
      break;
  }
  unsigned __int128 n = elem_num;
  for (int64_t d : t.shape()) {
    if (d < 0) return std::numeric_limits<uint64_t>::max();
    n *= static_cast<uint64_t>(d);
    if (n > std::numeric_limits<uint64_t>::max()) return std::numeric_limits<uint64_t>::max();
  }
  return static_cast<uint64_t>((n + elem_den - 1) / elem_den);
}

// A Span the region lets through lies inside it.
void CheckSpan(const service::SharedMemoryRegion& region, const char* field, uint64_t offset,
               uint64_t bytes) {
  absl::StatusOr<uint8_t*> at = region.Span(field, offset, bytes);
  if (!at.ok()) {
    Check(at.status().code() == absl::StatusCode::kInvalidArgument, "a Span refusal's code");
    return;
  }
  const uint8_t* base = region.base();
  Check(*at >= base && static_cast<uint64_t>(*at - base) == offset, "a Span's start");
  Check(offset <= region.size() && bytes <= region.size() - offset, "a Span's end");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const Profile v32 = *decode_indexer::config::BuiltinProfile("v32");
  static const Profile v41 = *decode_indexer::config::BuiltinProfile("v41");
  if (size < 2) return 0;
  // mode: bit 0 v41; bits 1-2 slots 1, 4, 16, 64; bits 3-4 slot_bytes 1 KiB .. 64 KiB;
  // bits 5-6 the step data after the ring: 1 byte, 4 KiB, 1 MiB, 16 MiB.
  const uint8_t mode = data[0];
  const Profile& profile = (mode & 1) ? v41 : v32;
  static const uint32_t kSlots[] = {1, 4, 16, 64};
  static const uint32_t kSlotBytes[] = {1024, 4096, 16384, 65536};
  static const uint64_t kData[] = {1, 4096, 1 << 20, 16 << 20};
  service::StepRingConfig config;
  config.region_id = 0x5eed;
  config.slots = kSlots[(mode >> 1) & 3];
  config.slot_bytes = kSlotBytes[(mode >> 3) & 3];
  const uint64_t ring_bytes = ring::RingBytes(config.slots, config.slot_bytes);
  const uint64_t n = 1 + uint64_t{data[1]};
  data += 2;
  size -= 2;

  std::vector<uint8_t> slot(config.slot_bytes, 0);
  std::memcpy(slot.data(), data, std::min<size_t>(size, slot.size()));
  std::vector<uint8_t> columns(config.slot_bytes);
  ring::StepDescriptor d;
  v1::DecodeStepRequest out;
  const absl::Status s =
      service::ReadDescriptor(slot.data(), n, config, ring_bytes, profile, d, columns, out);
  static const bool verbose = std::getenv("DI_FUZZ_VERBOSE") != nullptr;
  if (verbose) std::fprintf(stderr, "fuzz_step_ring: %s\n", s.ToString().c_str());
  if (!s.ok()) {
    if (s.code() != absl::StatusCode::kInvalidArgument || !NamesAField(s) ||
        s.message().size() > 4096) {
      std::fprintf(stderr, "bad refusal: %.300s\n", s.ToString().c_str());
      std::abort();
    }
    return 0;
  }
  // The request the slot says.
  Check(d.sequence == n, "accepted another descriptor's number");
  Check(std::memcmp(&d, slot.data(), sizeof(d)) == 0, "the descriptor snapshot");
  const ring::ColumnOffsets c = ring::ColumnsOf(d.flags, d.sequence_count, d.row_lengths_count);
  Check(c.end <= config.slot_bytes, "columns past the slot");
  Check(out.sequence_ids_size() == static_cast<int>(d.sequence_count) &&
            (d.sequence_count == 0 ||
             std::memcmp(out.sequence_ids().data(), slot.data() + c.sequence_ids,
                         8 * d.sequence_count) == 0),
        "sequence_ids");
  Check(out.row_lengths_size() == static_cast<int>(d.row_lengths_count) &&
            (d.row_lengths_count == 0 ||
             std::memcmp(out.row_lengths().data(), slot.data() + c.row_lengths,
                         4 * d.row_lengths_count) == 0),
        "row_lengths");
  Check(out.step_id() == d.step_id && out.layer() == d.layer, "step_id / layer");
  Check(out.answer_encoding() == v1::ANSWER_ENCODING_RAW, "answer_encoding");
  Check(out.has_shared_memory() && out.shared_memory().region_id() == config.region_id,
        "shared_memory.region_id");
  const v1::SharedMemoryStep& sm = out.shared_memory();
  const bool ipc = out.has_cuda_ipc();
  Check(ipc == ((d.flags & ring::kAnswerCudaIpc) != 0), "cuda_ipc");
  // kInputsCudaIpc (only with kAnswerCudaIpc): q, its scales and the weights are the device
  // buffer's, at the descriptor's offsets, and none of them is read from the region.
  const bool device_q = (d.flags & ring::kInputsCudaIpc) != 0;
  Check(!device_q || ipc, "flags");
  // kKeysCudaIpc (only with kAnswerCudaIpc): the new keys and their scales are the device
  // buffer's (cuda_ipc.new_keys_offset / new_key_scales_offset), never read from the region.
  const bool device_keys = (d.flags & ring::kKeysCudaIpc) != 0;
  Check(!device_keys || ipc, "flags: kKeysCudaIpc");
  Check(device_keys == (ipc && out.cuda_ipc().has_new_keys_offset()), "cuda_ipc.new_keys_offset");
  if (device_keys) {
    Check(out.cuda_ipc().new_keys_offset() == d.new_keys_offset && !sm.has_new_keys_offset() &&
              !sm.has_new_key_scales_offset(),
          "cuda_ipc keys offsets");
    Check(!out.has_new_key_scales() ||
              out.cuda_ipc().new_key_scales_offset() == d.new_key_scales_offset,
          "cuda_ipc.new_key_scales_offset");
  }
  // The events' flags ride on the CUDA IPC step only, the inputs' on device inputs (q or the
  // new keys) only.
  const bool wait_inputs = (d.flags & ring::kWaitInputsEvent) != 0;
  const bool record_answer = (d.flags & ring::kRecordAnswerEvent) != 0;
  Check(!wait_inputs || device_q || device_keys, "flags: kWaitInputsEvent");
  Check(!record_answer || ipc, "flags: kRecordAnswerEvent");
  Check(!ipc || (out.cuda_ipc().wait_inputs_event() == wait_inputs &&
                 out.cuda_ipc().record_answer_event() == record_answer),
        "cuda_ipc events");
  Check(device_q == (ipc && out.cuda_ipc().has_q_offset()), "cuda_ipc.q_offset");
  if (device_q) {
    Check(out.cuda_ipc().q_offset() == d.q_offset &&
              out.cuda_ipc().weights_offset() == d.weights_offset && sm.q_offset() == 0 &&
              sm.q_scales_offset() == 0 && sm.weights_offset() == 0,
          "cuda_ipc offsets");
  }

  // Every offset it uses lies past the ring, and what the region's check lets through lies
  // inside the region.
  const uint64_t region_bytes = ring_bytes + kData[(mode >> 5) & 3];
  void* base =
      mmap(nullptr, region_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  Check(base != MAP_FAILED, "mmap");
  const service::SharedMemoryRegion region(base, region_bytes, 0);  // unmaps it
  const uint64_t rows = static_cast<uint64_t>(out.q().shape_size() > 0 ? out.q().shape(0) : 0);
  struct Used {
    const char* field;
    bool used;
    uint64_t offset;
    uint64_t bytes;
  };
  const Used used[] = {
      {"q_offset", !device_q, sm.q_offset(), Bytes(out.q())},
      {"q_scales_offset", !device_q && out.has_q_scales(), sm.q_scales_offset(),
       Bytes(out.q_scales())},
      {"weights_offset", !device_q, sm.weights_offset(), Bytes(out.weights())},
      {"positions_offset", out.has_positions(), sm.positions_offset(), Bytes(out.positions())},
      {"new_keys_offset", out.has_new_keys() && !device_keys, sm.new_keys_offset(),
       Bytes(out.new_keys())},
      {"new_key_scales_offset", out.has_new_key_scales() && !device_keys,
       sm.new_key_scales_offset(), Bytes(out.new_key_scales())},
      {"answer_offset", !ipc, sm.answer_offset(), rows * uint64_t(profile.topk) * 4},
      {"candidates_offset", !ipc && out.return_candidates(), sm.candidates_offset(),
       rows * uint64_t(profile.num_candidate_blocks) * 4},
  };
  for (const Used& u : used) {
    if (!u.used) continue;
    Check(u.offset >= ring_bytes, u.field);
    CheckSpan(region, u.field, u.offset, u.bytes);
    if (verbose) {
      std::fprintf(stderr, "  %s %llu +%llu: %s\n", u.field,
                   static_cast<unsigned long long>(u.offset),
                   static_cast<unsigned long long>(u.bytes),
                   region.Span(u.field, u.offset, u.bytes).ok() ? "inside" : "refused");
    }
  }
  return 0;
}
