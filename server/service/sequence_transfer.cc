#include "server/service/sequence_transfer.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <zlib.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "server/service/status_mapping.h"

namespace decode_indexer::service {
namespace {

v1::CacheFormat ProtoFormat(kernels::CacheFormat f) {
  return f == kernels::CacheFormat::kFp8 ? v1::CACHE_FORMAT_FP8 : v1::CACHE_FORMAT_FP4;
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

uint32_t SequenceHeaderCrc(const v1::SequenceHeader& header) {
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream out(&bytes);
    google::protobuf::io::CodedOutputStream coded(&out);
    coded.SetSerializationDeterministic(true);
    header.SerializeToCodedStream(&coded);
  }
  return Crc32(bytes);
}

uint32_t Crc32(absl::string_view bytes, uint32_t crc) {
  // zlib takes a uInt length: feed it in pieces.
  uLong c = crc;
  while (!bytes.empty()) {
    const size_t n = std::min<size_t>(bytes.size(), 1u << 30);
    c = crc32(c, reinterpret_cast<const Bytef*>(bytes.data()), static_cast<uInt>(n));
    bytes.remove_prefix(n);
  }
  return static_cast<uint32_t>(c);
}

v1::SequenceChunk SequenceHeaderChunk(const exec::SequenceImage& image,
                                      const config::Profile& profile, uint64_t sequence_id) {
  v1::SequenceChunk chunk;
  v1::SequenceHeader* h = chunk.mutable_header();
  h->set_profile(profile.name);
  h->set_profile_hash(config::CacheIdentityHash(profile));
  h->set_sequence_id(sequence_id);
  h->set_page_size(profile.page_size);
  bool any_data = false;
  for (const exec::CacheImage& c : image.caches) {
    v1::SequenceCacheExtent* e = h->add_caches();
    e->set_cache_layer(c.cache_layer);
    e->set_length(c.length);
    e->set_cache_format(ProtoFormat(profile.layers[c.cache_layer].cache_format));
    e->set_bytes(static_cast<int64_t>(c.pages.size()));
    any_data |= !c.pages.empty();
  }
  for (const exec::CandidateImage& c : image.candidates) {
    v1::SequenceCandidates* out = h->add_candidates();
    out->set_source_layer(c.source_layer);
    out->set_length(c.length);
    for (int32_t rl : c.row_lengths) out->add_row_lengths(rl);
    out->set_blocks(c.blocks.data(), c.blocks.size() * sizeof(int32_t));
  }
  chunk.set_crc32(SequenceHeaderCrc(*h));
  chunk.set_last(!any_data);
  return chunk;
}

absl::Status ForEachDataChunk(const exec::SequenceImage& image, int64_t chunk_bytes,
                              const std::function<absl::Status(const DataChunkView&)>& fn) {
  if (chunk_bytes <= 0) chunk_bytes = 1 << 20;
  // The last chunk with data: the final piece of the last non-empty cache.
  size_t last_cache = image.caches.size();
  for (size_t i = 0; i < image.caches.size(); ++i) {
    if (!image.caches[i].pages.empty()) last_cache = i;
  }
  for (size_t i = 0; i < image.caches.size(); ++i) {
    const std::string& pages = image.caches[i].pages;
    for (size_t off = 0; off < pages.size(); off += static_cast<size_t>(chunk_bytes)) {
      const size_t n = std::min<size_t>(pages.size() - off, static_cast<size_t>(chunk_bytes));
      DataChunkView v;
      v.cache_index = static_cast<int32_t>(i);
      v.offset = static_cast<int64_t>(off);
      v.data = absl::string_view(pages.data() + off, n);
      v.last = i == last_cache && off + n == pages.size();
      if (absl::Status s = fn(v); !s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

void PutVarint(std::string& out, uint64_t v) {
  uint8_t bytes[10];  // a 64-bit varint takes at most 10
  const uint8_t* end = google::protobuf::io::CodedOutputStream::WriteVarint64ToArray(v, bytes);
  out.append(reinterpret_cast<const char*>(bytes), static_cast<size_t>(end - bytes));
}

DataChunkFrame FrameDataChunk(const DataChunkView& chunk, uint32_t data_crc) {
  // SequenceChunk's fields 2 (int32 cache_index, varint: a negative one sign-extended to 64
  // bits), 3 (int64 offset), 4 (bytes data), 5 (fixed32 crc32), 6 (bool last).
  const uint64_t cache_index = static_cast<uint64_t>(static_cast<int64_t>(chunk.cache_index));
  const uint64_t offset = static_cast<uint64_t>(chunk.offset);
  const uint64_t n = chunk.data.size();
  std::string head;  // the chunk's fields before the data bytes
  if (cache_index != 0) {
    head.push_back(0x10);
    PutVarint(head, cache_index);
  }
  if (offset != 0) {
    head.push_back(0x18);
    PutVarint(head, offset);
  }
  if (n != 0) {
    head.push_back(0x22);
    PutVarint(head, n);
  }
  DataChunkFrame f;
  if (data_crc != 0) {
    f.suffix.push_back(0x2d);
    for (int i = 0; i < 4; ++i) f.suffix.push_back(static_cast<char>(data_crc >> (8 * i)));
  }
  if (chunk.last) f.suffix.append({0x30, 0x01});
  // ImportSequenceRequest's field 2 (the chunk; sequence_id is 0 after the first record).
  f.prefix.push_back(0x12);
  PutVarint(f.prefix, head.size() + n + f.suffix.size());
  f.prefix += head;
  return f;
}

absl::Status EmitSequenceChunks(const exec::SequenceImage& image, const config::Profile& profile,
                                uint64_t sequence_id, int64_t chunk_bytes,
                                const std::function<absl::Status(v1::SequenceChunk&)>& emit) {
  v1::SequenceChunk header = SequenceHeaderChunk(image, profile, sequence_id);
  if (absl::Status s = emit(header); !s.ok()) return s;
  return ForEachDataChunk(image, chunk_bytes, [&](const DataChunkView& v) {
    v1::SequenceChunk data;
    data.set_cache_index(v.cache_index);
    data.set_offset(v.offset);
    data.set_data(v.data.data(), v.data.size());
    data.set_crc32(Crc32(data.data()));
    data.set_last(v.last);
    return emit(data);
  });
}

absl::Status SequenceAssembler::Add(const v1::SequenceChunk& chunk) {
  const std::string where = absl::StrCat("chunk ", chunks_);
  ++chunks_;
  if (complete_) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": arrived after the chunk marked last"));
  }
  if (!have_header_) {
    if (!chunk.has_header()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".header: the first chunk must carry the header"));
    }
    const v1::SequenceHeader& h = chunk.header();
    if (SequenceHeaderCrc(h) != chunk.crc32()) {
      return absl::DataLossError(
          absl::StrCat(where, ".crc32: the header fails its CRC-32 (corrupt)"));
    }
    const uint64_t hash = config::CacheIdentityHash(profile_);
    if (h.profile() != profile_.name || h.profile_hash() != hash) {
      return absl::FailedPreconditionError(absl::StrCat(
          "header.profile: the sequence is from profile ", EchoInput(h.profile()), " (hash ",
          absl::Hex(h.profile_hash()), "), this server runs \"", profile_.name, "\" (hash ",
          absl::Hex(hash), "); caches move only between servers of the same profile"));
    }
    const std::vector<int32_t> cache_layers = profile_.CacheLayers();
    if (h.page_size() != profile_.page_size || h.caches_size() != int(cache_layers.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("header.caches: ", h.caches_size(), " caches of page size ", h.page_size(),
                       ", expected ", cache_layers.size(), " of ", profile_.page_size));
    }
    for (int i = 0; i < h.caches_size(); ++i) {
      const v1::SequenceCacheExtent& e = h.caches(i);
      const config::LayerSpec& l = profile_.layers[cache_layers[i]];
      const kernels::CacheGeometry g{l.cache_format, profile_.head_dim, profile_.page_size};
      const std::string field = absl::StrCat("header.caches[", i, "]");
      if (e.cache_layer() != cache_layers[i] || e.cache_format() != ProtoFormat(l.cache_format)) {
        return absl::InvalidArgumentError(absl::StrCat(field, ": cache layer ", e.cache_layer(),
                                                       ", expected ", cache_layers[i],
                                                       " in its format"));
      }
      if (e.length() < 0 || e.length() > profile_.max_context) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ".length: ", e.length(), " is out of [0, ", profile_.max_context, "]"));
      }
      const int64_t want = CeilDiv(e.length(), profile_.page_size) * g.page_bytes();
      if (e.bytes() != want) {
        return absl::InvalidArgumentError(absl::StrCat(field, ".bytes: ", e.bytes(), ", expected ",
                                                       want, " for length ", e.length()));
      }
      exec::CacheImage c;
      c.cache_layer = e.cache_layer();
      c.length = e.length();
      if (!spare_.empty()) {
        c.pages = std::move(spare_.back());
        spare_.pop_back();
        c.pages.clear();
      }
      c.pages.reserve(static_cast<size_t>(want));
      image_.caches.push_back(std::move(c));
      want_bytes_.push_back(want);
    }
    for (int i = 0; i < h.candidates_size(); ++i) {
      const v1::SequenceCandidates& in = h.candidates(i);
      exec::CandidateImage c;
      c.source_layer = in.source_layer();
      c.length = in.length();
      c.row_lengths.assign(in.row_lengths().begin(), in.row_lengths().end());
      if (in.blocks().size() % sizeof(int32_t) != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("header.candidates[", i, "].blocks: not a whole number of int32"));
      }
      c.blocks.resize(in.blocks().size() / sizeof(int32_t));
      // No memcpy from or to an empty buffer (a null pointer there is undefined behaviour).
      if (!c.blocks.empty()) std::memcpy(c.blocks.data(), in.blocks().data(), in.blocks().size());
      image_.candidates.push_back(std::move(c));
    }
    exported_id_ = h.sequence_id();
    have_header_ = true;
    cache_ = 0;
    while (cache_ < want_bytes_.size() && want_bytes_[cache_] == 0) ++cache_;
    complete_ = chunk.last();
    if (complete_ && cache_ != want_bytes_.size()) {
      return absl::DataLossError("header: marked last, but the caches' pages did not come");
    }
    return absl::OkStatus();
  }
  if (chunk.has_header()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ".header: only the first chunk has one"));
  }
  if (cache_ >= want_bytes_.size()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": more data than the header announced"));
  }
  std::string& pages = image_.caches[cache_].pages;
  if (chunk.cache_index() != int32_t(cache_) || chunk.offset() != int64_t(pages.size())) {
    return absl::DataLossError(absl::StrCat(where, ": cache ", chunk.cache_index(), " offset ",
                                            chunk.offset(), ", expected cache ", cache_, " offset ",
                                            pages.size(), " (a chunk is missing or out of order)"));
  }
  if (data_crc_ == DataCrc::kCheck && Crc32(chunk.data()) != chunk.crc32()) {
    return absl::DataLossError(absl::StrCat(where, ".crc32: cache ", cache_, " offset ",
                                            chunk.offset(), " fails its CRC-32 (corrupt)"));
  }
  if (int64_t(pages.size() + chunk.data().size()) > want_bytes_[cache_]) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".data: more bytes than cache ", cache_, "'s ", want_bytes_[cache_]));
  }
  pages.append(chunk.data());
  if (int64_t(pages.size()) == want_bytes_[cache_]) {
    ++cache_;
    while (cache_ < want_bytes_.size() && want_bytes_[cache_] == 0) ++cache_;
  }
  const bool done = cache_ == want_bytes_.size();
  if (chunk.last() != done) {
    return absl::DataLossError(
        absl::StrCat(where, chunk.last() ? ": marked last before every page came"
                                         : ": the data is complete but not marked last"));
  }
  complete_ = done;
  return absl::OkStatus();
}

void SequenceAssembler::Recycle(exec::SequenceImage image) {
  for (exec::CacheImage& c : image.caches) spare_.push_back(std::move(c.pages));
}

absl::StatusOr<exec::SequenceImage> SequenceAssembler::Finish() {
  if (!have_header_) return absl::DataLossError("the stream ended before its header (truncated)");
  if (!complete_) {
    return absl::DataLossError(
        absl::StrCat("the stream ended after ", chunks_, " chunks, in cache ", cache_, " at byte ",
                     cache_ < image_.caches.size() ? image_.caches[cache_].pages.size() : 0,
                     " (truncated: no chunk marked last)"));
  }
  return std::move(image_);
}

}  // namespace decode_indexer::service
