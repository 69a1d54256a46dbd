// TOML configuration helpers (toml++ underneath, hidden from callers).
//
//   KVTIER_ASSIGN_OR_RETURN(ConfigSection root, ConfigSection::LoadFile("/etc/kvtier.toml"));
//   KVTIER_ASSIGN_OR_RETURN(ConfigSection dram, root.Section("dram"));
//   KVTIER_RETURN_IF_ERROR(dram.CheckKeys({"capacity_bytes", "policy"}));
//   KVTIER_ASSIGN_OR_RETURN(int64_t capacity_bytes,
//                           dram.Int("capacity_bytes", /*default_value=*/1 << 30, 0, INT64_MAX));
//
// Every error is a Status (never an exception) whose message starts with "<file>:<line>:<col>:"
// where the TOML source knows the position: parse errors, values of the wrong type, values out
// of range, and unknown keys. A missing key gives the default; a key present with the wrong
// type is InvalidArgument (never silently replaced by the default).
//
// Ownership and thread safety: a ConfigSection shares ownership of the parsed document (cheap
// to copy; sub-sections keep the document alive). It is immutable after loading, so concurrent
// reads from several threads are safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace kvtier {

// Largest configuration file accepted (bytes).
inline constexpr size_t kConfigFileBytesLimit = size_t{4} << 20;

// The whole of the file at `path`, read without ever holding more than bytes_max + 64 KiB.
// IOError("cannot open/read '<path>'") when it cannot be read, InvalidArgument("<path>: larger
// than <bytes_max> bytes") when it is longer than bytes_max.
StatusOr<std::string> ReadFileBounded(const std::string& path, size_t bytes_max);

class ConfigSection {
 public:
  // Reads and parses a TOML file. IOError when unreadable, InvalidArgument for a file over
  // kConfigFileBytesLimit or a TOML syntax error ("<path>:<line>:<col>: <reason>").
  static StatusOr<ConfigSection> LoadFile(const std::string& path);
  // Parses TOML text; `source_name` stands for the file name in messages.
  static StatusOr<ConfigSection> Parse(std::string_view text, std::string_view source_name);

  // Dotted path of this table ("" for the root, "storage.ssd" for [storage.ssd]).
  const std::string& path() const;
  // Keys of this table, in document order.
  std::vector<std::string> Keys() const;
  bool Has(std::string_view key) const;

  // The sub-table `key`. Missing: an empty section (all getters return defaults).
  // Present but not a table: InvalidArgument.
  StatusOr<ConfigSection> Section(std::string_view key) const;

  // Typed getters. Missing key: the default. Wrong type or out of [min, max]: InvalidArgument.
  StatusOr<int64_t> Int(std::string_view key, int64_t default_value,
                        int64_t min = std::numeric_limits<int64_t>::min(),
                        int64_t max = std::numeric_limits<int64_t>::max()) const;
  // Accepts TOML floats and integers.
  StatusOr<double> Double(std::string_view key, double default_value) const;
  StatusOr<bool> Bool(std::string_view key, bool default_value) const;
  StatusOr<std::string> String(std::string_view key, std::string default_value) const;
  // An array whose every element is a string.
  StatusOr<std::vector<std::string>> StringList(std::string_view key,
                                                std::vector<std::string> default_value) const;

  // InvalidArgument naming the first key (in document order) that is not in `allowed`.
  Status CheckKeys(std::initializer_list<std::string_view> allowed) const;
  Status CheckKeys(const std::vector<std::string_view>& allowed) const;

 private:
  struct Rep;
  explicit ConfigSection(std::shared_ptr<const Rep> rep) : rep_(std::move(rep)) {}
  std::shared_ptr<const Rep> rep_;
};

}  // namespace kvtier
