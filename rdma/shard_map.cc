#include "rdma/shard_map.h"

#include <toml++/toml.h>

#include <algorithm>
#include <charconv>

#include "common/toml_integer.h"

namespace kvtier::rdma {

Status ShardMap::ParseEndpoint(std::string_view text, std::string* host, uint16_t* port) {
  size_t colon = text.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 >= text.size()) {
    return Status::InvalidArgument("endpoint must be host:port");
  }
  std::string_view h = text.substr(0, colon);
  if (h.front() == '[') {
    if (h.size() < 3 || h.back() != ']') return Status::InvalidArgument("bad [v6] endpoint");
    h = h.substr(1, h.size() - 2);
  }
  std::string_view p = text.substr(colon + 1);
  unsigned value = 0;
  auto [end, ec] = std::from_chars(p.data(), p.data() + p.size(), value);
  if (ec != std::errc() || end != p.data() + p.size() || value == 0 || value > 65535) {
    return Status::InvalidArgument("endpoint port must be 1..65535");
  }
  *host = std::string(h);
  *port = static_cast<uint16_t>(value);
  return Status::Ok();
}

StatusOr<ShardMap> ShardMap::Create(std::vector<ShardSpec> shards) {
  if (shards.empty()) return Status::InvalidArgument("shard map has no shards");
  if (shards.size() > kShardsMax) return Status::InvalidArgument("more than kShardsMax shards");
  std::sort(shards.begin(), shards.end(),
            [](const ShardSpec& a, const ShardSpec& b) { return a.row_begin < b.row_begin; });
  uint64_t expected_begin = 0;
  for (const ShardSpec& s : shards) {
    if (s.row_begin != expected_begin) {
      return Status::InvalidArgument(
          "shard ranges must cover rows from 0 without gaps or "
          "overlaps; next expected row_begin " +
          std::to_string(expected_begin));
    }
    if (s.row_end <= s.row_begin) return Status::InvalidArgument("shard with row_end <= row_begin");
    if (s.host.empty() || s.port == 0) return Status::InvalidArgument("shard without endpoint");
    if (s.region_name.empty()) return Status::InvalidArgument("shard without region name");
    expected_begin = s.row_end;
  }
  ShardMap map;
  map.shards_ = std::move(shards);
  return map;
}

StatusOr<ShardMap> ShardMap::FromToml(std::string_view toml_text, std::string_view table_path) {
  toml::table root;
  try {
    root = toml::parse(toml_text);
  } catch (const toml::parse_error& e) {
    return Status::InvalidArgument(std::string("shard map TOML: ") + std::string(e.description()));
  }
  const std::string key = std::string(table_path) + ".shard";
  const toml::array* array = root.at_path(key).as_array();
  if (array == nullptr) return Status::InvalidArgument("shard map TOML: no [[" + key + "]]");
  std::vector<ShardSpec> shards;
  for (const toml::node& node : *array) {
    const toml::table* t = node.as_table();
    if (t == nullptr)
      return Status::InvalidArgument("shard map TOML: " + key + " entry not a table");
    auto region = (*t)["region"].value<std::string>();
    auto endpoint = (*t)["endpoint"].value<std::string>();
    auto begin = TomlInteger((*t)["row_begin"]);
    auto end = TomlInteger((*t)["row_end"]);
    if (!region || !endpoint || !begin || !end || *begin < 0 || *end < 0) {
      return Status::InvalidArgument("shard map TOML: each " + key +
                                     " needs region, endpoint, row_begin >= 0, row_end >= 0");
    }
    ShardSpec s;
    s.region_name = *region;
    s.row_begin = static_cast<uint64_t>(*begin);
    s.row_end = static_cast<uint64_t>(*end);
    KVTIER_RETURN_IF_ERROR(ParseEndpoint(*endpoint, &s.host, &s.port));
    shards.push_back(std::move(s));
  }
  return Create(std::move(shards));
}

StatusOr<size_t> ShardMap::ShardOf(uint64_t row) const {
  if (row >= row_count()) return Status::NotFound("row outside the table");
  auto it = std::upper_bound(shards_.begin(), shards_.end(), row,
                             [](uint64_t r, const ShardSpec& s) { return r < s.row_begin; });
  return static_cast<size_t>(std::prev(it) - shards_.begin());
}

}  // namespace kvtier::rdma
