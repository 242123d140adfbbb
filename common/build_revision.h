// The commit a binary was built from (e.g. "f2aa17af137b", "f2aa17af137b-dirty" when tracked
// files differed from it, "unknown" outside a git checkout), refreshed by every build (target
// di_revision). Only common/build_revision.cc sees the generated header, so a new commit
// recompiles that one file and relinks.
#pragma once

namespace decode_indexer {

const char* BuildRevision();

}  // namespace decode_indexer
