// kvtierd: the kvtier daemon. `kvtierd --help` lists the flags; docs/CONFIG.md every key.
//
// Signals: SIGTERM/SIGINT stop gracefully (stop accepting, finish in-flight requests, flush,
// exit 0); SIGHUP reloads the [policy] table of the config file.
#include <malloc.h>
#include <signal.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "cache_daemon/config.h"
#include "cache_daemon/daemon.h"
#include "cache_daemon/server_secret.h"
#include "cli/flags.h"
#include "common/key_spec.h"
#include "common/logging.h"
#include "common/open_files.h"
#include "common/sanitizers.h"

namespace {

using namespace kvtier;
using namespace kvtier::daemon;

int Fail(const Status& st) {
  std::fprintf(stderr, "kvtierd: %s\n", st.ToString().c_str());
  return 1;
}

// Warns when the open-file limit is below the descriptors open now plus those the connections
// the limits allow may hold: at the limit the fronts pause their accepts (common/accept_backoff.h)
// and new clients wait in the listen backlog.
void CheckOpenFilesLimit(const DaemonOptions& o, const OpenFilesLimit& limit) {
  uint64_t connection_fds = o.max_connections;
  // A Unix connection may hold its shared-memory region's descriptor as well.
  connection_fds += std::min(o.unix_connections_max, o.max_connections);
  if (o.engram.enabled) connection_fds += o.engram.connections_max;
  if (o.cluster.enabled) connection_fds += o.cluster.peer_connections_max;
  WarnIfOpenFilesShort(limit, connection_fds, "kvtier_accept_waits_total",
                       "lower limits.max_connections");
}
// Before any thread starts, so that no thread has an arena beyond the limit. Under a
// sanitizer's allocator (kSanitizerAllocator: it answers mallopt with 0) the settings do not
// apply: logged, not an error.
Status SetMallocLimits(const DaemonOptions& o) {
  if (kSanitizerAllocator) {
    if (o.malloc_arenas_max > 0 || o.malloc_mmap_threshold_bytes > 0) {
      KVTIER_LOG(kInfo) << "limits.malloc_arenas_max and limits.malloc_mmap_threshold_bytes not "
                           "applied: this build's sanitizer allocator takes no mallopt settings";
    }
    return Status::Ok();
  }
  if (o.malloc_arenas_max > 0 &&
      ::mallopt(M_ARENA_MAX, static_cast<int>(o.malloc_arenas_max)) != 1) {
    return Status::Internal("mallopt(M_ARENA_MAX) refused limits.malloc_arenas_max");
  }
  if (o.malloc_mmap_threshold_bytes > 0 &&
      ::mallopt(M_MMAP_THRESHOLD, static_cast<int>(o.malloc_mmap_threshold_bytes)) != 1) {
    return Status::Internal("mallopt(M_MMAP_THRESHOLD) refused limits.malloc_mmap_threshold_bytes");
  }
  return Status::Ok();
}
}  // namespace

int main(int argc, char** argv) {
  // Blocked before any thread starts (the trace writer's, the store's, the fronts'), so that
  // every thread inherits the mask and only the main thread takes them, with sigtimedwait. A
  // thread started earlier could take one whose default action ends the process: no drain,
  // no flush. A signal arriving during startup waits, pending, for the loop below.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);

  std::vector<std::string_view> args(argv + 1, argv + argc);
  std::string config, data_dir, socket, listen, tokens, trace, hash_token, log_level;
  std::string native_listen, resp_listen, http_listen, cluster_node_id, cluster_advertise;
  std::optional<uint64_t> resp_port, http_port, native_port;
  const DaemonOptions embedded;  // what --help names as the defaults of the config keys
  auto port_default = [](const char* key, uint16_t v) {
    return std::string(key) + " of the config, " + std::to_string(v) + " when unset";
  };
  cli::FlagSet flags("kvtierd", "The kvtier daemon: tiered KV-cache storage (docs/CONFIG.md).");
  flags.String("config", &config, "FILE", "TOML config file (default: embedded defaults)");
  flags.String("data-dir", &data_dir, "DIR", "data directory (server.data_dir)");
  flags.String("socket", &socket, "PATH", "native Unix socket, or 'off' (server.socket)");
  flags.String("listen", &listen, "ADDR",
               "default address of the native TCP and RESP ports (server.listen)");
  flags.String("native-listen", &native_listen, "ADDR",
               "address of the native TCP port (server.native_listen)");
  flags.String("resp-listen", &resp_listen, "ADDR",
               "address of the RESP port (server.resp_listen)");
  flags.String("http-listen", &http_listen, "ADDR",
               "address of the HTTP admin port (server.http_listen, default 127.0.0.1)");
  flags.OptionalUint("resp-port", &resp_port, "RESP port, 0 disables",
                     port_default("server.resp_port", embedded.resp_port), 0, 65535);
  flags.OptionalUint("http-port", &http_port, "HTTP admin port, 0 disables",
                     port_default("server.http_port", embedded.http_port), 0, 65535);
  flags.OptionalUint("native-port", &native_port, "native TCP port, 0 disables",
                     port_default("server.native_port", embedded.native_port), 0, 65535);
  flags.String("tokens-file", &tokens, "FILE", "tenants and hashed tokens (auth.tokens_file)");
  flags.String("trace", &trace, "FILE.zst", "record the request stream (trace.path)");
  flags.String("hash-token", &hash_token, "TOKEN",
               "print the SHA-256 of TOKEN for a tokens file and exit");
  flags.String("log-level", &log_level, "LEVEL", "debug, info, warn, error");
  // One config for every pod of a StatefulSet: the per-node values come from the command line.
  flags.String("cluster-node-id", &cluster_node_id, "ID", "this node's id (cluster.node_id)");
  flags.String("cluster-peer-advertise", &cluster_advertise, "HOST:PORT",
               "the address peers dial (cluster.peer_advertise)");
  if (int rc = flags.Parse(args); rc >= 0) return rc;

  if (!hash_token.empty()) {
    std::printf("%s\n", TokenSha256Hex(hash_token).c_str());
    return 0;
  }
  if (!log_level.empty()) {
    LogLevel lv;
    if (!ParseLogLevel(log_level, &lv)) {
      std::fprintf(stderr, "kvtierd: bad --log-level '%s'\n", log_level.c_str());
      return 2;
    }
    SetLogLevel(lv);
  }

  StatusOr<DaemonOptions> loaded = LoadConfig(config);
  if (!loaded.ok()) return Fail(loaded.status());
  DaemonOptions o = std::move(loaded).value();
  if (!data_dir.empty()) o.data_dir = data_dir;
  if (!socket.empty()) o.socket_path = socket;
  if (!listen.empty()) o.listen_address = listen;
  if (!native_listen.empty()) o.native_listen = native_listen;
  if (!resp_listen.empty()) o.resp_listen = resp_listen;
  if (!http_listen.empty()) o.http_listen = http_listen;
  if (!tokens.empty()) o.tokens_file = tokens;
  if (!trace.empty()) o.trace_path = trace;
  if (!cluster_node_id.empty()) o.cluster.node_id = cluster_node_id;
  if (!cluster_advertise.empty()) o.cluster.peer_advertise = cluster_advertise;
  // The flags' range is 0..65535, so each given value fits a port.
  if (resp_port) o.resp_port = static_cast<uint16_t>(*resp_port);
  if (http_port) o.http_port = static_cast<uint16_t>(*http_port);
  if (native_port) o.native_port = static_cast<uint16_t>(*native_port);
  if (Status st = Finalize(&o); !st.ok()) return Fail(config.empty() ? st : st.WithContext(config));
  if (Status st = SetMallocLimits(o); !st.ok()) return Fail(st);

  std::error_code fec;
  std::filesystem::create_directories(o.data_dir, fec);
  if (fec) return Fail(Status::IOError("cannot create data dir " + o.data_dir));
  ::chmod(o.data_dir.c_str(), 0700);

  StatusOr<std::vector<uint8_t>> secret = OpenServerSecret({.secret_file = o.server_secret_file,
                                                            .data_dir = o.data_dir,
                                                            .store_dir = o.storage.data_dir});
  if (!secret.ok()) return Fail(secret.status());
  std::unique_ptr<TenantRegistry> tenants;
  if (o.tokens_file.empty()) {
    tenants = TenantRegistry::Open(*secret, o.default_inflight_max);
  } else {
    StatusOr<std::unique_ptr<TenantRegistry>> t = TenantRegistry::LoadFile(o.tokens_file, *secret);
    if (!t.ok()) return Fail(t.status());
    tenants = std::move(t).value();
  }
  std::unique_ptr<TraceWriter> tracer;
  if (!o.trace_path.empty()) {
    StatusOr<std::unique_ptr<TraceWriter>> t = TraceWriter::Open(
        o.trace_path, o.trace_queue_depth,
        TraceWindowLimits{o.trace_whatif_window_records_max, o.trace_whatif_window_bytes_max});
    if (!t.ok()) return Fail(t.status());
    tracer = std::move(t).value();
  }

  ::signal(SIGPIPE, SIG_IGN);

  const OpenFilesLimit files_limit = RaiseOpenFilesLimit();
  if (o.storage.ssd_capacity_bytes > 0) {
    std::filesystem::create_directories(o.storage.data_dir, fec);
  }
  StatusOr<std::unique_ptr<storage::TierManager>> store = storage::TierManager::Open(o.storage);
  if (!store.ok()) return Fail(store.status().WithContext("opening the store"));
  StatusOr<std::unique_ptr<Daemon>> d =
      Daemon::Start(o, std::move(store).value(), std::move(tenants), std::move(tracer));
  if (!d.ok()) return Fail(d.status());
  CheckOpenFilesLimit(o, files_limit);
  std::fprintf(stderr, "kvtierd: ready\n");

  timespec tick{0, 100 * 1000 * 1000};
  while (!(*d)->shutdown_requested()) {
    int sig = sigtimedwait(&set, nullptr, &tick);
    if (sig == SIGHUP) {
      Status st = (*d)->ReloadPolicy();
      if (!st.ok()) {
        KVTIER_LOG(kError) << "SIGHUP reload failed: " << st.ToString();
      }
    } else if (sig == SIGTERM || sig == SIGINT) {
      (*d)->Shutdown();
    }
  }
  Status st = (*d)->Wait();
  if (!st.ok()) return Fail(st.WithContext("final flush"));
  return 0;
}
