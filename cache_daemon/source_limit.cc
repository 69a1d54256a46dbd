#include "cache_daemon/source_limit.h"

#include <algorithm>

namespace kvtier::daemon {

SourceKey SourceKeyOf(const boost::asio::ip::address& address, uint32_t ipv6_prefix_bits) {
  namespace ip = boost::asio::ip;
  SourceKey key;
  if (address.is_v4() || (address.is_v6() && address.to_v6().is_v4_mapped())) {
    const ip::address_v4 v4 =
        address.is_v4() ? address.to_v4() : ip::make_address_v4(ip::v4_mapped, address.to_v6());
    key.bytes = ip::make_address_v6(ip::v4_mapped, v4).to_bytes();
    return key;
  }
  const uint32_t bits = std::clamp<uint32_t>(ipv6_prefix_bits, 1, 128);
  key.bytes = address.to_v6().to_bytes();
  for (uint32_t i = 0; i < key.bytes.size(); ++i) {
    const uint32_t first_bit = i * 8;
    if (first_bit >= bits) {
      key.bytes[i] = 0;
    } else if (bits - first_bit < 8) {
      key.bytes[i] &= static_cast<uint8_t>(0xff00u >> (bits - first_bit));
    }
  }
  key.ipv6_prefix_bits = static_cast<uint8_t>(bits);
  return key;
}

std::string SourceName(const SourceKey& source) {
  namespace ip = boost::asio::ip;
  const ip::address_v6 v6(source.bytes);
  if (source.ipv6_prefix_bits == 0) return ip::make_address_v4(ip::v4_mapped, v6).to_string();
  std::string name = v6.to_string();
  if (source.ipv6_prefix_bits < 128) name += "/" + std::to_string(source.ipv6_prefix_bits);
  return name;
}

bool SourcePlaces::Acquire(const SourceKey& source, uint64_t now_ms) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = places_.find(source);
  if (it == places_.end()) {
    places_.emplace(source, 1);  // max_per_source_ >= 1
    return true;
  }
  if (it->second < max_per_source_) {
    ++it->second;
    return true;
  }
  uint64_t held_back = 0;
  if (refusal_log_.Allow(now_ms, &held_back)) {
    KVTIER_LOG(kWarn) << what_ << ": closed a connection at accept: its source "
                      << SourceName(source) << " holds " << max_per_source_
                      << " unauthenticated connections already "
                      << "(limits.unauthenticated_connections_per_source_max; counted as "
                      << "unauthenticated_per_source)"
                      << (held_back > 0 ? "; " + std::to_string(held_back) +
                                              " more refused since the last such line"
                                        : std::string());
  }
  return false;
}

void SourcePlaces::Release(const SourceKey& source) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = places_.find(source);
  if (it == places_.end()) return;
  if (--it->second == 0) places_.erase(it);
}

SourcePlaces::Gauges SourcePlaces::gauges() const {
  std::lock_guard<std::mutex> lock(mu_);
  Gauges g;
  g.sources = places_.size();
  for (const auto& [source, n] : places_) g.top_places = std::max<uint64_t>(g.top_places, n);
  return g;
}

}  // namespace kvtier::daemon
