// libFuzzer target: kvtierd's configuration text (cache_daemon/config.h) on arbitrary bytes:
// the TOML loader with every table, Finalize's derived fields and security rules, and the
// [policy] reader SIGHUP uses. A config file is operator input, often generated; a value out
// of range must be refused naming its key, never wrapped into a field (UBSan reports the
// conversion) or crash the daemon.
//
// Invariants, beyond no crash, no out-of-bounds access (ASan) and no undefined behaviour (UBSan):
//   - a refusal is InvalidArgument or PermissionDenied with a message;
//   - an accepted text's [policy] table is accepted by ParsePolicySettings too, with the same
//     eviction and admission names (SIGHUP reads what start-up read).
//
//   cmake --preset fuzz && cmake --build --preset fuzz --target kvtier_daemon_config_fuzz
//   build/fuzz/tests/fuzz/kvtier_daemon_config_fuzz -dict=tests/fuzz/daemon_config.dict \
//     -max_total_time=60 <corpus dir holding deploy/kvtierd.toml>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "cache_daemon/config.h"

namespace {

using namespace kvtier;

void Require(bool ok) {
  if (!ok) std::abort();
}

void RequireRefusal(const Status& s) {
  Require(s.code() == StatusCode::kInvalidArgument || s.code() == StatusCode::kPermissionDenied);
  Require(!s.message().empty());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto options = daemon::ParseConfig(text);
  auto policy = daemon::ParsePolicySettings(text);
  if (!options.ok()) {
    RequireRefusal(options.status());
    return 0;
  }
  Require(policy.ok());
  Require(policy->eviction == options->storage.eviction_policy);
  Require(policy->admission == options->storage.admission_policy);
  const Status finalized = daemon::Finalize(&*options);
  if (!finalized.ok()) RequireRefusal(finalized);
  return 0;
}
