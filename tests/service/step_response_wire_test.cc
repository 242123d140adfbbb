// SerializeStepResponse (the callback edge's DecodeStep / DecodeStream answers): the raw
// answer (or the delta answer's bytes) handed to gRPC as its own slice, uncopied, the other
// fields before it. Whatever the
// response holds, the bytes must parse into the same message, and a large answer must not be
// copied into the first slice.
#include <google/protobuf/util/message_differencer.h>
#include <grpcpp/support/byte_buffer.h>
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "server/service/callback_edge.h"
#include "tests/test_seed.h"

namespace decode_indexer::testing {
namespace {

// `delta`: the answer as topk_delta bytes (topk then holds dtype and shape only).
v1::DecodeStepResponse RandomResponse(std::mt19937_64& rng, size_t topk_bytes, bool delta) {
  v1::DecodeStepResponse r;
  if (rng() % 2) r.set_step_id(rng());
  const int32_t rows = 1 + int32_t(rng() % 8);
  if (delta) {
    r.mutable_topk()->set_dtype(v1::DTYPE_INT32);
    r.mutable_topk()->add_shape(rows);
    r.mutable_topk()->add_shape(2048);
    std::string* d = r.mutable_topk_delta();
    d->resize(topk_bytes);
    for (char& c : *d) c = static_cast<char>(rng());
  } else if (topk_bytes > 0) {
    v1::Tensor* t = r.mutable_topk();
    t->set_dtype(v1::DTYPE_INT32);
    t->add_shape(rows);
    t->add_shape(int64_t(topk_bytes / 4 / rows));
    std::string* d = t->mutable_data();
    d->resize(topk_bytes);
    for (char& c : *d) c = static_cast<char>(rng());
  } else if (rng() % 2) {
    r.mutable_topk()->set_dtype(v1::DTYPE_INT32);  // shape only (an answer elsewhere)
    r.mutable_topk()->add_shape(rows);
  }
  if (rng() % 2) {
    v1::Tensor* c = r.mutable_candidate_blocks();
    c->set_dtype(v1::DTYPE_INT32);
    c->add_shape(rows);
    c->add_shape(4);
    c->set_data(std::string(size_t(rows) * 16, '\x05'));
  }
  r.mutable_timing()->set_queue_us(int64_t(rng() % 1000));
  r.mutable_timing()->set_compute_us(int64_t(rng() % 100000));
  r.set_sharded(rng() % 2);
  for (int i = 0, n = int(rng() % 70); i < n; ++i) r.add_lengths(int64_t(rng() % 200000));
  return r;
}

std::string Flatten(const grpc::ByteBuffer& buffer, size_t* slices) {
  std::vector<grpc::Slice> parts;
  EXPECT_TRUE(buffer.Dump(&parts).ok());
  *slices = parts.size();
  std::string out;
  for (const grpc::Slice& s : parts) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

TEST(StepResponseWireTest, ParsesIntoTheSameMessageWithTheAnswerUncopied) {
  SCOPED_TRACE(::testing::Message() << "seed " << TestSeed());
  std::mt19937_64 rng(TestSeed());
  const size_t sizes[] = {0, 4, 64 << 10, (64 << 10) - 4, 524288, 2 * 4 * 2048 * 3, 1 << 21};
  int zero_copy = 0;
  for (int trial = 0; trial < 120; ++trial) {
    const size_t topk_bytes = sizes[trial % std::size(sizes)];
    const bool delta = trial >= 60;
    SCOPED_TRACE(::testing::Message() << (delta ? "topk_delta" : "topk") << " " << topk_bytes);
    const v1::DecodeStepResponse want = RandomResponse(rng, topk_bytes, delta);
    v1::DecodeStepResponse given = want;
    const char* answer_at = delta ? given.topk_delta().data() : given.topk().data().data();
    grpc::ByteBuffer out;
    service::SerializeStepResponse(given, out);
    size_t slices = 0;
    const std::string bytes = Flatten(out, &slices);
    v1::DecodeStepResponse got;
    ASSERT_TRUE(got.ParseFromString(bytes)) << "trial " << trial;
    std::string diff;
    google::protobuf::util::MessageDifferencer d;
    d.ReportDifferencesToString(&diff);
    EXPECT_TRUE(d.Compare(want, got)) << "trial " << trial << ": " << diff;
    if (topk_bytes >= (64 << 10)) {
      ++zero_copy;
      ASSERT_EQ(slices, 2u) << "trial " << trial;
      std::vector<grpc::Slice> parts;
      ASSERT_TRUE(out.Dump(&parts).ok());
      EXPECT_EQ(reinterpret_cast<const char*>(parts[1].begin()), answer_at)
          << "the answer's bytes were copied";
      EXPECT_LT(parts[0].size(), 4096u);
    } else {
      EXPECT_EQ(slices, 1u) << "trial " << trial;
    }
  }
  EXPECT_GT(zero_copy, 0);
}

}  // namespace
}  // namespace decode_indexer::testing
