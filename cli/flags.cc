#include "cli/flags.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace kvtier::cli {

FlagSet::FlagSet(std::string command, std::string summary)
    : command_(std::move(command)), summary_(std::move(summary)) {}

void FlagSet::String(std::string name, std::string* out, std::string metavar, std::string help,
                     bool required) {
  Flag f{std::move(name), std::move(metavar), std::move(help), required};
  f.default_text = *out;
  f.set = [out](std::string_view v) {
    *out = std::string(v);
    return true;
  };
  flags_.push_back(std::move(f));
}

void FlagSet::OptionalString(std::string name, std::optional<std::string>* out, std::string metavar,
                             std::string help) {
  Flag f{std::move(name), std::move(metavar), std::move(help), false};
  f.set = [out](std::string_view v) {
    *out = std::string(v);
    return true;
  };
  flags_.push_back(std::move(f));
}

namespace {
std::string FormatDouble(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}
}  // namespace

bool ParseFiniteDouble(std::string_view text, double min, double max, double* out) {
  std::string s(text);
  char* end = nullptr;
  double value = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size() || !std::isfinite(value)) return false;
  if (value < min || value > max) return false;
  *out = value;
  return true;
}

namespace {
bool ParseUintIn(std::string_view v, uint64_t min, uint64_t max, uint64_t* out) {
  uint64_t value = 0;
  auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), value);
  if (v.empty() || ec != std::errc() || p != v.data() + v.size()) return false;
  if (value < min || value > max) return false;
  *out = value;
  return true;
}
}  // namespace

void FlagSet::AddUint(Flag f, uint64_t min, uint64_t max, std::function<void(uint64_t)> store) {
  if (min != 0 || max != UINT64_MAX) {
    f.range_text = std::to_string(min) + ".." + std::to_string(max);
  }
  f.set = [store, min, max](std::string_view v) {
    uint64_t value = 0;
    if (!ParseUintIn(v, min, max, &value)) return false;
    store(value);
    return true;
  };
  flags_.push_back(std::move(f));
}

void FlagSet::Uint(std::string name, uint64_t* out, std::string help, bool required, uint64_t min,
                   uint64_t max) {
  Flag f{std::move(name), "N", std::move(help), required};
  f.default_text = std::to_string(*out);
  AddUint(std::move(f), min, max, [out](uint64_t v) { *out = v; });
}

void FlagSet::OptionalUint(std::string name, std::optional<uint64_t>* out, std::string help,
                           std::string default_text, uint64_t min, uint64_t max) {
  Flag f{std::move(name), "N", std::move(help), false};
  f.default_text = std::move(default_text);
  AddUint(std::move(f), min, max, [out](uint64_t v) { *out = v; });
}

void FlagSet::Double(std::string name, double* out, std::string help, bool required, double min,
                     double max) {
  Flag f{std::move(name), "X", std::move(help), required};
  f.default_text = FormatDouble(*out);
  if (min != -std::numeric_limits<double>::max() || max != std::numeric_limits<double>::max()) {
    f.range_text = FormatDouble(min) + ".." + FormatDouble(max);
  }
  f.set = [out, min, max](std::string_view v) { return ParseFiniteDouble(v, min, max, out); };
  flags_.push_back(std::move(f));
}

void FlagSet::Bool(std::string name, bool* out, std::string help) {
  Flag f{std::move(name), "", std::move(help), false};
  f.is_bool = true;
  f.set = [out](std::string_view v) {
    if (v.empty() || v == "true" || v == "1")
      *out = true;
    else if (v == "false" || v == "0")
      *out = false;
    else
      return false;
    return true;
  };
  flags_.push_back(std::move(f));
}

void FlagSet::Positional(std::vector<std::string>* out, std::string metavar, std::string help) {
  positional_ = out;
  positional_metavar_ = std::move(metavar);
  positional_help_ = std::move(help);
}

void FlagSet::PrintUsage(FILE* out) const {
  std::fprintf(out, "usage: %s [flags]%s%s\n\n%s\n\nflags:\n", command_.c_str(),
               positional_ ? " " : "", positional_ ? positional_metavar_.c_str() : "",
               summary_.c_str());
  for (const Flag& f : flags_) {
    std::string left = "  --" + f.name + (f.is_bool ? "" : " " + f.metavar);
    std::fprintf(out, "%-30s %s", left.c_str(), f.help.c_str());
    if (!f.range_text.empty()) std::fprintf(out, " [%s]", f.range_text.c_str());
    if (f.required)
      std::fprintf(out, " (required)");
    else if (!f.is_bool && !f.default_text.empty())
      std::fprintf(out, " (default: %s)", f.default_text.c_str());
    std::fprintf(out, "\n");
  }
  std::fprintf(out, "%-30s %s\n", "  --help", "print this help");
  if (positional_) {
    std::fprintf(out, "\n  %s: %s\n", positional_metavar_.c_str(), positional_help_.c_str());
  }
}

int FlagSet::Parse(std::span<const std::string_view> args) {
  for (size_t i = 0; i < args.size(); ++i) {
    std::string_view a = args[i];
    if (a == "--help" || a == "-h") {
      PrintUsage(stdout);
      return 0;
    }
    if (a.size() < 3 || a.substr(0, 2) != "--") {
      if (positional_) {
        positional_->emplace_back(a);
        continue;
      }
      std::fprintf(stderr, "%s: unexpected argument '%.*s' (see --help)\n", command_.c_str(),
                   static_cast<int>(a.size()), a.data());
      return 2;
    }
    std::string_view body = a.substr(2);
    std::string_view name = body, value;
    bool has_value = false;
    if (size_t eq = body.find('='); eq != std::string_view::npos) {
      name = body.substr(0, eq);
      value = body.substr(eq + 1);
      has_value = true;
    }
    Flag* flag = nullptr;
    for (Flag& f : flags_) {
      if (f.name == name) flag = &f;
    }
    if (flag == nullptr) {
      std::fprintf(stderr, "%s: unknown flag '--%.*s' (see --help)\n", command_.c_str(),
                   static_cast<int>(name.size()), name.data());
      return 2;
    }
    if (!flag->is_bool && !has_value) {
      if (i + 1 >= args.size()) {
        std::fprintf(stderr, "%s: flag '--%s' needs a value\n", command_.c_str(),
                     flag->name.c_str());
        return 2;
      }
      value = args[++i];
      if (value.size() >= 2 && value.substr(0, 2) == "--") {
        std::fprintf(stderr,
                     "%s: flag '--%s' needs a value, got the flag '%.*s' (write --%s=%.*s "
                     "if that is the value)\n",
                     command_.c_str(), flag->name.c_str(), static_cast<int>(value.size()),
                     value.data(), flag->name.c_str(), static_cast<int>(value.size()),
                     value.data());
        return 2;
      }
    }
    if (!flag->set(value)) {
      std::fprintf(stderr, "%s: bad value '%.*s' for '--%s'%s%s\n", command_.c_str(),
                   static_cast<int>(value.size()), value.data(), flag->name.c_str(),
                   flag->range_text.empty() ? "" : ": the allowed range is ",
                   flag->range_text.c_str());
      return 2;
    }
    flag->seen = true;
  }
  for (const Flag& f : flags_) {
    if (f.required && !f.seen) {
      std::fprintf(stderr, "%s: missing required flag '--%s' (see --help)\n", command_.c_str(),
                   f.name.c_str());
      return 2;
    }
  }
  return -1;
}

std::vector<std::string> SplitComma(std::string_view text) {
  std::vector<std::string> out;
  while (!text.empty()) {
    size_t comma = text.find(',');
    out.emplace_back(text.substr(0, comma));
    if (comma == std::string_view::npos) break;
    text.remove_prefix(comma + 1);
  }
  return out;
}

bool ParseUintList(std::string_view text, uint64_t min, uint64_t max, size_t items_max,
                   std::vector<uint64_t>* out) {
  out->clear();
  if (text.empty() || text.back() == ',') return false;  // SplitComma drops a trailing empty item
  for (const std::string& item : SplitComma(text)) {
    uint64_t v = 0;
    if (out->size() >= items_max || !ParseUintIn(item, min, max, &v)) return false;
    out->push_back(v);
  }
  return true;
}

}  // namespace kvtier::cli
