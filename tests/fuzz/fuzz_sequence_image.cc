// The untrusted sequence-image decoders on arbitrary bytes: the SequenceChunk stream of
// ImportSequence (server/service/sequence_transfer.cc: header, profile identity, CRC-32s,
// order, sizes), the executor's checks of the image it builds (entries, candidates), and the
// snapshot file a restart reads (server/service/snapshot.cc: magic, framed records, their
// CRC-32s, the header and end records). A CPU executor of a tiny v41-style profile takes what
// they accept, so every accepted image is imported for real.
//
// Input: a mode byte, then what its kind (mode & 3) reads:
//   0: a count byte N, N records [u16 LE length][a SequenceChunk], then lifecycle ops (3 bytes
//     each: op, u16 LE length). The chunks go to a SequenceAssembler, as ImportSequence feeds
//     them; an accepted image is imported as sequence 1; the ops truncate sequence 1 or fork
//     it into a new id; every live sequence is then exported and compared with a model of
//     what the image and the ops must have left.
//   1: the same chunk records, made into a snapshot file (magic, a right header record, each
//     chunk as an ImportSequenceRequest record, a right end record) that RestoreSnapshot reads.
//   2: records [u16 LE length][payload] to the end, framed as a snapshot file's records (the
//     target writes the magic, each length and the right CRC-32): the header and end texts
//     and the sequence records are the input's.
//   3: the snapshot file itself, byte for byte.
//   mode & 4: keep the chunks' CRC-32s as given (else the target sets them right, so the
//   fuzzer gets past them); mode & 8: keep the header chunk's profile name and hash as given
//   (else this server's).
// Refusals must carry a bounded, non-empty message of an expected code; an accepted image must
// survive emit -> assemble unchanged, and import -> export up to the zeroed padding.
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <google/protobuf/stubs/logging.h>

#include "absl/strings/str_cat.h"
#include "decode_indexer/v1/indexer.pb.h"
#include "server/config/profile.h"
#include "server/exec/executor.h"
#include "server/service/sequence_transfer.h"
#include "server/service/snapshot.h"
#include "spdlog/spdlog.h"

namespace {

namespace config = decode_indexer::config;
namespace exec = decode_indexer::exec;
namespace kernels = decode_indexer::kernels;
namespace service = decode_indexer::service;
namespace v1 = decode_indexer::v1;

// tests/service/profiles/v41-tiny.toml: an FP8 cache (page 2112 bytes) and two FP4 caches
// (1088 bytes), a source and two consumers; pages of 16 entries.
constexpr char kProfile[] = R"(
base = "v41"
name = "v41-tiny"
num_heads = 8
topk = 48
page_size = 16
max_context = 4096
candidate_block_size = 8
num_candidate_blocks = 12
max_rows_per_sequence = 4
[rope]
style = "interleaved"
dim_offset = 64
dim = 64
theta = 10000.0
[[layers]]
layer = 0
role = "dense"
cache_format = "fp8"
[[layers]]
layer = 1
role = "dense"
cache_format = "fp4"
[[layers]]
layer = 2
role = "source"
cache_format = "fp4"
[[layers]]
layer = 3
role = "consumer"
cache_layer = 2
[[layers]]
layer = 4
role = "consumer"
cache_layer = 2
)";

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "fuzz_sequence_image: %s\n", what.c_str());
  std::abort();
}

void Verbose(const char* stage, const absl::Status& s) {
  if (std::getenv("DI_FUZZ_VERBOSE") != nullptr) {
    std::fprintf(stderr, "%s: %s\n", stage, s.ToString().substr(0, 300).c_str());
  }
}

// A refusal: one of `codes`, with a message that says something and stays bounded (no echo of
// unbounded input).
void CheckRefusal(const char* stage, const absl::Status& s,
                  std::initializer_list<absl::StatusCode> codes) {
  bool known = false;
  for (absl::StatusCode c : codes) known = known || s.code() == c;
  if (!known || s.message().empty() || s.message().size() > 4096) {
    Fail(absl::StrCat(stage, ": bad refusal (", s.message().size(),
                      " bytes): ", s.ToString().substr(0, 300)));
  }
}

struct Fixture {
  config::Profile profile;
  std::unique_ptr<exec::Executor> executor;
  std::vector<kernels::CacheGeometry> geometry;  // per pool
  std::string dir;

  Fixture() {
    spdlog::set_level(spdlog::level::off);
    // Fuzzed header strings are often not UTF-8: protobuf logs each such parse (and refuses it).
    google::protobuf::SetLogHandler(nullptr);
    absl::StatusOr<config::Profile> p = config::ParseProfileText(kProfile, "toml");
    if (!p.ok()) Fail(p.status().ToString());
    profile = *p;
    exec::ExecutorOptions o;
    o.backend = "cpu";
    o.ranks = 1;
    o.cpu_threads = 1;
    o.cache_pages = 2048;
    o.max_sequences = 64;
    o.max_requests_per_step = 8;
    absl::StatusOr<std::unique_ptr<exec::Executor>> e = exec::Executor::Create(profile, o);
    if (!e.ok()) Fail(e.status().ToString());
    executor = *std::move(e);
    for (int32_t layer : profile.CacheLayers()) {
      geometry.push_back({profile.layers[layer].cache_format, profile.head_dim, profile.page_size});
    }
    char tmpl[] = "/tmp/di-fuzz-image-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) Fail("mkdtemp");
    dir = tmpl;
    if (std::getenv("DI_FUZZ_VERBOSE") != nullptr) {
      std::fprintf(stderr, "profile %s, CacheIdentityHash %llu\n", profile.name.c_str(),
                   static_cast<unsigned long long>(config::CacheIdentityHash(profile)));
    }
  }

  void ReleaseAll() {
    for (uint64_t id : executor->SequenceIds()) {
      if (!executor->ReleaseSequence(id).ok()) Fail("release");
    }
  }
};

Fixture& F() {
  static Fixture* f = new Fixture();
  return *f;
}

// `c` cut to its first `length` entries, the slots past them in the last page zeroed (what
// an export says).
exec::CacheImage Cut(const exec::CacheImage& c, int64_t length, const kernels::CacheGeometry& g) {
  exec::CacheImage out;
  out.cache_layer = c.cache_layer;
  out.length = std::min(length, c.length);
  const int64_t P = g.page_size, V = g.value_bytes(), S = g.scale_bytes();
  const int64_t pages = (out.length + P - 1) / P;
  out.pages = c.pages.substr(0, static_cast<size_t>(pages * g.page_bytes()));
  const int64_t used = out.length % P;
  if (used != 0) {
    char* last = out.pages.data() + out.pages.size() - g.page_bytes();
    std::memset(last + used * V, 0, (P - used) * V);
    std::memset(last + P * V + used * S, 0, (P - used) * S);
  }
  return out;
}

bool SameCandidates(const exec::CandidateImage& a, const exec::CandidateImage& b) {
  return a.source_layer == b.source_layer && a.length == b.length &&
         a.row_lengths == b.row_lengths && a.blocks == b.blocks;
}

void CheckSame(const char* what, const exec::SequenceImage& got, const exec::SequenceImage& want) {
  if (got.caches.size() != want.caches.size()) Fail(absl::StrCat(what, ": cache count"));
  for (size_t i = 0; i < got.caches.size(); ++i) {
    const exec::CacheImage& g = got.caches[i];
    const exec::CacheImage& w = want.caches[i];
    if (g.cache_layer != w.cache_layer || g.length != w.length || g.pages != w.pages) {
      Fail(absl::StrCat(what, ": cache ", i, " differs (length ", g.length, " vs ", w.length, ", ",
                        g.pages.size(), " vs ", w.pages.size(), " bytes)"));
    }
  }
  if (got.candidates.size() != want.candidates.size()) {
    Fail(absl::StrCat(what, ": ", got.candidates.size(), " candidate sets, expected ",
                      want.candidates.size()));
  }
  for (size_t i = 0; i < got.candidates.size(); ++i) {
    if (!SameCandidates(got.candidates[i], want.candidates[i])) {
      Fail(absl::StrCat(what, ": candidates ", i, " differ"));
    }
  }
}

// The chunk records of the input; false when one does not parse.
bool ReadChunks(const uint8_t*& data, size_t& size, bool keep_crc, bool keep_profile,
                std::vector<v1::SequenceChunk>& chunks) {
  if (size < 1) return false;
  const int n = data[0];
  ++data;
  --size;
  const Fixture& f = F();
  for (int i = 0; i < n; ++i) {
    if (size < 2) return false;
    const size_t len = data[0] | (size_t(data[1]) << 8);
    data += 2;
    size -= 2;
    if (len > size) return false;
    v1::SequenceChunk chunk;
    if (!chunk.ParseFromArray(data, static_cast<int>(len))) return false;
    data += len;
    size -= len;
    if (chunk.has_header() && !keep_profile) {
      chunk.mutable_header()->set_profile(f.profile.name);
      chunk.mutable_header()->set_profile_hash(config::CacheIdentityHash(f.profile));
    }
    if (!keep_crc) {
      chunk.set_crc32(chunk.has_header() ? service::SequenceHeaderCrc(chunk.header())
                                         : service::Crc32(chunk.data()));
    }
    chunks.push_back(std::move(chunk));
  }
  return true;
}

// Lifecycle ops on the imported sequence 1, against a model of every live sequence.
void RunOps(const uint8_t* data, size_t size, std::map<uint64_t, exec::SequenceImage>& model) {
  Fixture& f = F();
  uint64_t next_id = 2;
  for (; size >= 3; data += 3, size -= 3) {
    const int64_t length = data[1] | (int64_t(data[2]) << 8);
    const exec::SequenceImage& seq = model.at(1);
    if (data[0] % 2 == 0) {
      absl::StatusOr<int64_t> freed = f.executor->TruncateSequence(1, length);
      if (!freed.ok()) Fail(absl::StrCat("truncate: ", freed.status().ToString()));
      exec::SequenceImage cut;
      for (size_t pool = 0; pool < seq.caches.size(); ++pool) {
        cut.caches.push_back(Cut(seq.caches[pool], length, f.geometry[pool]));
      }
      // A source's candidates go with any cut of its cache.
      const std::vector<int32_t> cache_layers = f.profile.CacheLayers();
      for (const exec::CandidateImage& c : seq.candidates) {
        const int32_t cache_layer = f.profile.layers[c.source_layer].cache_layer;
        for (size_t pool = 0; pool < cache_layers.size(); ++pool) {
          if (cache_layers[pool] == cache_layer && seq.caches[pool].length <= length) {
            cut.candidates.push_back(c);
          }
        }
      }
      model[1] = std::move(cut);
    } else {
      const uint64_t child = next_id++;
      absl::Status s = f.executor->ForkSequence(1, child, length);
      bool fits = true;
      for (const exec::CacheImage& c : seq.caches) fits = fits && c.length >= length;
      if (!fits) {
        CheckRefusal("fork", s, {absl::StatusCode::kOutOfRange});
        continue;
      }
      if (!s.ok()) {
        CheckRefusal("fork", s, {absl::StatusCode::kResourceExhausted});
        continue;
      }
      exec::SequenceImage forked;
      for (size_t pool = 0; pool < seq.caches.size(); ++pool) {
        forked.caches.push_back(Cut(seq.caches[pool], length, f.geometry[pool]));
      }
      model[child] = std::move(forked);
    }
  }
  for (const auto& [id, want] : model) {
    absl::StatusOr<exec::SequenceImage> got = f.executor->ExportSequence(id);
    if (!got.ok()) Fail(absl::StrCat("export ", id, ": ", got.status().ToString()));
    CheckSame(absl::StrCat("export of sequence ", id).c_str(), *got, want);
  }
}

void Assemble(const std::vector<v1::SequenceChunk>& chunks, const uint8_t* ops, size_t ops_size) {
  Fixture& f = F();
  service::SequenceAssembler assembler(f.profile);
  for (const v1::SequenceChunk& chunk : chunks) {
    absl::Status s = assembler.Add(chunk);
    Verbose("add", s);
    if (!s.ok()) {
      CheckRefusal("assembler", s,
                   {absl::StatusCode::kInvalidArgument, absl::StatusCode::kDataLoss,
                    absl::StatusCode::kFailedPrecondition});
      return;
    }
  }
  absl::StatusOr<exec::SequenceImage> image = assembler.Finish();
  Verbose("finish", image.status());
  if (!image.ok()) {
    CheckRefusal("finish", image.status(), {absl::StatusCode::kDataLoss});
    return;
  }
  // What the assembler accepted goes through the exporter's framing unchanged.
  service::SequenceAssembler again(f.profile);
  absl::Status emitted = service::EmitSequenceChunks(
      *image, f.profile, 1, 1000, [&](v1::SequenceChunk& c) { return again.Add(c); });
  if (!emitted.ok()) Fail(absl::StrCat("re-assembling an accepted image: ", emitted.ToString()));
  absl::StatusOr<exec::SequenceImage> back = again.Finish();
  if (!back.ok()) Fail(absl::StrCat("re-assembled image: ", back.status().ToString()));
  CheckSame("re-assembled image", *back, *image);

  absl::Status imported = f.executor->ImportSequence(1, *image);
  Verbose("import", imported);
  if (!imported.ok()) {
    CheckRefusal("import", imported,
                 {absl::StatusCode::kInvalidArgument, absl::StatusCode::kResourceExhausted});
    if (!f.executor->SequenceIds().empty()) Fail("a refused import left a sequence");
    return;
  }
  std::map<uint64_t, exec::SequenceImage> model;
  exec::SequenceImage& want = model[1];
  for (size_t pool = 0; pool < image->caches.size(); ++pool) {
    want.caches.push_back(Cut(image->caches[pool], image->caches[pool].length, f.geometry[pool]));
  }
  want.candidates = image->candidates;
  RunOps(ops, ops_size, model);
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::FILE* out = std::fopen(path.c_str(), "wb");
  if (out == nullptr || std::fwrite(bytes.data(), 1, bytes.size(), out) != bytes.size()) {
    Fail("writing the snapshot file");
  }
  std::fclose(out);
}

// A snapshot record: [u32 LE length][u32 LE CRC-32][payload].
void AppendRecord(std::string& file, const std::string& payload) {
  const uint32_t len = static_cast<uint32_t>(payload.size());
  const uint32_t crc = service::Crc32(payload);
  for (int i = 0; i < 4; ++i) file.push_back(static_cast<char>(len >> (8 * i)));
  for (int i = 0; i < 4; ++i) file.push_back(static_cast<char>(crc >> (8 * i)));
  file += payload;
}

void Restore(const std::string& file) {
  Fixture& f = F();
  WriteFile(f.dir + "/snapshot.bin", file);
  absl::StatusOr<std::optional<service::SnapshotInfo>> r =
      service::RestoreSnapshot(*f.executor, f.dir);
  Verbose("restore", r.status());
  std::remove((f.dir + "/snapshot.bin").c_str());
  if (!r.ok()) {
    CheckRefusal("restore", r.status(),
                 {absl::StatusCode::kDataLoss, absl::StatusCode::kFailedPrecondition,
                  absl::StatusCode::kInvalidArgument, absl::StatusCode::kResourceExhausted,
                  absl::StatusCode::kAlreadyExists});
    return;
  }
  if (!r->has_value()) Fail("restore found no file");
  if (static_cast<int64_t>(f.executor->SequenceIds().size()) != (*r)->sequences) {
    Fail("restored sequence count");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  Fixture& f = F();
  const uint8_t mode = data[0];
  const bool keep_crc = (mode & 4) != 0;
  const bool keep_profile = (mode & 8) != 0;
  ++data;
  --size;
  const int kind = mode & 3;
  if (kind == 3) {
    Restore(std::string(reinterpret_cast<const char*>(data), size));
  } else if (kind == 2) {
    std::string file = "DISNAP01";
    while (size >= 2) {
      const size_t len = std::min<size_t>(data[0] | (size_t(data[1]) << 8), size - 2);
      AppendRecord(file, std::string(reinterpret_cast<const char*>(data + 2), len));
      data += 2 + len;
      size -= 2 + len;
    }
    Restore(file);
  } else {
    std::vector<v1::SequenceChunk> chunks;
    if (!ReadChunks(data, size, keep_crc, keep_profile, chunks)) return 0;
    if (kind == 1) {
      // A snapshot of the chunks: each header starts a sequence.
      int64_t sequences = 0;
      for (const v1::SequenceChunk& c : chunks) sequences += c.has_header();
      std::string file = "DISNAP01";
      AppendRecord(file, absl::StrCat("profile=", f.profile.name,
                                      "\nprofile_hash=", config::CacheIdentityHash(f.profile),
                                      "\ninstance_id=fuzz\nsequences=", sequences, "\n"));
      uint64_t id = 0;
      for (v1::SequenceChunk& c : chunks) {
        v1::ImportSequenceRequest req;
        if (c.has_header()) req.set_sequence_id(++id);
        *req.mutable_chunk() = std::move(c);
        AppendRecord(file, req.SerializeAsString());
      }
      AppendRecord(file, absl::StrCat("end sequences=", sequences, "\n"));
      Restore(file);
    } else {
      Assemble(chunks, data, size);
    }
  }
  f.ReleaseAll();
  return 0;
}
