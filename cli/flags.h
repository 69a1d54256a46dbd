// A small, strict command-line flag parser shared by every `kvtier` subcommand.
//
//   FlagSet flags("kvtier layout", "Compute global-KV bytes per token from a model config.");
//   std::string config;
//   bool json = false;
//   flags.String("model-config", &config, "FILE", "model config.json (HF text_config keys)", true);
//   flags.Bool("json", &json, "print JSON instead of text");
//   if (int rc = flags.Parse(args); rc >= 0) return rc;   // --help printed, or an error
//
// Accepts `--name value`, `--name=value` and, for booleans, `--name`. Unknown flags, missing
// values, malformed numbers, numbers outside the flag's range (NaN and infinities are always
// outside), a value that looks like a flag (`--trace --json`; write `--trace=--json` to mean
// it) and missing required flags are errors with a message on stderr and exit code 2.
// `--help` prints generated usage (with each range and default) to stdout and exit code 0.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvtier::cli {

class FlagSet {
 public:
  FlagSet(std::string command, std::string summary);

  void String(std::string name, std::string* out, std::string metavar, std::string help,
              bool required = false);
  // Values outside [min, max] are rejected.
  void Uint(std::string name, uint64_t* out, std::string help, bool required = false,
            uint64_t min = 0, uint64_t max = UINT64_MAX);
  // Only finite values inside [min, max] are accepted.
  void Double(std::string name, double* out, std::string help, bool required = false,
              double min = -std::numeric_limits<double>::max(),
              double max = std::numeric_limits<double>::max());
  // A flag whose absence means "take the value from elsewhere" (a config file): *out stays
  // empty unless the flag is given. `default_text` is what --help shows as the default, so it
  // must name where the value comes from and what that is (never a sentinel).
  void OptionalUint(std::string name, std::optional<uint64_t>* out, std::string help,
                    std::string default_text, uint64_t min = 0, uint64_t max = UINT64_MAX);
  // A string flag whose absence differs from an empty value (`--resp ''` names the empty RESP
  // key): *out stays empty unless the flag is given.
  void OptionalString(std::string name, std::optional<std::string>* out, std::string metavar,
                      std::string help);
  void Bool(std::string name, bool* out, std::string help);
  // Remaining non-flag arguments are collected here; without this they are an error.
  void Positional(std::vector<std::string>* out, std::string metavar, std::string help);

  // Returns -1 when the command should run, otherwise the exit code to return at once.
  int Parse(std::span<const std::string_view> args);
  void PrintUsage(FILE* out) const;

 private:
  struct Flag {
    std::string name, metavar, help;
    bool required = false, is_bool = false, seen = false;
    std::function<bool(std::string_view)> set;  // false: malformed value
    std::string default_text;
    std::string range_text;  // "" when any value of the type is accepted
  };
  // Adds a flag taking an integer in [min, max]; `store` receives each accepted value.
  void AddUint(Flag f, uint64_t min, uint64_t max, std::function<void(uint64_t)> store);

  std::string command_, summary_;
  std::vector<Flag> flags_;
  std::vector<std::string>* positional_ = nullptr;
  std::string positional_metavar_, positional_help_;
};

// Parses a finite number in [min, max]; false otherwise (NaN, infinities, trailing bytes).
bool ParseFiniteDouble(std::string_view text, double min, double max, double* out);

// Splits "a,b,c" into its parts (empty input gives none).
std::vector<std::string> SplitComma(std::string_view text);

// Parses "a,b,c": one to items_max integers, each in [min, max] with no sign, space or
// trailing bytes; false (and *out unspecified) for anything else, an empty item included.
bool ParseUintList(std::string_view text, uint64_t min, uint64_t max, size_t items_max,
                   std::vector<uint64_t>* out);

}  // namespace kvtier::cli
