// An in-process decode-indexer stand-in whose answers the tests control: a tiny FP8 dense
// profile that keeps sequence lengths like the real server but answers every row with the
// first K positions (wrong for any row longer than K), and can fail every n-th step. It lets
// the tests check that the load tester's verifier and error accounting catch what they
// should, with no real server involved. The default health service is on.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "decode_indexer/v1/indexer.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace decode_indexer::load_test {

class FakeIndexer final : public v1::DecodeIndexer::Service {
 public:
  static constexpr int kHeads = 4;
  static constexpr int kHeadDim = 64;
  static constexpr int kTopK = 16;
  static constexpr int kLayers = 2;

  // Every fail_every-th DecodeStep answers RESOURCE_EXHAUSTED (0: never).
  explicit FakeIndexer(int fail_every) : fail_every_(fail_every) {}

  grpc::Status GetServerInfo(grpc::ServerContext*, const v1::GetServerInfoRequest*,
                             v1::ServerInfo* info) override;
  grpc::Status CreateSequence(grpc::ServerContext*, const v1::CreateSequenceRequest* request,
                              v1::CreateSequenceResponse*) override;
  grpc::Status AppendKeys(grpc::ServerContext*, const v1::AppendKeysRequest* request,
                          v1::AppendKeysResponse* response) override;
  grpc::Status ReleaseSequence(grpc::ServerContext*, const v1::ReleaseSequenceRequest* request,
                               v1::ReleaseSequenceResponse*) override;
  grpc::Status DecodeStep(grpc::ServerContext*, const v1::DecodeStepRequest* request,
                          v1::DecodeStepResponse* response) override;
  grpc::Status DecodeStream(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::DecodeStepResponse, v1::DecodeStepRequest>* stream) override;
  grpc::Status GetStatistics(grpc::ServerContext*, const v1::GetStatisticsRequest*,
                             v1::Statistics* stats) override;

  int64_t steps() const { return steps_.load(); }

 private:
  const int fail_every_;
  std::atomic<int64_t> steps_{0};
  std::mutex mu_;
  std::map<uint64_t, std::map<int32_t, int64_t>> lengths_;  // sequence -> layer -> length
};

// The fake behind a real gRPC server on 127.0.0.1 (port picked by the OS).
class FakeServer {
 public:
  explicit FakeServer(int fail_every);
  ~FakeServer();
  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }
  void SetServing(bool serving);
  FakeIndexer& indexer() { return indexer_; }

 private:
  FakeIndexer indexer_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

}  // namespace decode_indexer::load_test
