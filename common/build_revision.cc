#include "common/build_revision.h"

#include "decode_indexer/revision.h"

namespace decode_indexer {

const char* BuildRevision() { return DI_GIT_REVISION; }

}  // namespace decode_indexer
