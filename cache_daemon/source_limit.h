// Per-source limits of kvtierd's TCP fronts: the source a connection is counted under, and a
// table of places held per source (limits.unauthenticated_connections_per_source_max).
//
// A front's cap on unauthenticated connections (limits.unauthenticated_connections_max) alone
// lets one client that reconnects as fast as it is closed keep every place of the front, and
// with it every other client out. As OpenSSH's PerSourceMaxStartups, nginx's limit_conn by
// $binary_remote_addr or HAProxy's per-source connection limits, each source may hold only a
// few of the front's places.
//
// A source is the peer's IP address: an IPv4 address whole (/32); an IPv6 address by its first
// limits.unauthenticated_source_ipv6_prefix_bits bits (64: one host typically owns a whole
// /64, SLAAC and privacy addresses make any address of it its own, so /128 would let one host
// be 2^64 sources); an IPv4-mapped IPv6 address (::ffff:a.b.c.d, a dual-stack socket's IPv4
// peer) as its IPv4 address.
#pragma once

#include <array>
#include <boost/asio/ip/address.hpp>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "common/logging.h"

namespace kvtier::daemon {

// The source a connection is counted under. Value type; compared byte by byte.
struct SourceKey {
  // IPv4 as its IPv4-mapped IPv6 form; IPv6 with the bits past its prefix cleared.
  std::array<uint8_t, 16> bytes{};
  uint8_t ipv6_prefix_bits = 0;  // 0: an IPv4 source (so no IPv6 source equals one)

  auto operator<=>(const SourceKey&) const = default;
};

// The source of a peer at `address`; IPv6 addresses keep their first ipv6_prefix_bits bits
// (1..128).
SourceKey SourceKeyOf(const boost::asio::ip::address& address, uint32_t ipv6_prefix_bits);

// For log lines: "203.0.113.7", "2001:db8:1:2::/64" (the prefix when shorter than 128).
std::string SourceName(const SourceKey& source);

// Places held per source, at most max_per_source each. Entries exist only while a source
// holds a place (removed at zero), so the table never holds more entries than places taken.
// Refusals are logged at most once per kRefusalLogIntervalMs (with the count held back), so a
// flood of refused connections cannot fill the log. Thread-safe (one mutex, taken only to take
// or give back a place and to read the gauges).
class SourcePlaces {
 public:
  static constexpr uint64_t kRefusalLogIntervalMs = 10000;

  // what: names the places in log lines ("kvtierd RESP front"); max_per_source >= 1.
  SourcePlaces(std::string what, uint32_t max_per_source)
      : what_(std::move(what)), max_per_source_(max_per_source) {}
  SourcePlaces(const SourcePlaces&) = delete;
  SourcePlaces& operator=(const SourcePlaces&) = delete;

  // Takes a place for `source`: false when it already holds max_per_source (the refusal is
  // logged, throttled; now_ms on any monotonic clock spaces those lines).
  bool Acquire(const SourceKey& source, uint64_t now_ms);
  // Gives back a place Acquire() took. A source that holds none is a caller bug: ignored.
  void Release(const SourceKey& source);

  struct Gauges {
    uint64_t sources = 0;     // sources holding at least one place
    uint64_t top_places = 0;  // the most places one source holds
  };
  Gauges gauges() const;
  uint32_t max_per_source() const { return max_per_source_; }

 private:
  const std::string what_;
  const uint32_t max_per_source_;
  mutable std::mutex mu_;
  std::map<SourceKey, uint32_t> places_;            // by mu_; every value >= 1
  LogThrottle refusal_log_{kRefusalLogIntervalMs};  // by mu_
};

}  // namespace kvtier::daemon
