#include "fake_server.h"

#include <cstring>
#include <vector>

namespace decode_indexer::load_test {

grpc::Status FakeIndexer::GetServerInfo(grpc::ServerContext*, const v1::GetServerInfoRequest*,
                                        v1::ServerInfo* info) {
  info->set_profile("fake");
  info->set_backend("fake");
  info->set_num_heads(kHeads);
  info->set_head_dim(kHeadDim);
  info->set_topk(kTopK);
  info->set_page_size(16);
  info->set_max_context(1 << 16);
  info->set_num_ranks(1);
  info->set_max_rows_per_sequence(4);
  info->set_pages_total(1 << 20);
  info->set_pages_free(1 << 20);
  for (int l = 0; l < kLayers; ++l) {
    v1::LayerInfo* layer = info->add_layers();
    layer->set_layer(l);
    layer->set_role(v1::LAYER_ROLE_DENSE);
    layer->set_cache_layer(l);
    layer->set_cache_format(v1::CACHE_FORMAT_FP8);
  }
  return grpc::Status::OK;
}

grpc::Status FakeIndexer::CreateSequence(grpc::ServerContext*,
                                         const v1::CreateSequenceRequest* request,
                                         v1::CreateSequenceResponse*) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!lengths_.try_emplace(request->sequence_id()).second) {
    return grpc::Status(grpc::StatusCode::ALREADY_EXISTS, "sequence exists");
  }
  return grpc::Status::OK;
}

grpc::Status FakeIndexer::AppendKeys(grpc::ServerContext*, const v1::AppendKeysRequest* request,
                                     v1::AppendKeysResponse* response) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = lengths_.find(request->sequence_id());
  if (it == lengths_.end()) return grpc::Status(grpc::StatusCode::NOT_FOUND, "no sequence");
  int64_t& length = it->second[request->layer()];
  length += request->keys().shape(0);
  response->set_length(length);
  return grpc::Status::OK;
}

grpc::Status FakeIndexer::ReleaseSequence(grpc::ServerContext*,
                                          const v1::ReleaseSequenceRequest* request,
                                          v1::ReleaseSequenceResponse*) {
  std::lock_guard<std::mutex> lock(mu_);
  lengths_.erase(request->sequence_id());
  return grpc::Status::OK;
}

grpc::Status FakeIndexer::DecodeStep(grpc::ServerContext*, const v1::DecodeStepRequest* request,
                                     v1::DecodeStepResponse* response) {
  const int64_t step = ++steps_;
  if (fail_every_ > 0 && step % fail_every_ == 0) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "fake: no pages");
  }
  std::lock_guard<std::mutex> lock(mu_);
  int32_t rows = 0;
  for (const v1::SequenceStep& seq : request->sequences()) {
    auto it = lengths_.find(seq.sequence_id());
    if (it == lengths_.end()) return grpc::Status(grpc::StatusCode::NOT_FOUND, "no sequence");
    int64_t& length = it->second[request->layer()];
    if (seq.has_new_keys()) length += seq.new_keys().shape(0);
    response->add_lengths(length);
    rows += seq.num_rows();
  }
  // Wrong on purpose: the first K positions, whatever the logits.
  std::vector<int32_t> topk(size_t(rows) * kTopK);
  for (int32_t r = 0; r < rows; ++r) {
    for (int32_t i = 0; i < kTopK; ++i) topk[size_t(r) * kTopK + i] = i;
  }
  response->set_step_id(request->step_id());
  v1::Tensor* t = response->mutable_topk();
  t->set_dtype(v1::DTYPE_INT32);
  t->add_shape(rows);
  t->add_shape(kTopK);
  t->set_data(topk.data(), topk.size() * sizeof(int32_t));
  response->mutable_timing()->set_compute_us(1);
  return grpc::Status::OK;
}

grpc::Status FakeIndexer::DecodeStream(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<v1::DecodeStepResponse, v1::DecodeStepRequest>* stream) {
  v1::DecodeStepRequest request;
  while (stream->Read(&request)) {
    v1::DecodeStepResponse response;
    grpc::Status status = DecodeStep(context, &request, &response);
    if (!status.ok()) return status;  // the stream ends with the first failing step
    if (!stream->Write(response)) break;
  }
  return grpc::Status::OK;
}

grpc::Status FakeIndexer::GetStatistics(grpc::ServerContext*, const v1::GetStatisticsRequest*,
                                        v1::Statistics* stats) {
  stats->set_steps(steps_.load());
  return grpc::Status::OK;
}

FakeServer::FakeServer(int fail_every) : indexer_(fail_every) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
  builder.RegisterService(&indexer_);
  server_ = builder.BuildAndStart();
  SetServing(true);
}

FakeServer::~FakeServer() {
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
}

void FakeServer::SetServing(bool serving) {
  if (server_ && server_->GetHealthCheckService() != nullptr) {
    server_->GetHealthCheckService()->SetServingStatus(serving);
  }
}

}  // namespace decode_indexer::load_test
