#include "cache_daemon/resp_key_index.h"

namespace kvtier::daemon {
namespace {

// The smallest storage key whose position is `cursor` (>= 1).
storage::Key FirstKeyAt(uint64_t cursor) {
  uint64_t prefix = (cursor - 1) << 1;
  storage::Key k{};
  for (int i = 0; i < 8; ++i) k[i] = static_cast<uint8_t>(prefix >> (56 - 8 * i));
  return k;
}

}  // namespace

uint64_t RespKeyIndex::CursorOf(const storage::Key& k) {
  uint64_t prefix = 0;
  for (int i = 0; i < 8; ++i) prefix = (prefix << 8) | k[i];
  return (prefix >> 1) + 1;
}

void RespKeyIndex::Add(uint64_t tenant, const storage::Key& k, std::string_view name) {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<storage::Key, std::string>& keys = keys_[tenant];
  if (keys.find(k) != keys.end()) return;
  uint64_t cost = name.size() + kEntryOverheadBytes;
  if (keys.size() >= keys_per_tenant_max_ || bytes_ + cost > name_bytes_max_) {
    ++unindexed_;
    return;
  }
  keys.emplace(k, std::string(name));
  bytes_ += cost;
}

void RespKeyIndex::Remove(uint64_t tenant, const storage::Key& k) {
  std::lock_guard<std::mutex> lock(mu_);
  auto t = keys_.find(tenant);
  if (t == keys_.end()) return;
  auto it = t->second.find(k);
  if (it == t->second.end()) return;
  bytes_ -= it->second.size() + kEntryOverheadBytes;
  t->second.erase(it);
}

void RespKeyIndex::RemoveTenant(uint64_t tenant) {
  std::lock_guard<std::mutex> lock(mu_);
  auto t = keys_.find(tenant);
  if (t == keys_.end()) return;
  for (const auto& [k, name] : t->second) bytes_ -= name.size() + kEntryOverheadBytes;
  keys_.erase(t);
}

uint64_t RespKeyIndex::Scan(uint64_t tenant, uint64_t cursor, size_t count,
                            std::vector<Entry>* out) const {
  out->clear();
  std::lock_guard<std::mutex> lock(mu_);
  auto t = keys_.find(tenant);
  if (t == keys_.end()) return 0;
  const std::map<storage::Key, std::string>& keys = t->second;
  auto it = cursor == 0 ? keys.begin() : keys.lower_bound(FirstKeyAt(cursor));
  uint64_t last = 0;
  for (; it != keys.end(); ++it) {
    uint64_t pos = CursorOf(it->first);
    if (out->size() >= count && pos != last) return pos;
    out->push_back(Entry{it->first, it->second});
    last = pos;
  }
  return 0;
}

size_t RespKeyIndex::size(uint64_t tenant) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto t = keys_.find(tenant);
  return t == keys_.end() ? 0 : t->second.size();
}

uint64_t RespKeyIndex::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}

uint64_t RespKeyIndex::unindexed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return unindexed_;
}

}  // namespace kvtier::daemon
