#include "server/service/snapshot.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

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

// A bounded hand-off from one producer thread to one consumer: the snapshot's file work
// (CRC-32s, reads and writes) runs on its own thread beside the executor's copies and the
// records' parsing, at most `depth` items ahead.
template <typename T>
class Handoff {
 public:
  explicit Handoff(size_t depth) : depth_(depth) {}
  // Producer: false once the consumer closed (stop producing).
  bool Push(T item) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return q_.size() < depth_ || closed_; });
    if (closed_) return false;
    q_.push_back(std::move(item));
    cv_.notify_all();
    return true;
  }
  // Producer: nothing more comes.
  void Finish() {
    std::lock_guard lock(mu_);
    finished_ = true;
    cv_.notify_all();
  }
  // Consumer: the next item; nullopt once the producer finished and all were taken, or after
  // Close.
  std::optional<T> Pop() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return !q_.empty() || finished_ || closed_; });
    if (closed_ || q_.empty()) return std::nullopt;
    T item = std::move(q_.front());
    q_.pop_front();
    cv_.notify_all();
    return item;
  }
  // Either side: stop; a waiting Push returns false, a waiting Pop nullopt.
  void Close() {
    std::lock_guard lock(mu_);
    closed_ = true;
    q_.clear();
    cv_.notify_all();
  }

 private:
  const size_t depth_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<T> q_;
  bool finished_ = false;
  bool closed_ = false;
};

// Closes `h` and joins `t` on every way out of a scope.
template <typename T>
struct JoinOnExit {
  Handoff<T>& h;
  std::thread& t;
  ~JoinOnExit() {
    h.Close();
    if (t.joinable()) t.join();
  }
};

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
    // The executor copies sequence i + 1 out while this writer's thread checksums and writes
    // sequence i (two images in memory at most).
    struct Exported {
      uint64_t id;
      exec::SequenceImage image;
    };
    Handoff<Exported> exported(1);
    absl::Status written = s;
    std::thread writer([&] {
      while (std::optional<Exported> e = exported.Pop()) {
        v1::ImportSequenceRequest first;
        first.set_sequence_id(e->id);
        *first.mutable_chunk() = SequenceHeaderChunk(e->image, profile, e->id);
        written = w.Record(first.SerializeAsString());
        if (written.ok()) {
          written = ForEachDataChunk(
              e->image, 16 << 20, [&](const DataChunkView& chunk) { return w.DataRecord(chunk); });
        }
        if (!written.ok()) exported.Close();  // the exporter stops at its next Push
      }
    });
    {
      JoinOnExit<Exported> join{exported, writer};
      for (size_t i = 0; i < ids.size() && s.ok(); ++i) {
        absl::StatusOr<exec::SequenceImage> image = executor.ExportSequence(ids[i]);
        if (!image.ok()) {
          s = image.status();
          break;
        }
        if (!exported.Push(Exported{ids[i], *std::move(image)})) break;  // the writer failed
      }
      exported.Finish();
      writer.join();
    }
    if (s.ok()) s = written;
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
  // This thread reads and checks the records (fread, CRC-32) up to four ahead of the one
  // being parsed and imported here; it stops at the end of the file or at the first bad one.
  struct RawRecord {
    std::string payload;
    bool eof = false;  // a clean end of the file: no record
    absl::Status status;
  };
  Handoff<RawRecord> ahead(4);
  std::thread reader([&, at = offset] {
    int64_t r_offset = at, r_record = 0;
    auto r_refuse = [&](absl::StatusCode code, absl::string_view kind, absl::string_view why) {
      return absl::Status(code, absl::StrCat("snapshot ", info.path, " refused: ", kind,
                                             " at byte ", r_offset, " (record ", r_record, "): ",
                                             why, "; move the file away to start without it"));
    };
    auto read = [&](RawRecord& r) -> absl::Status {
      uint8_t head[8];
      const size_t got = std::fread(head, 1, 8, f.get());
      r.eof = got == 0 && std::feof(f.get());
      if (r.eof) return absl::OkStatus();
      if (got != 8) {
        return r_refuse(absl::StatusCode::kDataLoss, "torn or truncated",
                        "the file ends inside a record header");
      }
      uint32_t len = 0, crc = 0;
      for (int i = 0; i < 4; ++i) {
        len |= uint32_t(head[i]) << (8 * i);
        crc |= uint32_t(head[4 + i]) << (8 * i);
      }
      if (len > kMaxRecord) {
        return r_refuse(absl::StatusCode::kDataLoss, "corrupt",
                        absl::StrCat("a record claims ", len, " bytes"));
      }
      // Nothing is allocated for bytes the file does not have.
      if (int64_t{len} > file_bytes - r_offset - 8) {
        return r_refuse(absl::StatusCode::kDataLoss, "torn or truncated",
                        absl::StrCat("the file ends inside a record of ", len, " bytes"));
      }
      r.payload.resize(len);
      if (std::fread(r.payload.data(), 1, len, f.get()) != len) {
        return r_refuse(absl::StatusCode::kDataLoss, "torn or truncated",
                        absl::StrCat("the file ends inside a record of ", len, " bytes"));
      }
      if (Crc32(r.payload) != crc) {
        return r_refuse(absl::StatusCode::kDataLoss, "corrupt", "a record fails its CRC-32");
      }
      return absl::OkStatus();
    };
    for (;;) {
      RawRecord r;
      r.status = read(r);
      const bool stop = r.eof || !r.status.ok();
      r_offset += 8 + static_cast<int64_t>(r.payload.size());
      ++r_record;
      if (!ahead.Push(std::move(r)) || stop) break;
    }
    ahead.Finish();
  });
  JoinOnExit<RawRecord> join{ahead, reader};
  std::string payload;
  // The next record into payload; *eof at a clean end of file.
  auto next = [&](bool* eof) -> absl::Status {
    std::optional<RawRecord> r = ahead.Pop();
    if (!r.has_value()) {  // after the reader's last (end of file or a refusal)
      *eof = true;
      return absl::OkStatus();
    }
    *eof = r->eof;
    payload = std::move(r->payload);
    return r->status;
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
  exec::SequenceImage done;  // the last imported image: its buffers take the next one's pages
  for (int64_t i = 0; i < count; ++i) {
    // Every record's CRC-32 covers its chunk's data: the chunks' own CRCs are not recomputed.
    SequenceAssembler assembler(profile, SequenceAssembler::DataCrc::kCoveredByCaller);
    assembler.Recycle(std::move(done));
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
    done = *std::move(image);
  }
  if (absl::Status s = next(&eof); !s.ok()) return s;
  if (eof || payload != absl::StrCat("end sequences=", count, "\n")) {
    return refuse(absl::StatusCode::kDataLoss, "torn or truncated",
                  "the end record is missing or wrong");
  }
  advance();
  // Anything after the end record (a whole record or a torn one) is refused as such.
  (void)next(&eof);
  if (!eof) return refuse(absl::StatusCode::kDataLoss, "corrupt", "bytes follow the end record");
  info.bytes = offset;
  info.sequences = count;
  ahead.Close();
  reader.join();
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
