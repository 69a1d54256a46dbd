#include "cache_daemon/tenants.h"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/rand.h>
#include <sys/stat.h>
#include <toml++/toml.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "common/toml_integer.h"

namespace kvtier::daemon {
namespace {
constexpr size_t kServerSecretBytes = 32;
// A limit on the tokens file: tenants and tokens per tenant.
constexpr size_t kMaxTenants = 65536;
constexpr size_t kMaxTokensPerTenant = 64;
}  // namespace

InflightSlot& InflightSlot::operator=(InflightSlot&& o) noexcept {
  if (this != &o) {
    if (tenant_ != nullptr) tenant_->inflight.fetch_sub(1, std::memory_order_relaxed);
    tenant_ = o.tenant_;
    o.tenant_ = nullptr;
  }
  return *this;
}

InflightSlot::~InflightSlot() {
  if (tenant_ != nullptr) tenant_->inflight.fetch_sub(1, std::memory_order_relaxed);
}

StatusOr<InflightSlot> AcquireInflight(const Tenant& tenant) {
  uint32_t prev = tenant.inflight.fetch_add(1, std::memory_order_relaxed);
  if (prev >= tenant.inflight_max) {
    tenant.inflight.fetch_sub(1, std::memory_order_relaxed);
    return Status::Rejected("tenant in-flight request limit reached");
  }
  return InflightSlot(&tenant);
}

std::unique_ptr<TenantRegistry> TenantRegistry::Open(std::span<const uint8_t> server_secret,
                                                     uint32_t default_inflight_max) {
  auto reg = std::make_unique<TenantRegistry>();
  auto t = std::make_unique<Tenant>();
  t->name = "default";
  t->id = 0;
  t->admin = true;
  t->inflight_max = default_inflight_max;
  t->salt = TenantSalt(server_secret, t->name);
  reg->by_id_.emplace(t->id, t.get());
  reg->by_name_.emplace(t->name, t.get());
  reg->tenants_.push_back(std::move(t));
  return reg;
}

StatusOr<std::unique_ptr<TenantRegistry>> TenantRegistry::Parse(
    std::string_view toml_text, std::span<const uint8_t> server_secret) {
  toml::table root;
  try {
    root = toml::parse(toml_text);
  } catch (const toml::parse_error& e) {
    std::ostringstream msg;
    msg << "tokens file: " << e.description() << " at line " << e.source().begin.line;
    return Status::InvalidArgument(msg.str());
  }
  auto reg = std::make_unique<TenantRegistry>();
  reg->auth_enabled_ = true;
  const toml::array* list = root["tenant"].as_array();
  if (list == nullptr || list->empty()) {
    return Status::InvalidArgument("tokens file: no [[tenant]] entries");
  }
  if (list->size() > kMaxTenants) return Status::InvalidArgument("tokens file: too many tenants");
  std::set<std::string> names;
  std::set<uint64_t> ids;
  // Every digest seen so far -> the tenant that lists it: a token must identify one tenant.
  std::map<Digest, std::string> owners;
  for (const toml::node& node : *list) {
    const toml::table* tt = node.as_table();
    if (tt == nullptr) return Status::InvalidArgument("tokens file: [[tenant]] must be a table");
    auto t = std::make_unique<Tenant>();
    std::optional<std::string> name = (*tt)["name"].value<std::string>();
    std::optional<int64_t> id = TomlInteger((*tt)["id"]);
    if (!name || name->empty() || !id || *id <= 0) {
      return Status::InvalidArgument("tokens file: each tenant needs a name and an id >= 1");
    }
    t->name = *name;
    t->id = static_cast<uint64_t>(*id);
    if (!names.insert(t->name).second || !ids.insert(t->id).second) {
      return Status::InvalidArgument("tokens file: duplicate tenant name or id '" + t->name + "'");
    }
    int64_t quota = (*tt)["quota_bytes"].value_or(int64_t{0});
    int64_t inflight = (*tt)["inflight_max"].value_or(int64_t{256});
    if (quota < 0 || inflight <= 0 || inflight > (1 << 20)) {
      return Status::InvalidArgument("tokens file: bad quota_bytes/inflight_max for " + t->name);
    }
    t->quota_bytes = static_cast<uint64_t>(quota);
    t->inflight_max = static_cast<uint32_t>(inflight);
    t->admin = (*tt)["admin"].value_or(false);
    const toml::array* toks = (*tt)["token_sha256"].as_array();
    if (toks == nullptr || toks->empty() || toks->size() > kMaxTokensPerTenant) {
      return Status::InvalidArgument("tokens file: tenant " + t->name +
                                     " needs 1..64 token_sha256 digests");
    }
    for (const toml::node& tn : *toks) {
      std::optional<std::string> hex = tn.value<std::string>();
      if (!hex) return Status::InvalidArgument("tokens file: token_sha256 must be strings");
      StatusOr<Digest> d = DigestFromHex(*hex);
      if (!d.ok()) {
        return Status::InvalidArgument("tokens file: tenant " + t->name +
                                       ": token_sha256 is not 64 hex characters");
      }
      auto [it, inserted] = owners.emplace(*d, t->name);
      if (!inserted) {
        return Status::InvalidArgument(
            it->second == t->name
                ? "tokens file: tenant " + t->name + " lists the same token_sha256 twice"
                : "tokens file: tenants " + it->second + " and " + t->name +
                      " share a token_sha256: a token must identify one tenant");
      }
      t->token_sha256.push_back(*d);
    }
    t->salt = TenantSalt(server_secret, t->name);
    reg->by_id_.emplace(t->id, t.get());
    reg->by_name_.emplace(t->name, t.get());
    reg->tenants_.push_back(std::move(t));
  }
  return reg;
}

StatusOr<std::unique_ptr<TenantRegistry>> TenantRegistry::LoadFile(
    const std::string& path, std::span<const uint8_t> secret) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::IOError("cannot open tokens file " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  return Parse(ss.str(), secret);
}

StatusOr<const Tenant*> TenantRegistry::Authenticate(std::string_view token) const {
  if (!auth_enabled_) return tenants_[0].get();
  Digest d = Sha256(
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(token.data()), token.size()));
  // Visit every digest, and select the match with a mask instead of a branch, so the time
  // taken depends neither on the token nor on which tenant (if any) it belongs to. Parse
  // refuses duplicate digests, so at most one matches.
  uintptr_t found = 0;
  for (const auto& t : tenants_) {
    for (const Digest& h : t->token_sha256) {
      // CRYPTO_memcmp returns 0 on a match, else some non-zero int (kept whole: no bit of it
      // may be dropped).
      uint64_t diff = static_cast<uint32_t>(CRYPTO_memcmp(h.data(), d.data(), d.size()));
      uint64_t match_mask = ((diff | (0 - diff)) >> 63) - 1;  // all ones iff diff == 0
      found |= static_cast<uintptr_t>(match_mask) & reinterpret_cast<uintptr_t>(t.get());
    }
  }
  if (found == 0) return Status::PermissionDenied("invalid token");
  return reinterpret_cast<const Tenant*>(found);
}

const Tenant* TenantRegistry::FindById(uint64_t id) const {
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : it->second;
}

const Tenant* TenantRegistry::FindByName(std::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

StatusOr<std::vector<uint8_t>> LoadOrCreateServerSecret(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    std::vector<uint8_t> secret(256);
    ssize_t n = ::read(fd, secret.data(), secret.size());
    ::close(fd);
    if (n < static_cast<ssize_t>(kServerSecretBytes)) {
      return Status::InvalidArgument("server secret " + path + " is shorter than 32 bytes");
    }
    secret.resize(static_cast<size_t>(n));
    return secret;
  }
  std::vector<uint8_t> secret(kServerSecretBytes);
  if (RAND_bytes(secret.data(), static_cast<int>(secret.size())) != 1) {
    return Status::Internal("RAND_bytes failed");
  }
  fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return Status::IOError("cannot create server secret " + path);
  bool ok = ::write(fd, secret.data(), secret.size()) == static_cast<ssize_t>(secret.size()) &&
            ::fsync(fd) == 0;
  ::close(fd);
  if (!ok) return Status::IOError("cannot write server secret " + path);
  // Make the new name durable too: a crash must not lose the secret of data written after.
  size_t slash = path.find_last_of('/');
  std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  bool dir_ok = dfd >= 0 && ::fsync(dfd) == 0;
  if (dfd >= 0) ::close(dfd);
  if (!dir_ok) return Status::IOError("cannot fsync the directory of server secret " + path);
  return secret;
}

}  // namespace kvtier::daemon
