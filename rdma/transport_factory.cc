#include "rdma/transport_factory.h"

#include "common/logging.h"
#ifdef KVTIER_WITH_RDMA
#include "rdma/verbs_device.h"
#include "rdma/verbs_transport.h"
#endif

namespace kvtier::rdma {

const char* TransportKindName(TransportKind kind) {
  switch (kind) {
    case TransportKind::kAuto:
      return "auto";
    case TransportKind::kTcp:
      return "tcp";
    case TransportKind::kVerbs:
      return "verbs";
  }
  return "unknown";
}

StatusOr<TransportKind> ParseTransportKind(std::string_view name) {
  if (name == "auto") return TransportKind::kAuto;
  if (name == "tcp") return TransportKind::kTcp;
  if (name == "verbs") return TransportKind::kVerbs;
  return Status::InvalidArgument("transport kind must be auto, tcp or verbs");
}

bool VerbsBuilt() {
#ifdef KVTIER_WITH_RDMA
  return true;
#else
  return false;
#endif
}

namespace {

StatusOr<std::unique_ptr<Transport>> MakeVerbs(const TcpEndpoint& endpoint,
                                               const TransportOptions& options,
                                               const verbs::VerbsOptions& verbs_options) {
#ifdef KVTIER_WITH_RDMA
  if (verbs::ListDevices().empty()) {
    return Status::Unavailable("no RDMA device (ibv_get_device_list is empty)");
  }
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<VerbsTransport> t,
                          VerbsTransport::Create(endpoint, options, verbs_options));
  KVTIER_RETURN_IF_ERROR(t->Connect());
  return std::unique_ptr<Transport>(std::move(t));
#else
  (void)endpoint;
  (void)options;
  (void)verbs_options;
  return Status::Unavailable("built without RDMA (KVTIER_WITH_RDMA is off)");
#endif
}

StatusOr<std::unique_ptr<Transport>> MakeTcp(const TcpEndpoint& endpoint,
                                             const TransportOptions& options) {
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<TcpTransport> t, TcpTransport::Create(endpoint, options));
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace

StatusOr<std::unique_ptr<Transport>> MakeTransport(const TcpEndpoint& endpoint,
                                                   const TransportOptions& options,
                                                   TransportKind kind,
                                                   const verbs::VerbsOptions& verbs_options) {
  switch (kind) {
    case TransportKind::kTcp:
      return MakeTcp(endpoint, options);
    case TransportKind::kVerbs:
      return MakeVerbs(endpoint, options, verbs_options);
    case TransportKind::kAuto:
      break;
  }
  StatusOr<std::unique_ptr<Transport>> verbs = MakeVerbs(endpoint, options, verbs_options);
  if (verbs.ok()) return verbs;
  KVTIER_LOG(kInfo) << "row transport to " << endpoint.host << ":" << endpoint.port
                    << ": using tcp (" << verbs.status().ToString() << ")";
  return MakeTcp(endpoint, options);
}

}  // namespace kvtier::rdma
