// JSON from a client, checked against limits before it is parsed into a tree. A tree costs up
// to about 75 times its text (1 MiB of "[" is about 75 MB of nested arrays), so a body is
// bounded by what its tree would hold, not only by its bytes. JsonWithinLimits reads the text
// once with nlohmann's SAX interface, builds nothing (a string is read one at a time, as the
// parser's own token) and stops at the first array or object opened with depth_max others open
// around it, or the first value past the values_max-th (containers included; object keys are
// not values). A parser callback that discards what is past a limit would not do: it cannot
// stop the parse, and keeps a pointer per open container to the end of the text.
//
// Header-only and templated on the JSON type, as common/json_text.h: common does not link
// nlohmann::json for its users.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kvtier {

enum class JsonLimitBreach { kNone, kDepth, kValues };

// The first limit `text` breaks, in text order; kNone also when it is not JSON (the tree's
// parse reports that).
template <typename Json>
JsonLimitBreach JsonWithinLimits(std::string_view text, uint64_t depth_max, uint64_t values_max) {
  class Check final : public Json::json_sax_t {
   public:
    using Base = typename Json::json_sax_t;
    Check(uint64_t depth_max, uint64_t values_max)
        : depth_max_(depth_max), values_max_(values_max) {}
    JsonLimitBreach breach = JsonLimitBreach::kNone;

    bool null() override { return Value(); }
    bool boolean(bool) override { return Value(); }
    bool number_integer(typename Base::number_integer_t) override { return Value(); }
    bool number_unsigned(typename Base::number_unsigned_t) override { return Value(); }
    bool number_float(typename Base::number_float_t, const typename Base::string_t&) override {
      return Value();
    }
    bool string(typename Base::string_t&) override { return Value(); }
    bool binary(typename Base::binary_t&) override { return Value(); }
    bool start_object(std::size_t) override { return Open(); }
    bool key(typename Base::string_t&) override { return true; }
    bool end_object() override { return Close(); }
    bool start_array(std::size_t) override { return Open(); }
    bool end_array() override { return Close(); }
    bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
      return false;  // not JSON: the caller's parse reports it
    }

   private:
    bool Value() {
      if (++values_ <= values_max_) return true;
      breach = JsonLimitBreach::kValues;
      return false;
    }
    bool Open() {
      if (++depth_ > depth_max_) {
        breach = JsonLimitBreach::kDepth;
        return false;
      }
      return Value();
    }
    bool Close() {
      --depth_;
      return true;
    }
    const uint64_t depth_max_, values_max_;
    uint64_t depth_ = 0, values_ = 0;
  };
  Check check(depth_max, values_max);
  (void)Json::sax_parse(text, &check);
  return check.breach;
}

}  // namespace kvtier
