// What a method's body may ask of its call, whichever gRPC edge (sync or callback) carries it:
// the deadline and cancellation (exec::CallCheck is built from them), the client's metadata
// (the bearer token, x-request-id), the peer, and metadata to send back. The bodies in
// IndexerService take this, never a grpc::ServerContext, so both edges run the same code.
#pragma once

#include <chrono>
#include <string>
#include <string_view>
#include <vector>

#include <grpcpp/server_context.h>

namespace decode_indexer::service {

class CallContext {
 public:
  virtual ~CallContext() = default;
  virtual std::chrono::system_clock::time_point deadline() const = 0;
  // Thread-safe: the callback edge's workers ask while gRPC's threads may cancel.
  virtual bool IsCancelled() const = 0;
  // Every value the client sent under `key` (lower case), in order.
  virtual std::vector<std::string_view> ClientMetadata(std::string_view key) const = 0;
  // gRPC's peer string ("ipv4:127.0.0.1:5555"), who the call came from.
  virtual std::string peer() const = 0;
  // Before the first answer message / the status respectively.
  virtual void AddInitialMetadata(const std::string& key, const std::string& value) = 0;
  virtual void AddTrailingMetadata(const std::string& key, const std::string& value) = 0;
};

// Both edges' contexts share grpc::ServerContextBase (sync ServerContext, the callback
// API's GenericCallbackServerContext): one adapter serves both.
class GrpcCallContext final : public CallContext {
 public:
  explicit GrpcCallContext(grpc::ServerContextBase* context) : context_(context) {}
  std::chrono::system_clock::time_point deadline() const override { return context_->deadline(); }
  bool IsCancelled() const override { return context_->IsCancelled(); }
  std::vector<std::string_view> ClientMetadata(std::string_view key) const override {
    std::vector<std::string_view> out;
    auto range = context_->client_metadata().equal_range(grpc::string_ref(key.data(), key.size()));
    for (auto it = range.first; it != range.second; ++it) {
      out.emplace_back(it->second.data(), it->second.size());
    }
    return out;
  }
  std::string peer() const override { return context_->peer(); }
  void AddInitialMetadata(const std::string& key, const std::string& value) override {
    context_->AddInitialMetadata(key, value);
  }
  void AddTrailingMetadata(const std::string& key, const std::string& value) override {
    context_->AddTrailingMetadata(key, value);
  }

 private:
  grpc::ServerContextBase* context_;
};

// A body run with no gRPC call behind it (a step taken from a step ring): no deadline, never
// cancelled, no metadata; the ring's owner was checked when it registered.
class NoCallContext final : public CallContext {
 public:
  std::chrono::system_clock::time_point deadline() const override {
    return std::chrono::system_clock::time_point::max();
  }
  bool IsCancelled() const override { return false; }
  std::vector<std::string_view> ClientMetadata(std::string_view) const override { return {}; }
  std::string peer() const override { return "step-ring"; }
  void AddInitialMetadata(const std::string&, const std::string&) override {}
  void AddTrailingMetadata(const std::string&, const std::string&) override {}
};

}  // namespace decode_indexer::service
