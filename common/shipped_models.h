// The model configurations shipped in deploy/models/, embedded into the binary at build time
// (common/CMakeLists.txt generates the definitions from the JSON files), so that `kvtier demo`
// and tests work from any directory without locating the source tree.
//
// Thread safety: immutable static data.
#pragma once

#include <span>
#include <string_view>

namespace kvtier {

struct ShippedModel {
  std::string_view name;         // file stem, e.g. "mini-v4.1"
  std::string_view source_path;  // path in the repository, e.g. "deploy/models/mini-v4.1.json"
  std::string_view config_json;  // the file's bytes
};

// Every shipped model, in a fixed order: "deepseek-v4.1-flash", "mini-v4.1".
std::span<const ShippedModel> ShippedModels();

// The shipped model called `name`, or nullptr when there is none.
const ShippedModel* FindShippedModel(std::string_view name);

}  // namespace kvtier
