// ComposeBackend (backend.h): a Backend whose Device or IndexerOps is a test's decorator.
#include <memory>
#include <utility>

#include "decode_indexer/kernels/backend.h"

namespace decode_indexer::kernels {
namespace {

// The owned pieces, a base of ComposedBackend so that they exist before the forwarding bases
// take references to them, and are destroyed after those (the decorators before `inner`, which
// they refer to).
struct Owned {
  std::unique_ptr<Backend> inner;
  std::unique_ptr<Device> device;
  std::unique_ptr<IndexerOps> ops;
  Device& d() { return device != nullptr ? *device : inner->device(); }
  IndexerOps& o() { return ops != nullptr ? *ops : inner->ops(); }
};

class ComposedBackend final : private Owned, public ForwardingOps<ForwardingDevice<Backend>> {
 public:
  ComposedBackend(std::unique_ptr<Backend> inner, std::unique_ptr<Device> device,
                  std::unique_ptr<IndexerOps> ops)
      : Owned{std::move(inner), std::move(device), std::move(ops)},
        ForwardingOps(Owned::o(), Owned::d()) {}
};

}  // namespace

std::unique_ptr<Backend> ComposeBackend(std::unique_ptr<Backend> inner,
                                        std::unique_ptr<Device> device,
                                        std::unique_ptr<IndexerOps> ops) {
  return std::make_unique<ComposedBackend>(std::move(inner), std::move(device), std::move(ops));
}

}  // namespace decode_indexer::kernels
