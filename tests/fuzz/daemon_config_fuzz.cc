// libFuzzer target: kvtierd's configuration text (cache_daemon/config.h) on arbitrary bytes:
// the TOML loader with every table, Finalize's derived fields and security rules, the
// [policy] reader SIGHUP uses, and the tokens file (cache_daemon/tenants.h) on the same text. A
// config file is operator input, often generated; a value out of range must be refused naming its
// key, never wrapped into a field (UBSan reports the conversion) or crash the daemon.
//
// Invariants, beyond no crash, no out-of-bounds access (ASan) and no undefined behaviour (UBSan):
//   - a refusal is InvalidArgument or PermissionDenied with a message;
//   - an accepted text's [policy] table is accepted by ParsePolicySettings too, with the same
//     eviction and admission names (SIGHUP reads what start-up read);
//   - an accepted tokens file turns authentication on with tenants of distinct non-empty names
//     and distinct ids >= 1, each found by its id, and authenticates no token it does not list.
//
//   cmake --preset fuzz && cmake --build --preset fuzz --target kvtier_daemon_config_fuzz
//   build/fuzz/tests/fuzz/kvtier_daemon_config_fuzz -dict=tests/fuzz/daemon_config.dict \
//     -max_total_time=60 <corpus dir holding deploy/kvtierd.toml>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <set>
#include <string>
#include <string_view>

#include "cache_daemon/config.h"
#include "cache_daemon/tenants.h"
#include "tests/fuzz/fuzz_require.h"

namespace {

using kvtier::fuzz::Require;

using namespace kvtier;

// A refusal names what it refuses: InvalidArgument, or PermissionDenied where allowed.
void RequireRefusal(const Status& s, bool permission_denied_allowed = true) {
  Require(s.code() == StatusCode::kInvalidArgument ||
          (permission_denied_allowed && s.code() == StatusCode::kPermissionDenied));
  Require(!s.message().empty());
}

void Tenants(std::string_view text) {
  static const uint8_t kSecret[32] = {7};
  auto registry = daemon::TenantRegistry::Parse(text, kSecret);
  if (!registry.ok()) {
    RequireRefusal(registry.status(), /*permission_denied_allowed=*/false);
    return;
  }
  const daemon::TenantRegistry& r = **registry;
  Require(r.auth_enabled() && r.default_tenant() == nullptr);
  std::set<std::string> names;
  std::set<uint64_t> ids;
  for (const auto& t : r.tenants()) {
    Require(!t->name.empty() && t->id >= 1);
    Require(names.insert(t->name).second && ids.insert(t->id).second);
    Require(r.FindById(t->id) == t.get());
  }
  Require(r.Authenticate("a token no tokens file lists").status().code() ==
          StatusCode::kPermissionDenied);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  Tenants(text);
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
