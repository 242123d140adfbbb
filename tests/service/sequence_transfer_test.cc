// The snapshot writer's data records (FrameDataChunk: the serialized ImportSequenceRequest
// put together around the page bytes, which it does not copy) must be byte for byte what
// protobuf's SerializeToString writes for the same message, so that files read as before and
// old files read the same; and the chunk stream EmitSequenceChunks gives over gRPC is the
// header then ForEachDataChunk's views in order.
#include <gtest/gtest.h>

#include <random>
#include <set>
#include <string>

#include "server/service/sequence_transfer.h"
#include "tests/test_seed.h"

namespace decode_indexer::testing {
namespace {

std::string Serialized(const service::DataChunkView& v, uint32_t crc) {
  v1::ImportSequenceRequest req;
  v1::SequenceChunk* c = req.mutable_chunk();
  c->set_cache_index(v.cache_index);
  c->set_offset(v.offset);
  c->set_data(v.data.data(), v.data.size());
  c->set_crc32(crc);
  c->set_last(v.last);
  return req.SerializeAsString();
}

TEST(SequenceTransferTest, DataChunkFrameIsProtobufsSerialization) {
  SCOPED_TRACE(::testing::Message() << "seed " << TestSeed());
  std::mt19937_64 rng(TestSeed());
  std::string bytes(size_t{1} << 21, '\0');
  for (char& b : bytes) b = static_cast<char>(rng());
  const int32_t cache_indexes[] = {0, 1, 60, 127, 128, 300, 70000};
  const int64_t offsets[] = {0, 1, 127, 128, 16 << 20, int64_t{1} << 40};
  const size_t sizes[] = {1, 127, 128, 16383, 16384, (size_t{1} << 21) - 5};
  int checked = 0;
  for (int32_t ci : cache_indexes) {
    for (int64_t off : offsets) {
      for (size_t n : sizes) {
        for (int variant = 0; variant < 4; ++variant) {
          service::DataChunkView v;
          v.cache_index = ci;
          v.offset = off;
          const size_t at = rng() % (bytes.size() - n + 1);
          v.data = absl::string_view(bytes.data() + at, n);
          v.last = variant & 1;
          const uint32_t crc = (variant & 2) ? static_cast<uint32_t>(rng()) | 1u : 0u;
          const service::DataChunkFrame f = service::FrameDataChunk(v, crc);
          const std::string got = f.prefix + std::string(v.data) + f.suffix;
          ASSERT_EQ(got, Serialized(v, crc))
              << "cache_index " << ci << " offset " << off << " bytes " << n << " last " << v.last
              << " crc " << crc;
          v1::ImportSequenceRequest parsed;
          ASSERT_TRUE(parsed.ParseFromString(got));
          EXPECT_EQ(parsed.chunk().data().size(), n);
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, int(std::size(cache_indexes) * std::size(offsets) * std::size(sizes)) * 4);
}

TEST(SequenceTransferTest, EmitIsTheHeaderThenEveryDataChunkInOrder) {
  SCOPED_TRACE(::testing::Message() << "seed " << TestSeed());
  std::mt19937_64 rng(TestSeed() + 1);
  const config::Profile p = *config::LoadProfile("v32");
  const std::vector<int32_t> layers = p.CacheLayers();
  exec::SequenceImage image;
  for (size_t i = 0; i < layers.size(); ++i) {
    exec::CacheImage c;
    c.cache_layer = layers[i];
    // Some caches empty, one spanning several chunks.
    const size_t bytes = i % 5 == 0 ? 0 : (i == 7 ? 3 * 4096 + 100 : 1 + rng() % 9000);
    c.pages.resize(bytes);
    for (char& b : c.pages) b = static_cast<char>(rng());
    image.caches.push_back(std::move(c));
  }
  std::vector<v1::SequenceChunk> emitted;
  ASSERT_TRUE(service::EmitSequenceChunks(image, p, 42, 4096, [&](v1::SequenceChunk& c) {
                emitted.push_back(c);
                return absl::OkStatus();
              }).ok());
  std::vector<service::DataChunkView> views;
  ASSERT_TRUE(service::ForEachDataChunk(image, 4096, [&](const service::DataChunkView& v) {
                views.push_back(v);
                return absl::OkStatus();
              }).ok());
  ASSERT_EQ(emitted.size(), views.size() + 1);
  EXPECT_TRUE(emitted[0].has_header());
  EXPECT_EQ(emitted[0].crc32(), service::SequenceHeaderCrc(emitted[0].header()));
  std::vector<std::string> rebuilt(image.caches.size());
  for (size_t i = 0; i < views.size(); ++i) {
    const v1::SequenceChunk& c = emitted[i + 1];
    EXPECT_EQ(c.cache_index(), views[i].cache_index);
    EXPECT_EQ(c.offset(), views[i].offset);
    EXPECT_EQ(c.data(), std::string(views[i].data));
    EXPECT_EQ(c.crc32(), service::Crc32(c.data()));
    EXPECT_EQ(c.last(), i + 1 == views.size());
    EXPECT_EQ(views[i].last, i + 1 == views.size());
    EXPECT_EQ(int64_t(rebuilt[c.cache_index()].size()), c.offset());
    rebuilt[c.cache_index()] += c.data();
  }
  for (size_t i = 0; i < image.caches.size(); ++i) EXPECT_EQ(rebuilt[i], image.caches[i].pages);
}

exec::SequenceImage RandomImage(const config::Profile& p, std::mt19937_64& rng, int64_t max_len) {
  exec::SequenceImage image;
  for (int32_t layer : p.CacheLayers()) {
    const config::LayerSpec& l = p.layers[layer];
    const kernels::CacheGeometry g{l.cache_format, p.head_dim, p.page_size};
    exec::CacheImage c;
    c.cache_layer = layer;
    c.length = int64_t(rng() % uint64_t(max_len + 1));
    c.pages.resize(size_t((c.length + p.page_size - 1) / p.page_size * g.page_bytes()));
    for (char& b : c.pages) b = static_cast<char>(rng());
    image.caches.push_back(std::move(c));
  }
  return image;
}

absl::StatusOr<exec::SequenceImage> RoundTrip(const config::Profile& p,
                                              const exec::SequenceImage& image,
                                              exec::SequenceImage* recycle) {
  service::SequenceAssembler a(p);
  if (recycle != nullptr) a.Recycle(std::move(*recycle));
  absl::Status s = service::EmitSequenceChunks(image, p, 7, 3000,
                                               [&](v1::SequenceChunk& c) { return a.Add(c); });
  if (!s.ok()) return s;
  return a.Finish();
}

// A snapshot's restore builds each sequence in the buffers of the one before (Recycle): the
// image must come out the same whatever the recycled buffers held, and the buffers must be
// the ones reused.
TEST(SequenceTransferTest, RecycledBuffersGiveTheSameImage) {
  SCOPED_TRACE(::testing::Message() << "seed " << TestSeed());
  std::mt19937_64 rng(TestSeed() + 2);
  const config::Profile p = *config::LoadProfile("v32");
  for (int trial = 0; trial < 8; ++trial) {
    const exec::SequenceImage a = RandomImage(p, rng, 2000);
    const exec::SequenceImage b = RandomImage(p, rng, trial % 2 ? 300 : 2000);
    absl::StatusOr<exec::SequenceImage> a1 = RoundTrip(p, a, nullptr);
    ASSERT_TRUE(a1.ok()) << a1.status();
    size_t largest = 0;  // a recycled buffer keeps its memory: b's caches get a's capacity
    for (const exec::CacheImage& c : a1->caches) largest = std::max(largest, c.pages.capacity());
    absl::StatusOr<exec::SequenceImage> b1 = RoundTrip(p, b, &*a1);
    ASSERT_TRUE(b1.ok()) << b1.status();
    ASSERT_EQ(b1->caches.size(), b.caches.size());
    int reused = 0;
    for (size_t i = 0; i < b.caches.size(); ++i) {
      EXPECT_EQ(b1->caches[i].length, b.caches[i].length) << "trial " << trial << " cache " << i;
      EXPECT_EQ(b1->caches[i].pages, b.caches[i].pages) << "trial " << trial << " cache " << i;
      // A fresh buffer is reserved to the cache's size; a recycled one stays larger.
      reused += b1->caches[i].pages.capacity() > b.caches[i].pages.size() + 4096;
    }
    if (trial % 2 == 1) {  // b small, a large: every cache of b fits a recycled buffer
      EXPECT_GT(reused, 0) << "trial " << trial << ": no recycled buffer was used (largest "
                           << largest << ")";
    }
  }
}

}  // namespace
}  // namespace decode_indexer::testing
