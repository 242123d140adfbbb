#include "server/service/snapshot.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>

#include <zlib.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "decode_indexer/v1/indexer.pb.h"
#include "server/service/sequence_transfer.h"
#include "server/service/status_mapping.h"
#include "spdlog/spdlog.h"

namespace decode_indexer::service {
namespace {

constexpr char kMagic[8] = {'D', 'I', 'S', 'N', 'A', 'P', '0', '1'};
constexpr uint32_t kMaxRecord = 256u << 20;

std::string Errno() { return std::strerror(errno); }

struct FileCloser {
  void operator()(std::FILE* f) const {
    if (f != nullptr) std::fclose(f);
  }
};
using File = std::unique_ptr<std::FILE, FileCloser>;

class Writer {
 public:
  explicit Writer(std::FILE* f) : f_(f) {}
  absl::Status Raw(const void* data, size_t n) {
    if (std::fwrite(data, 1, n, f_) != n)
      return absl::InternalError(absl::StrCat("write: ", Errno()));
    bytes_ += static_cast<int64_t>(n);
    return absl::OkStatus();
  }
  absl::Status Record(absl::string_view payload) {
    if (absl::Status s = Head(payload.size(), Crc32(payload)); !s.ok()) return s;
    return Raw(payload.data(), payload.size());
  }
  // A data chunk's record, written from the image's pages in place: the payload is
  // FrameDataChunk's prefix + the data + its suffix, and its CRC-32 is put together from the
  // pieces' (crc32_combine), so the data bytes are read once, for the chunk's own CRC.
  absl::Status DataRecord(const DataChunkView& chunk) {
    const uint32_t data_crc = Crc32(chunk.data);
    const DataChunkFrame f = FrameDataChunk(chunk, data_crc);
    uLong crc = Crc32(f.prefix);
    crc = crc32_combine(crc, data_crc, static_cast<z_off_t>(chunk.data.size()));
    crc = crc32_combine(crc, Crc32(f.suffix), static_cast<z_off_t>(f.suffix.size()));
    const size_t len = f.prefix.size() + chunk.data.size() + f.suffix.size();
    if (absl::Status s = Head(len, static_cast<uint32_t>(crc)); !s.ok()) return s;
    if (absl::Status s = Raw(f.prefix.data(), f.prefix.size()); !s.ok()) return s;
    if (absl::Status s = Raw(chunk.data.data(), chunk.data.size()); !s.ok()) return s;
    return Raw(f.suffix.data(), f.suffix.size());
  }
  int64_t bytes() const { return bytes_; }

 private:
  absl::Status Head(size_t len, uint32_t crc) {
    uint8_t head[8];
    for (int i = 0; i < 4; ++i) {
      head[i] = uint8_t(uint32_t(len) >> (8 * i));
      head[4 + i] = uint8_t(crc >> (8 * i));
    }
    return Raw(head, 8);
  }
  std::FILE* f_;
  int64_t bytes_ = 0;
};

absl::Status FsyncPath(const std::string& path, bool dir) {
  const int fd = ::open(path.c_str(), dir ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) return absl::InternalError(absl::StrCat("open ", path, ": ", Errno()));
  const int rc = ::fsync(fd);
  const std::string err = Errno();
  ::close(fd);
  if (rc != 0) return absl::InternalError(absl::StrCat("fsync ", path, ": ", err));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SnapshotInfo> WriteSnapshot(exec::Executor& executor, const std::string& dir,
                                           const std::string& instance_id) {
  const auto start = std::chrono::steady_clock::now();
  SnapshotInfo info;
  info.path = dir + "/snapshot.bin";
  info.instance_id = instance_id;
  const std::string tmp = info.path + ".tmp";
  const config::Profile& profile = executor.profile();
  const std::vector<uint64_t> ids = executor.SequenceIds();
  auto fail = [&](const absl::Status& s) {
    std::remove(tmp.c_str());
    return absl::Status(s.code(), absl::StrCat("snapshot ", tmp, ": ", s.message()));
  };
  {
    File f(std::fopen(tmp.c_str(), "wb"));
    if (f == nullptr) return fail(absl::InternalError(absl::StrCat("create: ", Errno())));
    std::setvbuf(f.get(), nullptr, _IOFBF, 8 << 20);
    Writer w(f.get());
    absl::Status s = w.Raw(kMagic, sizeof(kMagic));
    if (s.ok()) {
      s = w.Record(absl::StrCat("profile=", profile.name,
                                "\nprofile_hash=", config::CacheIdentityHash(profile),
                                "\ninstance_id=", instance_id, "\nsequences=", ids.size(), "\n"));
    }
    for (size_t i = 0; i < ids.size() && s.ok(); ++i) {
      absl::StatusOr<exec::SequenceImage> image = executor.ExportSequence(ids[i]);
      if (!image.ok()) {
        s = image.status();
        break;
      }
      v1::ImportSequenceRequest first;
      first.set_sequence_id(ids[i]);
      *first.mutable_chunk() = SequenceHeaderChunk(*image, profile, ids[i]);
      s = w.Record(first.SerializeAsString());
      if (s.ok()) {
        s = ForEachDataChunk(*image, 16 << 20,
                             [&](const DataChunkView& chunk) { return w.DataRecord(chunk); });
      }
    }
    if (s.ok()) s = w.Record(absl::StrCat("end sequences=", ids.size(), "\n"));
    if (s.ok() && std::fflush(f.get()) != 0)
      s = absl::InternalError(absl::StrCat("flush: ", Errno()));
    if (s.ok() && ::fsync(fileno(f.get())) != 0) {
      s = absl::InternalError(absl::StrCat("fsync: ", Errno()));
    }
    if (!s.ok()) return fail(s);
    info.bytes = w.bytes();
  }
  if (std::rename(tmp.c_str(), info.path.c_str()) != 0) {
    return fail(absl::InternalError(absl::StrCat("rename to ", info.path, ": ", Errno())));
  }
  if (absl::Status s = FsyncPath(dir, /*dir=*/true); !s.ok()) return s;
  info.sequences = static_cast<int64_t>(ids.size());
  info.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return info;
}

absl::StatusOr<std::optional<SnapshotInfo>> RestoreSnapshot(exec::Executor& executor,
                                                            const std::string& dir) {
  const auto start = std::chrono::steady_clock::now();
  SnapshotInfo info;
  info.path = dir + "/snapshot.bin";
  const std::string tmp = info.path + ".tmp";
  struct stat st;
  if (::stat(tmp.c_str(), &st) == 0) {
    spdlog::warn(
        "snapshot: {} is an unfinished snapshot (the writer stopped before renaming "
        "it); removed, not restored",
        tmp);
    std::remove(tmp.c_str());
  }
  if (::stat(info.path.c_str(), &st) != 0) {
    if (errno == ENOENT) return std::optional<SnapshotInfo>();
    return absl::FailedPreconditionError(
        absl::StrCat("snapshot ", info.path, ": cannot stat: ", Errno()));
  }
  File f(std::fopen(info.path.c_str(), "rb"));
  if (f == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("snapshot ", info.path, ": cannot open: ", Errno()));
  }
  std::setvbuf(f.get(), nullptr, _IOFBF, 8 << 20);
  if (::fstat(fileno(f.get()), &st) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("snapshot ", info.path, ": cannot stat: ", Errno()));
  }
  const int64_t file_bytes = static_cast<int64_t>(st.st_size);
  int64_t offset = 0;
  int64_t record = 0;
  auto refuse = [&](absl::StatusCode code, absl::string_view kind, absl::string_view why) {
    return absl::Status(code, absl::StrCat("snapshot ", info.path, " refused: ", kind, " at byte ",
                                           offset, " (record ", record, "): ", why,
                                           "; move the file away to start without it"));
  };
  char magic[sizeof(kMagic)];
  if (std::fread(magic, 1, sizeof(magic), f.get()) != sizeof(magic) ||
      std::memcmp(magic, kMagic, sizeof(kMagic)) != 0) {
    return refuse(absl::StatusCode::kDataLoss, "not a snapshot",
                  "the file does not start with DISNAP01");
  }
  offset = sizeof(kMagic);
  std::string payload;
  // Reads the next record into payload; false at a clean end of file.
  auto next = [&](bool* eof) -> absl::Status {
    uint8_t head[8];
    const size_t got = std::fread(head, 1, 8, f.get());
    *eof = got == 0 && std::feof(f.get());
    if (*eof) return absl::OkStatus();
    if (got != 8) {
      return refuse(absl::StatusCode::kDataLoss, "torn or truncated",
                    "the file ends inside a record header");
    }
    uint32_t len = 0, crc = 0;
    for (int i = 0; i < 4; ++i) {
      len |= uint32_t(head[i]) << (8 * i);
      crc |= uint32_t(head[4 + i]) << (8 * i);
    }
    if (len > kMaxRecord) {
      return refuse(absl::StatusCode::kDataLoss, "corrupt",
                    absl::StrCat("a record claims ", len, " bytes"));
    }
    // Nothing is allocated for bytes the file does not have.
    if (int64_t{len} > file_bytes - offset - 8) {
      return refuse(absl::StatusCode::kDataLoss, "torn or truncated",
                    absl::StrCat("the file ends inside a record of ", len, " bytes"));
    }
    payload.resize(len);
    if (std::fread(payload.data(), 1, len, f.get()) != len) {
      return refuse(absl::StatusCode::kDataLoss, "torn or truncated",
                    absl::StrCat("the file ends inside a record of ", len, " bytes"));
    }
    if (Crc32(payload) != crc) {
      return refuse(absl::StatusCode::kDataLoss, "corrupt", "a record fails its CRC-32");
    }
    return absl::OkStatus();
  };
  auto advance = [&] {
    offset += 8 + static_cast<int64_t>(payload.size());
    ++record;
  };
  bool eof = false;
  if (absl::Status s = next(&eof); !s.ok()) return s;
  if (eof) return refuse(absl::StatusCode::kDataLoss, "torn or truncated", "no header record");
  const config::Profile& profile = executor.profile();
  int64_t count = -1;
  std::string name, hash;
  for (absl::string_view line : absl::StrSplit(payload, '\n', absl::SkipEmpty())) {
    std::pair<std::string, std::string> kv = absl::StrSplit(line, absl::MaxSplits('=', 1));
    if (kv.first == "profile") name = kv.second;
    if (kv.first == "profile_hash") hash = kv.second;
    if (kv.first == "instance_id") info.instance_id = kv.second;
    if (kv.first == "sequences" && !absl::SimpleAtoi(kv.second, &count)) count = -1;
  }
  const std::string my_hash = absl::StrCat(config::CacheIdentityHash(profile));
  if (name != profile.name || hash != my_hash) {
    return refuse(absl::StatusCode::kFailedPrecondition, "mismatched profile",
                  absl::StrCat("it holds profile ", EchoInput(name), " (hash ", EchoInput(hash, 24),
                               "), this server runs \"", profile.name, "\" (hash ", my_hash, ")"));
  }
  if (count < 0 || info.instance_id.empty()) {
    return refuse(absl::StatusCode::kDataLoss, "corrupt",
                  "the header lacks sequences or instance_id");
  }
  advance();
  for (int64_t i = 0; i < count; ++i) {
    // Every record's CRC-32 covers its chunk's data: the chunks' own CRCs are not recomputed.
    SequenceAssembler assembler(profile, SequenceAssembler::DataCrc::kCoveredByCaller);
    uint64_t id = 0;
    while (!assembler.complete()) {
      if (absl::Status s = next(&eof); !s.ok()) return s;
      if (eof) {
        return refuse(absl::StatusCode::kDataLoss, "torn or truncated",
                      absl::StrCat("the file ends in sequence ", i, " of ", count));
      }
      v1::ImportSequenceRequest req;
      if (!req.ParseFromString(payload)) {
        return refuse(absl::StatusCode::kDataLoss, "corrupt", "a record is not a sequence chunk");
      }
      if (id == 0) id = req.sequence_id();
      if (absl::Status s = assembler.Add(req.chunk()); !s.ok()) {
        return refuse(s.code(), "corrupt", s.message());
      }
      advance();
    }
    absl::StatusOr<exec::SequenceImage> image = assembler.Finish();
    if (!image.ok()) return refuse(image.status().code(), "corrupt", image.status().message());
    if (absl::Status s = executor.ImportSequence(id, *image); !s.ok()) {
      return refuse(s.code(), "not restorable", absl::StrCat("sequence ", id, ": ", s.message()));
    }
  }
  if (absl::Status s = next(&eof); !s.ok()) return s;
  if (eof || payload != absl::StrCat("end sequences=", count, "\n")) {
    return refuse(absl::StatusCode::kDataLoss, "torn or truncated",
                  "the end record is missing or wrong");
  }
  advance();
  if (std::fgetc(f.get()) != EOF) {
    return refuse(absl::StatusCode::kDataLoss, "corrupt", "bytes follow the end record");
  }
  info.bytes = offset;
  info.sequences = count;
  f.reset();
  if (std::remove(info.path.c_str()) != 0) {
    return absl::FailedPreconditionError(absl::StrCat("snapshot ", info.path,
                                                      ": restored but cannot remove it (", Errno(),
                                                      "); a later start would restore it again"));
  }
  if (absl::Status s = FsyncPath(dir, /*dir=*/true); !s.ok()) return s;
  info.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return std::optional<SnapshotInfo>(std::move(info));
}

}  // namespace decode_indexer::service
