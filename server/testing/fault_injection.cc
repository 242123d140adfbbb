#include "server/testing/fault_injection.h"

#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/exec/executor_internal.h"
#include "spdlog/spdlog.h"

namespace decode_indexer::testing {
namespace {

using exec::StepFaults;

// One step's fault on one rank; every other rank runs the step untouched.
class OneRankFault final : public StepFaults {
 public:
  explicit OneRankFault(FaultInjection fault) : fault_(std::move(fault)) {}

  absl::Status BeforeScoring(int32_t rank) const override {
    if (rank != fault_.rank) return absl::OkStatus();
    if (fault_.pause) {
      fault_.pause();
      return absl::OkStatus();
    }
    if (fault_.hang || fault_.device) return absl::OkStatus();
    return absl::InternalError(absl::StrCat("injected fault on rank ", rank));
  }

  AfterAgreement AfterTheAgreement(int32_t rank) const override {
    if (rank != fault_.rank || fault_.pause) return {};
    if (fault_.hang) {
      return {AfterAgreement::Kind::kSkipGather,
              absl::InternalError(
                  absl::StrCat("injected hang: rank ", rank, " skipped the all-gather"))};
    }
    if (fault_.device) {
      return {AfterAgreement::Kind::kFailSynchronize,
              absl::InternalError(
                  absl::StrCat("injected device fault on rank ", rank, " after the agreement"))};
    }
    return {};
  }

  absl::Status WithoutCollective(int32_t rank) const override {
    if (rank != fault_.rank || fault_.pause || !(fault_.hang || fault_.device)) {
      return absl::OkStatus();
    }
    // No collective in this step to stay away from: the injected fault is a plain failure.
    return absl::InternalError(
        absl::StrCat("injected fault: rank ", rank, " (a step with no collective)"));
  }

 private:
  const FaultInjection fault_;
};

// Gives the fault to the step it names, once.
class OneShotHooks final : public exec::FaultHooks {
 public:
  explicit OneShotHooks(FaultInjection fault) : fault_(std::move(fault)) {}

  std::shared_ptr<const StepFaults> ForStep(uint64_t index) override {
    if (fault_.rank < 0 || index != fault_.step) return nullptr;
    auto step = std::make_shared<OneRankFault>(std::move(fault_));
    fault_ = FaultInjection{};  // once
    return step;
  }

 private:
  FaultInjection fault_;
};

}  // namespace

std::shared_ptr<exec::FaultHooks> MakeFaultHooks(FaultInjection fault) {
  return std::make_shared<OneShotHooks>(std::move(fault));
}

void InjectFault(exec::Executor& executor, FaultInjection fault) {
  exec::SetFaultHooks(executor, MakeFaultHooks(std::move(fault)));
}

std::optional<FaultInjection> FaultFromSpec(std::string_view spec) {
  if (spec.empty()) return std::nullopt;
  const std::string s(spec);
  int rank = -1;
  char kind[16] = {0};
  unsigned long long step = 0;
  const int n = std::sscanf(s.c_str(), "%d:%15[a-z]:%llu", &rank, kind, &step);
  const std::string k = kind;
  if (n < 2 || (k != "error" && k != "hang" && k != "device")) {
    spdlog::warn("DI_INJECT_FAULT=\"{}\" ignored: want RANK:error|hang|device[:STEP]", s);
    return std::nullopt;
  }
  FaultInjection f;
  f.rank = rank;
  f.hang = k == "hang";
  f.device = k == "device";
  f.step = step;
  spdlog::warn("DI_INJECT_FAULT: rank {} will {} at decode step {}", rank, k, step);
  return f;
}

std::optional<FaultInjection> FaultFromEnv() {
  const char* env = std::getenv("DI_INJECT_FAULT");
  return env == nullptr ? std::nullopt : FaultFromSpec(env);
}

bool InjectFaultFromEnv(exec::Executor& executor) {
  std::optional<FaultInjection> fault = FaultFromEnv();
  if (!fault) return false;
  InjectFault(executor, *std::move(fault));
  return true;
}

}  // namespace decode_indexer::testing
