// The one-line version every decode-indexer binary prints for --version (no CLI11 needed, so
// CUDA sources can use it too).
#pragma once

#include <string>

#include "common/build_revision.h"
#include "decode_indexer/version.h"

namespace decode_indexer::cli {

// "decode-indexer 0.1.0 (revision abc1234, Release, CUDA ON)".
inline std::string VersionLine() {
  return std::string("decode-indexer ") + DI_VERSION_STRING + " (revision " + BuildRevision() +
         ", " + DI_BUILD_TYPE + ", CUDA " + DI_BUILT_WITH_CUDA + ")";
}

}  // namespace decode_indexer::cli
