// MakeTransport: picks the Transport implementation for one row server.
//
//   kTcp    TcpTransport (always built).
//   kVerbs  VerbsTransport, connected: Unavailable when verbs are not built
//           (KVTIER_WITH_RDMA off), when ibv_get_device_list is empty, or when the server
//           answers kVerbsConnect with Unavailable (it has no device); the connect error
//           otherwise.
//   kAuto   kVerbs when that succeeds, else TcpTransport (not yet connected). The reason for
//           a fallback is logged at info level (never a key or token).
//
// The chosen implementation reports itself by name() ("tcp" or "verbs").
//
// Thread safety: MakeTransport is thread-safe. Ownership: the caller owns the result.
#pragma once

#include <memory>

#include "rdma/tcp_transport.h"
#include "rdma/transport.h"
#include "rdma/verbs_plan.h"

namespace kvtier::rdma {

enum class TransportKind : uint8_t { kAuto, kTcp, kVerbs };

// "auto", "tcp", "verbs".
const char* TransportKindName(TransportKind kind);
// Parses TransportKindName's output; InvalidArgument otherwise.
StatusOr<TransportKind> ParseTransportKind(std::string_view name);

// Whether this build contains VerbsTransport (KVTIER_WITH_RDMA).
bool VerbsBuilt();

StatusOr<std::unique_ptr<Transport>> MakeTransport(const TcpEndpoint& endpoint,
                                                   const TransportOptions& options,
                                                   TransportKind kind,
                                                   const verbs::VerbsOptions& verbs_options = {});

}  // namespace kvtier::rdma
