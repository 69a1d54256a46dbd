#include "rdma/transport.h"

#include <future>
#include <memory>

namespace kvtier::rdma {

Status ReadSync(Transport& transport, std::span<const ReadOp> ops) {
  auto promise = std::make_shared<std::promise<Status>>();
  std::future<Status> result = promise->get_future();
  Status submitted = transport.Submit(ops, [promise](const Status& s) { promise->set_value(s); });
  if (!submitted.ok()) return submitted;
  return result.get();
}

}  // namespace kvtier::rdma
