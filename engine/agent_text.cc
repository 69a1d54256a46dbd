#include "engine/agent_text.h"

namespace kvtier::engine {

std::vector<int32_t> AgentText(uint64_t seed, size_t n) {
  static constexpr const char* kLines[] = {
      "$ rg -n \"Status\" src/ | head\n",
      "src/store.cc:42:  Status s = index_->Put(key, v);\n",
      "assistant: the failing test is StoreTest.Restart; reading store.cc\n",
      "def resume(session):\n    return cache.lookup(session.chain)\n",
      "user: please also check the eviction path\n",
      "tool: 3 files changed, 41 insertions(+)\n",
      "The cache keeps every unit on the SSD tier and promotes it on the first read.\n",
      "ERROR 2026-12-01 10:42:07 worker 3: connection reset by peer, retrying\n"};
  constexpr uint32_t kLineCount = sizeof(kLines) / sizeof(kLines[0]);
  std::vector<int32_t> t;
  t.reserve(n);
  uint32_t s = static_cast<uint32_t>(seed) * 2654435761u + 12345;
  while (t.size() < n) {
    s = s * 1664525u + 1013904223u;
    for (const char* c = kLines[(s >> 24) % kLineCount]; *c != 0 && t.size() < n; ++c) {
      t.push_back(3 + static_cast<uint8_t>(*c));
    }
  }
  return t;
}

}  // namespace kvtier::engine
