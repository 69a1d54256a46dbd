#include "common/config.h"

#include <toml++/toml.h>

#include <algorithm>
#include <fstream>

namespace kvtier {

struct ConfigSection::Rep {
  std::shared_ptr<const toml::table> root;  // keeps `table` alive
  const toml::table* table = nullptr;       // points into *root
  std::string source;                       // file name for messages
  std::string path;                         // dotted table path
};

namespace {

std::string Where(const std::string& source, const toml::source_region& region) {
  std::string out = source;
  if (region.begin.line != 0) {
    out += ":" + std::to_string(region.begin.line) + ":" + std::to_string(region.begin.column);
  }
  return out;
}

std::string Qualified(const std::string& path, std::string_view key) {
  return path.empty() ? std::string(key) : path + "." + std::string(key);
}

std::string_view TypeName(const toml::node& node) {
  switch (node.type()) {
    case toml::node_type::table:
      return "table";
    case toml::node_type::array:
      return "array";
    case toml::node_type::string:
      return "string";
    case toml::node_type::integer:
      return "integer";
    case toml::node_type::floating_point:
      return "float";
    case toml::node_type::boolean:
      return "boolean";
    case toml::node_type::date:
    case toml::node_type::time:
    case toml::node_type::date_time:
      return "date/time";
    default:
      return "none";
  }
}

}  // namespace

StatusOr<ConfigSection> ConfigSection::Parse(std::string_view text, std::string_view source_name) {
  if (text.size() > kConfigFileBytesLimit) {
    return Status::InvalidArgument(std::string(source_name) + ": larger than " +
                                   std::to_string(kConfigFileBytesLimit) + " bytes");
  }
  auto rep = std::make_shared<Rep>();
  rep->source = std::string(source_name);
  try {
    // toml++ reports syntax errors by exception; they stop here (no exceptions across modules).
    auto root = std::make_shared<toml::table>(toml::parse(text, rep->source));
    rep->table = root.get();
    rep->root = std::move(root);
  } catch (const toml::parse_error& e) {
    return Status::InvalidArgument(Where(rep->source, e.source()) + ": " +
                                   std::string(e.description()));
  } catch (const std::exception& e) {
    return Status::InvalidArgument(rep->source + ": " + e.what());
  }
  return ConfigSection(std::move(rep));
}

StatusOr<std::string> ReadFileBounded(const std::string& path, size_t bytes_max) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::IOError("cannot open '" + path + "'");
  std::string text;
  char buf[65536];
  while (in.read(buf, sizeof(buf)) || in.gcount() > 0) {
    text.append(buf, static_cast<size_t>(in.gcount()));
    if (text.size() > bytes_max) {
      return Status::InvalidArgument(path + ": larger than " + std::to_string(bytes_max) +
                                     " bytes");
    }
  }
  if (in.bad()) return Status::IOError("cannot read '" + path + "'");
  return text;
}

StatusOr<ConfigSection> ConfigSection::LoadFile(const std::string& path) {
  KVTIER_ASSIGN_OR_RETURN(std::string text, ReadFileBounded(path, kConfigFileBytesLimit));
  return Parse(text, path);
}

const std::string& ConfigSection::path() const { return rep_->path; }

std::vector<std::string> ConfigSection::Keys() const {
  // toml::table iterates in key order; report document order (by source position) so that
  // "the first unknown key" is the first one a reader sees in the file.
  std::vector<std::pair<toml::source_position, std::string>> keyed;
  for (const auto& [k, v] : *rep_->table)
    keyed.emplace_back(k.source().begin, std::string(k.str()));
  std::stable_sort(keyed.begin(), keyed.end(), [](const auto& a, const auto& b) {
    return a.first.line != b.first.line ? a.first.line < b.first.line
                                        : a.first.column < b.first.column;
  });
  std::vector<std::string> out;
  out.reserve(keyed.size());
  for (auto& [pos, k] : keyed) out.push_back(std::move(k));
  return out;
}

bool ConfigSection::Has(std::string_view key) const { return rep_->table->contains(key); }

StatusOr<ConfigSection> ConfigSection::Section(std::string_view key) const {
  auto rep = std::make_shared<Rep>();
  rep->root = rep_->root;
  rep->source = rep_->source;
  rep->path = Qualified(rep_->path, key);
  const toml::node* node = rep_->table->get(key);
  if (node == nullptr) {
    static const toml::table kEmpty;
    rep->table = &kEmpty;
  } else if (const toml::table* t = node->as_table()) {
    rep->table = t;
  } else {
    return Status::InvalidArgument(Where(rep_->source, node->source()) + ": '" + rep->path +
                                   "' must be a table, got " + std::string(TypeName(*node)));
  }
  return ConfigSection(std::move(rep));
}

#define KVTIER_CONFIG_LOOKUP_(key, default_value)                                                  \
  const toml::node* node = rep_->table->get(key);                                                  \
  if (node == nullptr) return default_value;                                                       \
  auto wrong_type = [&](std::string_view want) {                                                   \
    return Status::InvalidArgument(Where(rep_->source, node->source()) + ": '" +                   \
                                   Qualified(rep_->path, key) + "' must be " + std::string(want) + \
                                   ", got " + std::string(TypeName(*node)));                       \
  }

StatusOr<int64_t> ConfigSection::Int(std::string_view key, int64_t default_value, int64_t min,
                                     int64_t max) const {
  KVTIER_CONFIG_LOOKUP_(key, default_value);
  const auto* v = node->as_integer();
  if (v == nullptr) return wrong_type("an integer");
  const int64_t x = v->get();
  if (x < min || x > max) {
    return Status::InvalidArgument(Where(rep_->source, node->source()) + ": '" +
                                   Qualified(rep_->path, key) + "' = " + std::to_string(x) +
                                   " is out of range [" + std::to_string(min) + ", " +
                                   std::to_string(max) + "]");
  }
  return x;
}

StatusOr<double> ConfigSection::Double(std::string_view key, double default_value) const {
  KVTIER_CONFIG_LOOKUP_(key, default_value);
  if (const auto* f = node->as_floating_point()) return f->get();
  if (const auto* i = node->as_integer()) return static_cast<double>(i->get());
  return wrong_type("a number");
}

StatusOr<bool> ConfigSection::Bool(std::string_view key, bool default_value) const {
  KVTIER_CONFIG_LOOKUP_(key, default_value);
  const auto* v = node->as_boolean();
  if (v == nullptr) return wrong_type("a boolean");
  return v->get();
}

StatusOr<std::string> ConfigSection::String(std::string_view key, std::string default_value) const {
  KVTIER_CONFIG_LOOKUP_(key, default_value);
  const auto* v = node->as_string();
  if (v == nullptr) return wrong_type("a string");
  return v->get();
}

StatusOr<std::vector<std::string>> ConfigSection::StringList(
    std::string_view key, std::vector<std::string> default_value) const {
  KVTIER_CONFIG_LOOKUP_(key, default_value);
  const toml::array* arr = node->as_array();
  if (arr == nullptr) return wrong_type("an array of strings");
  std::vector<std::string> out;
  out.reserve(arr->size());
  for (const toml::node& el : *arr) {
    const auto* s = el.as_string();
    if (s == nullptr) {
      return Status::InvalidArgument(
          Where(rep_->source, el.source()) + ": '" + Qualified(rep_->path, key) +
          "' must contain only strings, got " + std::string(TypeName(el)));
    }
    out.push_back(s->get());
  }
  return out;
}

#undef KVTIER_CONFIG_LOOKUP_

Status ConfigSection::CheckKeys(std::initializer_list<std::string_view> allowed) const {
  return CheckKeys(std::vector<std::string_view>(allowed));
}

Status ConfigSection::CheckKeys(const std::vector<std::string_view>& allowed) const {
  // Report the unknown key that comes first in the document (toml::table iterates in key order).
  const toml::key* first = nullptr;
  for (const auto& [k, v] : *rep_->table) {
    bool known = false;
    for (std::string_view a : allowed) known = known || a == k.str();
    if (known) continue;
    const toml::source_position p = k.source().begin;
    if (first == nullptr || p.line < first->source().begin.line ||
        (p.line == first->source().begin.line && p.column < first->source().begin.column)) {
      first = &k;
    }
  }
  if (first == nullptr) return Status::Ok();
  return Status::InvalidArgument(Where(rep_->source, first->source()) + ": unknown key '" +
                                 Qualified(rep_->path, first->str()) + "'");
}

}  // namespace kvtier
