#include "tests/engine/speculative_test_util.h"

#include <cstdlib>
#include <cstring>
#include <utility>

#include "engine/sampler.h"

namespace kvtier::engine::testing_spec {

std::string Src(const std::string& rel) { return std::string(KVTIER_SOURCE_DIR) + "/" + rel; }

const Trained& Model() {
  static const Trained* t = [] {
    auto* m = new Trained();
    auto c = LoadEngineConfig(Src("deploy/models/kvmini-trained.json"));
    if (!c.ok()) {
      ADD_FAILURE() << c.status().ToString();
      std::abort();
    }
    m->config = *c;
    auto dc = LoadDSparkConfig(Src("deploy/models/kvmini-trained.json"), m->config);
    auto w = LoadWeights(m->config, Src("deploy/models/kvmini-trained.safetensors"));
    if (!dc.ok() || !w.ok()) {
      ADD_FAILURE() << dc.status().ToString() << " " << w.status().ToString();
      std::abort();
    }
    m->dconfig = *dc;
    m->weights = std::make_shared<const ModelWeights>(std::move(*w));
    auto d = DSpark::Load(m->config, m->dconfig, m->weights,
                          Src("deploy/models/kvmini-trained-dspark.safetensors"));
    if (!d.ok()) {
      ADD_FAILURE() << d.status().ToString();
      std::abort();
    }
    m->draft = std::move(*d);
    return m;
  }();
  return *t;
}

std::unique_ptr<Engine> MakeEngine() {
  auto e = Engine::Create(Model().config, Model().weights, EngineOptions{});
  if (!e.ok()) {
    ADD_FAILURE() << e.status().ToString();
    std::abort();
  }
  return std::move(*e);
}

std::vector<int32_t> Bytes(const std::string& s) {
  std::vector<int32_t> t = {0};  // bos
  for (unsigned char ch : s) t.push_back(3 + ch);
  return t;
}

const std::vector<std::string>& Texts() {
  static const std::vector<std::string> t = {
      "#include <stdio.h>\n\nint main(int argc, char **argv) {\n  ",
      "    def __init__(self, name, value=None):\n        self.",
      "This program is free software; you can redistribute it and/or modify\nit ",
      "2023-04-01  John Smith  <jsmith@example.org>\n\n\t* configure.ac: ",
      "NAME\n       ls - list directory contents\n\nSYNOPSIS\n       ls [",
      "  if (ret < 0) {\n    fprintf(stderr, \"error: %s\\n\", strerror(errno));\n",
      "import os\nimport sys\n\n\ndef main():\n    parser = argparse.",
      "PASS: test-suite/basic.exp: print the value\nPASS: ",
      "The GNU General Public License is a free, copyleft license for\n",
      "for (i = 0; i < n; i++) {\n\t\tif (a[i] == ",
      "set(CMAKE_CXX_STANDARD 20)\nadd_library(",
      "       -a, --all\n              do not ignore entries starting with .\n\n",
  };
  return t;
}

::testing::AssertionResult SameState(const SequenceState& a, const SequenceState& b) {
  if (a.tokens != b.tokens) return ::testing::AssertionFailure() << "tokens differ";
  if (a.swa.size() != b.swa.size() || a.kv.size() != b.kv.size())
    return ::testing::AssertionFailure() << "layout differs";
  auto fbits = [](const std::vector<float>& x, const std::vector<float>& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * 4) == 0;
  };
  for (size_t l = 0; l < a.swa.size(); ++l) {
    const SwaRing &x = a.swa[l], &y = b.swa[l];
    if (x.window != y.window || x.dim != y.dim || x.valid_from != y.valid_from || x.end != y.end ||
        !fbits(x.values, y.values) || x.data != y.data || x.scales != y.scales)
      return ::testing::AssertionFailure() << "SWA ring of layer " << l << " differs";
  }
  for (size_t i = 0; i < a.kv.size(); ++i) {
    const KvSourceCache &x = a.kv[i], &y = b.kv[i];
    if (x.layer != y.layer || x.ratio != y.ratio || x.head_dim != y.head_dim ||
        x.index_dim != y.index_dim || x.consumed != y.consumed || x.entries() != y.entries())
      return ::testing::AssertionFailure() << "kv source " << x.layer << " header differs";
    if (x.main_data != y.main_data || x.main_scales != y.main_scales ||
        x.index_data != y.index_data || x.index_scales != y.index_scales)
      return ::testing::AssertionFailure() << "kv source " << x.layer << " entries differ";
    if (!fbits(x.kv_state, y.kv_state) || !fbits(x.score_state, y.score_state))
      return ::testing::AssertionFailure() << "kv source " << x.layer << " partial group differs";
  }
  return ::testing::AssertionSuccess();
}

void PlainGreedy(Engine* e, const std::vector<int32_t>& prompt, int count,
                 std::vector<int32_t>* tokens, std::vector<SequenceState>* states) {
  Sampler greedy(0, 1, 0);
  SequenceState plain = e->NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(e->Forward(&plain, prompt, false, &logits).ok());
  for (int i = 0; i < count; ++i) {
    tokens->push_back(greedy.Sample(logits));
    ASSERT_TRUE(e->Decode(&plain, tokens->back(), &logits).ok());
    states->push_back(plain);
  }
}

}  // namespace kvtier::engine::testing_spec
