// The one early-return macro of the project: returns the status of `expr` when it is not OK.
// (absl::Status inside, one mapping to grpc::Status at the service edge.)
#pragma once

#include "absl/status/status.h"

#define DI_RETURN_IF_ERROR(expr)                              \
  do {                                                        \
    if (absl::Status di_status_ = (expr); !di_status_.ok()) { \
      return di_status_;                                      \
    }                                                         \
  } while (0)
