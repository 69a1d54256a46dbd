#include "common/host_port.h"

#include <arpa/inet.h>

#include <charconv>

namespace kvtier {

std::string HostPort::ToString() const {
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

StatusOr<HostPort> ParseHostPort(std::string_view text) {
  auto bad = [&](const char* why) {
    return Status::InvalidArgument("address '" + std::string(text) + "': " + why);
  };
  const size_t colon = text.rfind(':');
  if (colon == std::string_view::npos || text.find('/') != std::string_view::npos) {
    return bad("want host:port ([addr]:port for IPv6)");
  }
  std::string_view host = text.substr(0, colon), port = text.substr(colon + 1);
  if (!host.empty() && host.front() == '[') {
    if (host.size() < 3 || host.back() != ']') return bad("bad [IPv6] host");
    host = host.substr(1, host.size() - 2);
  } else if (host.find(':') != std::string_view::npos) {
    return bad("write an IPv6 host as [addr]");
  } else if (host.find(']') != std::string_view::npos) {
    return bad("bad [IPv6] host");
  }
  if (host.empty()) return bad("no host");
  unsigned value = 0;
  const auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  if (port.empty() || ec != std::errc() || end != port.data() + port.size() || value == 0 ||
      value > 65535) {
    return bad("port must be 1..65535");
  }
  return HostPort{std::string(host), static_cast<uint16_t>(value)};
}

bool IsLoopbackAddress(std::string_view address) {
  if (address == "localhost" || address == "::1") return true;
  in_addr a4{};
  const std::string s(address);
  if (inet_pton(AF_INET, s.c_str(), &a4) == 1) return (ntohl(a4.s_addr) >> 24) == 127;
  return false;
}

bool IsIpAddressOrLocalhost(std::string_view address) {
  if (address == "localhost") return true;
  const std::string s(address);
  in_addr a4{};
  in6_addr a6{};
  return inet_pton(AF_INET, s.c_str(), &a4) == 1 || inet_pton(AF_INET6, s.c_str(), &a6) == 1;
}

}  // namespace kvtier
