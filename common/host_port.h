// A network address as operators write it on command lines and in configs: "host:port", with an
// IPv6 host in brackets ("[::1]:7300"). The host may be a name or a numeric address; nothing is
// resolved here.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"

namespace kvtier {

struct HostPort {
  std::string host;  // without the brackets of an IPv6 address
  uint16_t port = 0;

  // "host:port", an IPv6 host in brackets.
  std::string ToString() const;
};

// Parses "host:port" or "[v6]:port". Refuses (InvalidArgument naming `text`) an empty host, a
// host with a ':' outside brackets, a '/' anywhere, and a port outside 1..65535 or with anything
// but decimal digits.
StatusOr<HostPort> ParseHostPort(std::string_view text);

// True for a numeric address in 127.0.0.0/8, ::1 and "localhost"; false for any other name
// (a name is not resolved: "127.example" is not loopback).
bool IsLoopbackAddress(std::string_view address);
// True for a numeric IPv4 or IPv6 address, or "localhost" (what a TCP front can bind).
bool IsIpAddressOrLocalhost(std::string_view address);

}  // namespace kvtier
