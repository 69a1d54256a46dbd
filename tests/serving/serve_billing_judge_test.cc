// The billing judge (label e2e; KVTIER_BILLING_JUDGE_SLOW: label slow, many more requests and
// kills): the real kvtierd (auth on, three tenants) and the real `kvtier-engine serve` with a
// small KV pool and few idle sequences (so sequences are swapped out to kvtierd and resumed),
// driven by concurrent clients with random conversations, while kvtierd is SIGKILLed and
// restarted on its data directory and clients disconnect mid-stream. Every response is judged:
//
//  - HTTP 200, also while kvtierd is down (docs/SERVING.md: the prompt is computed instead);
//  - usage is consistent: cached_tokens == prompt_cache_hit_tokens, hit + miss == prompt,
//    prompt_tokens == the test's own tokenization (the server's template and tokenizer);
//  - an upper bound on cached_tokens the test derives from what it sent: the longest prefix
//    shared with a sequence THIS tenant ran earlier, counted as docs/SERVING.md says (whole
//    64-token pages of units, or all of a saved or resident state that prefixes the prompt);
//    while kvtierd is down throughout, no unit can hit;
//  - a lower bound where it is certain: an exact continuation of a turn that completed while
//    kvtierd was up and connected, with no kill since, hits at least that turn's whole pages;
//  - greedy text, finish reason and completion tokens equal a cache-off server's (the oracle);
//    the server replays whole hits (--replay-tokens), the one configuration where every
//    restore is exact (docs/RESUME.md, "Fidelity": a bounded replay is an approximation);
//  - at the end both processes are up, a swapped-out turn resumes from the restarted kvtierd,
//    and /metrics' per-tenant token and cost counters equal the sums of the usage seen.
//
// The seed is fixed; KVTIER_BILLING_JUDGE_SEED overrides it, and every failure prints it.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/key_spec.h"
#include "engine/tokenizer.h"
#include "serving/chat_template.h"
#include "serving/openai_api.h"
#include "serving/usage.h"
#include "tests/e2e/kvtierd_process.h"
#include "tests/serving/prompt_text.h"
#include "tests/serving/serve_process.h"

namespace kvtier::testing {
namespace {

using nlohmann::json;

#ifdef KVTIER_BILLING_JUDGE_SLOW
constexpr int kThreads = 4;
constexpr int kRequestsPerThread = 400;
constexpr int kKillsMax = 12;
#else
constexpr int kThreads = 4;
constexpr int kRequestsPerThread = 100;
constexpr int kKillsMax = 3;
#endif
constexpr int64_t kPageTokens = 64;
constexpr size_t kPromptBytesMax = 460;  // a conversation longer than this starts over
constexpr int kMaxTokensMax = 12;        // of a judged request (a disconnecting one asks more)
constexpr uint64_t kDefaultSeed = 20260531;

struct TenantInfo {
  const char* name;
  const char* key;
  serving::Prices prices;
  bool disconnects;  // its clients also go away mid-stream (its counters are then lower bounds)
};
const TenantInfo kTenants[] = {
    {"alice", "sk-alice-0123456789", {1.0, 0.02, 2.0}, false},
    {"bob", "sk-bob-0123456789", {0.28, 0.0056, 0.42}, false},
    {"carol", "sk-carol-0123456789", {3.0, 0.06, 15.0}, true},
};
constexpr int kTenantCount = 3;

uint64_t Seed() {
  const char* e = std::getenv("KVTIER_BILLING_JUDGE_SEED");
  return e != nullptr ? std::strtoull(e, nullptr, 10) : kDefaultSeed;
}

// One request the judge saw, in the order of a global event clock (sent < done).
struct Record {
  int id = 0;
  int tenant = 0;
  std::string kind;
  std::string path;
  json body;
  std::vector<int32_t> prompt;  // the test's tokenization
  bool disconnect = false;      // the client went away after the first event
  int64_t sent_at = 0, done_at = 0;
  int phase_sent = 0, phase_done = 0;  // kvtierd phase (even: up) at send and at reply
  bool healthy_sent = false;           // the tenant's kvtierd connection was known good at send
  int status = 0;
  std::string text, finish;
  json usage;
  std::string raw;          // the reply, for failure messages
  int continues = -1;       // the record whose turn this request continues exactly, if any
  std::string oracle_text;  // filled by the judge
};

class BillingJudgeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = Seed();
    dir_ = std::filesystem::temp_directory_path() /
           ("kvtier_billing_judge_" + std::to_string(getpid()));
    std::filesystem::remove_all(dir_);
    d_ = std::make_unique<KvtierdProcess>(dir_ / "d");
    {
      std::ofstream t(dir_ / "tokens.toml");
      for (int i = 0; i < kTenantCount; ++i) {
        t << "[[tenant]]\nname = \"" << kTenants[i].name << "\"\nid = " << i + 1
          << "\ntoken_sha256 = [\"" << TokenSha256Hex(std::string(kTenants[i].name) + "-token")
          << "\"]\n";
      }
    }
    d_->WriteConfig(
        "[storage]\ndram_capacity_bytes = 134217728\nssd_capacity_bytes = 268435456\n"
        "ssd_segment_bytes = 16777216\n[auth]\ntokens_file = \"" +
        (dir_ / "tokens.toml").string() + "\"\n");
    ASSERT_TRUE(d_->Start()) << d_->Log();
    json keys = json::array();
    for (const TenantInfo& t : kTenants) {
      keys.push_back({{"key", t.key},
                      {"tenant", t.name},
                      {"daemon_token", std::string(t.name) + "-token"},
                      {"prices",
                       {{"input_per_mtok", t.prices.input_per_mtok},
                        {"cached_input_per_mtok", t.prices.cached_input_per_mtok},
                        {"output_per_mtok", t.prices.output_per_mtok}}}});
    }
    std::ofstream(dir_ / "keys.json") << json{{"keys", keys}};
    // A pool of about two prompts and two idle sequences: turns are swapped out and resumed.
    s_ = std::make_unique<ServeProcess>(dir_ / "s");
    ASSERT_TRUE(s_->Start({"--socket",
                           d_->socket(),
                           "--api-keys",
                           (dir_ / "keys.json").string(),
                           "--guard",
                           "fetch",
                           "--kv-pool-tokens-max",
                           "1100",
                           "--idle-sequences-max",
                           "2",
                           "--active-sequences-max",
                           "3",
                           "--context-tokens-max",
                           "600",
                           "--prefill-chunk-tokens",
                           "96",
                           "--step-tokens-max",
                           "128",
                           "--replay-tokens",
                           "1024"}))
        << s_->Log();
    oracle_ = std::make_unique<ServeProcess>(dir_ / "oracle");
    ASSERT_TRUE(oracle_->Start({"--context-tokens-max", "600"})) << oracle_->Log();
    auto tok = engine::ByteTokenizer::Create(512, 2, 511);
    ASSERT_TRUE(tok.ok());
    tokenizer_ = std::make_unique<engine::ByteTokenizer>(*tok);
  }
  void TearDown() override {
    if (HasFailure()) {
      std::fprintf(stderr, "billing judge seed: KVTIER_BILLING_JUDGE_SEED=%llu\n",
                   static_cast<unsigned long long>(seed_));
      const std::string s = s_ != nullptr ? s_->Log() : "", d = d_ != nullptr ? d_->Log() : "";
      std::fprintf(stderr, "---- serve log (tail) ----\n%s\n---- kvtierd log (tail) ----\n%s\n",
                   s.substr(s.size() > 20000 ? s.size() - 20000 : 0).c_str(),
                   d.substr(d.size() > 8000 ? d.size() - 8000 : 0).c_str());
    }
    s_.reset();
    oracle_.reset();
    d_.reset();
    if (HasFailure()) {
      std::fprintf(stderr, "full logs kept in %s\n", dir_.c_str());
    } else {
      std::filesystem::remove_all(dir_);
    }
  }

  // The prompt tokens the server computes for `body`: its parser, template and tokenizer.
  std::vector<int32_t> Tokens(const std::string& path, const json& body) const {
    const bool chat = path == "/v1/chat/completions";
    serving::CompletionRequest cr;
    const serving::ApiError e =
        serving::ParseCompletionRequest(body.dump(), chat, serving::ApiLimits{}, &cr);
    if (!e.ok()) return {};
    return tokenizer_->Encode(chat ? serving::RenderChat(cr.messages) : cr.prompt);
  }

  // Sends `r` (filled: tenant, path, body) and records its reply.
  void Send(Record* r) {
    r->prompt = Tokens(r->path, r->body);
    r->phase_sent = phase_.load();
    r->healthy_sent = healthy_phase_[r->tenant].load() == r->phase_sent;
    r->sent_at = clock_.fetch_add(1);
    if (r->disconnect) {
      const int fd = ConnectTcp(s_->port());
      if (fd >= 0) {
        const std::string b = r->body.dump();
        const std::string req = "POST " + r->path +
                                " HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " +
                                kTenants[r->tenant].key +
                                "\r\nContent-Length: " + std::to_string(b.size()) + "\r\n\r\n" + b;
        SendAllRaw(fd, req.data(), req.size());
        r->raw = RecvFor(fd, 300, 10000);
        ::close(fd);
      }
    } else {
      HttpReply h = Http(s_->port(), "POST", r->path, r->body.dump(), kTenants[r->tenant].key);
      r->status = h.status;
      r->raw = h.body;
      ParseInto(h, r);
    }
    r->phase_done = phase_.load();
    r->done_at = clock_.fetch_add(1);
    done_count_.fetch_add(1);
    std::lock_guard l(mu_);
    r->id = static_cast<int>(records_.size());
    records_.push_back(*r);
  }

  // Text, finish reason and usage of a reply, streamed or not ("" / null when absent).
  static void ParseInto(const HttpReply& h, Record* r) {
    const bool chat = r->path == "/v1/chat/completions";
    if (h.status != 200) return;
    if (!r->body.value("stream", false)) {
      json j = h.Json();
      if (!j.is_object() || !j.contains("choices") || j["choices"].empty()) return;
      const json& c = j["choices"][0];
      r->text = chat ? c["message"]["content"].get<std::string>() : c["text"].get<std::string>();
      r->finish = c["finish_reason"].is_string() ? c["finish_reason"].get<std::string>() : "";
      r->usage = j.value("usage", json());
      return;
    }
    const std::vector<json> events = h.Events();
    if (events.empty() || events.back() != "[DONE]") {
      r->finish = "<stream without [DONE]>";
      return;
    }
    for (const json& e : events) {
      if (!e.is_object()) continue;
      if (e.contains("usage") && e["usage"].is_object()) r->usage = e["usage"];
      if (!e.contains("choices") || e["choices"].empty()) continue;
      const json& c = e["choices"][0];
      if (chat && c["delta"].contains("content"))
        r->text += c["delta"]["content"].get<std::string>();
      if (!chat && c.contains("text")) r->text += c["text"].get<std::string>();
      if (c["finish_reason"].is_string()) r->finish = c["finish_reason"];
    }
  }

  // SIGKILLs kvtierd (phase becomes odd: down).
  void KillDaemon() {
    phase_.fetch_add(1);
    d_->Stop(SIGKILL);
  }
  // Restarts kvtierd on its data directory, then makes each tenant's connection known good:
  // two requests of at least a page each (the first may still meet the dead connection, whose
  // failed save drops it; the second connects afresh).
  bool RestartDaemon(uint32_t salt) {
    phase_.fetch_add(1);
    if (!d_->Start()) return false;
    for (int t = 0; t < kTenantCount; ++t) {
      for (int i = 0; i < 2; ++i) {
        Record r;
        r.tenant = t;
        r.kind = "warm-up";
        r.path = "/v1/completions";
        r.body = {{"model", "kvmini-trained"},
                  {"prompt", "warm-up " + PromptText(100, salt * 16 + t * 2 + i)},
                  {"max_tokens", 2},
                  {"temperature", 0}};
        Send(&r);
      }
      healthy_phase_[t].store(phase_.load());
    }
    return true;
  }

  // One client: `kRequestsPerThread` random requests.
  void Client(int thread_index) {
    std::mt19937_64 rng(seed_ * 1000003 + thread_index);
    auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    struct Conversation {
      int tenant;
      bool chat;
      json messages;       // chat: the messages sent last
      std::string prompt;  // completions: the prompt sent last
      int last = -1;       // the record of the last turn (-1: none completed)
    };
    std::vector<Conversation> convs;
    auto text = [&](int lo, int hi) {
      return PromptText(static_cast<size_t>(uniform(lo, hi)), static_cast<uint32_t>(rng()));
    };
    static const char* const kStops[] = {"cache", "the t", "e ", "tier"};
    for (int n = 0; n < kRequestsPerThread; ++n) {
      Record r;
      r.tenant = uniform(0, kTenantCount - 1);
      const int op = uniform(0, 99);
      Conversation* conv = nullptr;
      if (!convs.empty())
        conv = &convs[static_cast<size_t>(uniform(0, static_cast<int>(convs.size()) - 1))];
      json body = {{"model", "kvmini-trained"}, {"temperature", 0}};
      const bool cross = op >= 82 && op < 90;
      if ((op < 30 || cross) && conv != nullptr && conv->last >= 0) {
        // The exact next turn of a conversation: its last turn + reply + a new message. Sent
        // by another tenant (cross), it must not find this tenant's resident sequence or units.
        Record last;
        {
          std::lock_guard l(mu_);
          last = records_[static_cast<size_t>(conv->last)];
        }
        json messages = conv->messages;
        std::string prompt = conv->prompt;
        if (conv->chat) {
          messages.push_back({{"role", "assistant"}, {"content", last.text}});
          messages.push_back({{"role", "user"}, {"content", text(10, 120)}});
        } else {
          prompt += last.text + text(10, 120);
        }
        if (cross) {
          r.tenant = (conv->tenant + uniform(1, kTenantCount - 1)) % kTenantCount;
          r.kind = "cross-continue";
          r.path = conv->chat ? "/v1/chat/completions" : "/v1/completions";
          r.body = body;
          r.body[conv->chat ? "messages" : "prompt"] = conv->chat ? messages : json(prompt);
          r.body["max_tokens"] = uniform(1, kMaxTokensMax);
        } else {
          r.tenant = conv->tenant;
          r.kind = "continue";
          r.continues = last.id;
          conv->messages = messages;
          conv->prompt = prompt;
        }
      } else if (op < 45 && conv != nullptr) {
        // A branch: the conversation's prefix with a different tail (A + B, then A + C).
        r.tenant = conv->tenant;
        r.kind = "branch";
        if (conv->chat) {
          std::string& c = conv->messages.back()["content"].get_ref<std::string&>();
          c = c.substr(0, static_cast<size_t>(uniform(0, static_cast<int>(c.size())))) +
              text(5, 90);
        } else {
          conv->prompt =
              conv->prompt.substr(
                  0, static_cast<size_t>(uniform(static_cast<int>(conv->prompt.size()) / 2,
                                                 static_cast<int>(conv->prompt.size())))) +
              text(5, 90);
        }
      } else if (op < 55 || op >= 90) {
        // Repeat (same tenant) or another tenant's identical request, from any thread's.
        std::lock_guard l(mu_);
        if (!records_.empty()) {
          const Record& old =
              records_[static_cast<size_t>(uniform(0, static_cast<int>(records_.size()) - 1))];
          r.kind = op < 55 ? "repeat" : "cross-tenant";
          r.tenant =
              op < 55 ? old.tenant : (old.tenant + uniform(1, kTenantCount - 1)) % kTenantCount;
          r.path = old.path;
          r.body = old.body;
          r.body.erase("stream");
          r.body.erase("stream_options");
        }
      }
      if (r.kind.empty()) {
        // A new conversation.
        Conversation c;
        c.tenant = r.tenant;
        c.chat = uniform(0, 1) == 1;
        if (c.chat) {
          c.messages = json::array();
          if (uniform(0, 2) == 0)
            c.messages.push_back({{"role", "system"}, {"content", text(10, 80)}});
          c.messages.push_back({{"role", "user"}, {"content", text(20, 220)}});
        } else {
          c.prompt = text(30, 300);
        }
        if (convs.size() >= 4) convs.erase(convs.begin());
        convs.push_back(c);
        conv = &convs.back();
        r.kind = "new";
      }
      if (r.body.contains("max_tokens")) {
        // a repeat: the body is complete
      } else {
        if (conv->chat) {
          r.path = "/v1/chat/completions";
          body["messages"] = conv->messages;
        } else {
          r.path = "/v1/completions";
          body["prompt"] = conv->prompt;
        }
        body["max_tokens"] = uniform(1, kMaxTokensMax);
        if (uniform(0, 6) == 0) body["stop"] = kStops[uniform(0, 3)];
        r.body = body;
      }
      if (uniform(0, 1) == 1) {
        r.body["stream"] = true;
        r.body["stream_options"] = {{"include_usage", true}};
      }
      if (kTenants[r.tenant].disconnects && uniform(0, 9) == 0) {
        r.kind += "+disconnect";
        r.disconnect = true;
        r.body["stream"] = true;
        r.body["max_tokens"] = uniform(30, 80);
      }
      if (Tokens(r.path, r.body).size() > kPromptBytesMax) {  // too long: start over next time
        if (r.kind == "repeat" || r.kind == "cross-tenant" || r.kind == "cross-continue") continue;
        convs.erase(std::remove_if(convs.begin(), convs.end(),
                                   [&](const Conversation& c) { return &c == conv; }),
                    convs.end());
        continue;
      }
      Send(&r);
      if (conv != nullptr && r.tenant == conv->tenant && !r.disconnect && r.status == 200 &&
          (r.kind == "new" || r.kind == "continue" || r.kind == "branch")) {
        conv->last = r.id;
      } else if (conv != nullptr && (r.kind == "continue" || r.kind == "branch")) {
        conv->last = -1;  // the turn failed or went away: no exact continuation of it
      }
    }
  }

  // The oracle's text and finish reason for a body (cache-off server, memoized).
  std::pair<std::string, json> Oracle(const Record& r) {
    json b = r.body;
    b.erase("stream");
    b.erase("stream_options");
    const std::string key = r.path + b.dump();
    auto it = oracle_cache_.find(key);
    if (it != oracle_cache_.end()) return it->second;
    HttpReply h = Http(oracle_->port(), "POST", r.path, b.dump());
    json j = h.Json();
    std::pair<std::string, json> out;
    if (h.status == 200 && j.is_object()) {
      const json& c = j["choices"][0];
      out.first = r.path == "/v1/chat/completions" ? c["message"]["content"].get<std::string>()
                                                   : c["text"].get<std::string>();
      out.second = {{"finish", c["finish_reason"]}, {"usage", j["usage"]}};
    } else {
      out.second = {{"error", h.body}};
    }
    oracle_cache_[key] = out;
    return out;
  }

  // What an earlier request `q` may have left in the cache for a later prompt: `base`, a token
  // sequence, and how the saved or resident state relates to it.
  struct Candidate {
    std::vector<int32_t> base;
    int64_t extra_tokens = 0;         // tokens the state may hold past base (unknown ids)
    bool state_extends_base = false;  // every state saved holds base whole (a completed turn)
  };
  static Candidate CandidateOf(const Record& q) {
    Candidate c;
    const int64_t max_tokens = q.body.value("max_tokens", 0);
    if (q.disconnect || q.status != 200 || !q.usage.is_object()) {
      // Some prefix of the prompt and of at most max_tokens - 1 sampled tokens.
      c.base = q.prompt;
      c.extra_tokens = std::max<int64_t>(0, max_tokens - 1);
      return c;
    }
    // A finished turn's state: the prompt and every sampled token but the last. Its text is
    // those tokens' bytes (stop strings, eos and non-byte ids produce no text).
    const int64_t completion = q.usage["completion_tokens"];
    std::vector<int32_t> text_tokens;
    for (unsigned char ch : q.text) text_tokens.push_back(engine::ByteTokenizer::kByteBase + ch);
    c.base = q.prompt;
    const int64_t forwarded = completion - 1;
    if (forwarded <= static_cast<int64_t>(text_tokens.size())) {
      c.base.insert(c.base.end(), text_tokens.begin(), text_tokens.begin() + forwarded);
    } else {
      c.base.insert(c.base.end(), text_tokens.begin(), text_tokens.end());
      c.extra_tokens = forwarded - static_cast<int64_t>(text_tokens.size());
    }
    c.state_extends_base = true;
    return c;
  }
  static int64_t SharedPrefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
    const size_t n = std::min(a.size(), b.size());
    size_t i = 0;
    while (i < n && a[i] == b[i]) ++i;
    return static_cast<int64_t>(i);
  }
  // The most cached_tokens `r` may report from candidate `c` (docs/SERVING.md, "Usage"):
  // units are whole pages of the shared prefix; a state that prefixes the prompt whole may be
  // resident or restored with its hot state; while kvtierd is down throughout, only resident.
  static int64_t Bound(const Record& r, const Candidate& c, bool daemon_down) {
    const int64_t shared = SharedPrefix(r.prompt, c.base);
    const int64_t prompt = static_cast<int64_t>(r.prompt.size());
    if (shared == static_cast<int64_t>(c.base.size()))
      return std::min(prompt, shared + c.extra_tokens);
    if (!c.state_extends_base) return shared;  // the state may be any prefix of base
    return daemon_down ? 0 : shared / kPageTokens * kPageTokens;
  }

  // The turns of the conversation `q` ends, oldest last, one line each (failure messages).
  static std::string History(const Record& q, const std::vector<Record>& all) {
    std::string out;
    for (const Record* t = &q; t != nullptr;
         t = t->continues >= 0 ? &all[static_cast<size_t>(t->continues)] : nullptr) {
      out += "  request " + std::to_string(t->id) + " (" + t->kind + "): phase " +
             std::to_string(t->phase_sent) + ".." + std::to_string(t->phase_done) + ", events " +
             std::to_string(t->sent_at) + ".." + std::to_string(t->done_at) + ", prompt " +
             std::to_string(t->prompt.size()) + ", usage " + t->usage.dump() + "\n";
    }
    return out;
  }

  void Judge(Record& r, const std::vector<Record>& all) {
    SCOPED_TRACE("request " + std::to_string(r.id) + " (" + r.kind + ", tenant " +
                 kTenants[r.tenant].name + ", " + r.path + "): " + r.body.dump() +
                 "\nreply: " + r.raw.substr(0, 2000));
    if (r.disconnect) return;  // nothing is reported to a client that went away
    ASSERT_EQ(r.status, 200);
    ASSERT_TRUE(r.usage.is_object());
    const int64_t prompt = r.usage["prompt_tokens"], completion = r.usage["completion_tokens"];
    const int64_t cached = r.usage["prompt_tokens_details"]["cached_tokens"];
    EXPECT_EQ(prompt, static_cast<int64_t>(r.prompt.size()));
    EXPECT_EQ(r.usage["prompt_cache_hit_tokens"], cached);
    EXPECT_EQ(cached + r.usage["prompt_cache_miss_tokens"].get<int64_t>(), prompt);
    EXPECT_EQ(r.usage["total_tokens"].get<int64_t>(), prompt + completion);
    EXPECT_GE(cached, 0);
    EXPECT_GE(completion, 1);
    EXPECT_LE(completion, r.body["max_tokens"].get<int64_t>());
    if (r.finish == "length") {
      EXPECT_EQ(completion, r.body["max_tokens"].get<int64_t>());
    }
    // Upper bound: this tenant's earlier requests only.
    const bool down = r.phase_sent == r.phase_done && r.phase_sent % 2 == 1;
    int64_t bound = 0;
    for (const Record& q : all) {
      if (q.id == r.id || q.tenant != r.tenant || q.sent_at > r.done_at) continue;
      bound = std::max(bound, Bound(r, CandidateOf(q), down));
    }
    EXPECT_LE(cached, bound) << (down ? "kvtierd was down throughout" : "");
    // Lower bound: an exact continuation of a turn whose save and resume are both certain.
    if (r.continues >= 0) {
      const Record& q = all[static_cast<size_t>(r.continues)];
      const Candidate c = CandidateOf(q);
      const bool exact_turn =
          c.state_extends_base && c.extra_tokens == 0 && !q.body.contains("stop");
      if (exact_turn && q.healthy_sent && q.phase_sent == r.phase_done && q.done_at < r.sent_at &&
          static_cast<int64_t>(c.base.size()) >= kPageTokens &&
          SharedPrefix(r.prompt, c.base) == static_cast<int64_t>(c.base.size())) {
        // Its whole pages at least: a resident sequence shorter than them gives way to
        // kvtierd's units (the hot state of the partial page is not probed for a resident one).
        ++lower_bounds_checked_;
        EXPECT_GE(cached, static_cast<int64_t>(c.base.size()) / kPageTokens * kPageTokens)
            << "an exact continuation of request " << q.id << " lost its hit; its turns:\n"
            << History(q, all);
      }
    }
    // Output: the oracle's. The server replays whole hits (--replay-tokens covers every
    // prompt), so a restore is exact whatever the hit; with the default bounded replay it is an
    // approximation (docs/RESUME.md, "Fidelity") that a later hot state or unit inherits.
    const auto [text, meta] = Oracle(r);
    ASSERT_FALSE(meta.contains("error")) << meta.dump();
    ++texts_compared_;
    EXPECT_EQ(r.text, text) << "greedy output differs from the cache-off server's";
    EXPECT_EQ(r.finish, meta["finish"]);
    EXPECT_EQ(completion, meta["usage"]["completion_tokens"]);
  }

  uint64_t seed_ = 0;
  std::filesystem::path dir_;
  std::unique_ptr<KvtierdProcess> d_;
  std::unique_ptr<ServeProcess> s_;
  std::unique_ptr<ServeProcess> oracle_;
  std::unique_ptr<engine::ByteTokenizer> tokenizer_;
  std::atomic<int64_t> clock_{0};
  std::atomic<int> phase_{0};
  std::atomic<int> healthy_phase_[kTenantCount] = {};
  std::atomic<int> done_count_{0};
  std::mutex mu_;
  std::vector<Record> records_;  // guarded by mu_ while clients run
  std::map<std::string, std::pair<std::string, json>> oracle_cache_;
  int texts_compared_ = 0, lower_bounds_checked_ = 0;
};

TEST_F(BillingJudgeTest, EveryResponseIsBilledAsTheCacheAllows) {
  SCOPED_TRACE("KVTIER_BILLING_JUDGE_SEED=" + std::to_string(seed_));
  std::mt19937_64 rng(seed_);
  std::vector<std::thread> clients;
  std::atomic<int> clients_done{0};
  for (int i = 0; i < kThreads; ++i) {
    clients.emplace_back([this, i, &clients_done] {
      Client(i);
      clients_done.fetch_add(1);
    });
  }
  // Disturbances at random points of the request stream: kvtierd killed, requests served while
  // it is down, restarted on the same data directory.
  const int total = kThreads * kRequestsPerThread;
  int kills = 0;
  auto wait_done = [&](int count) {
    while (done_count_.load() < count && clients_done.load() < kThreads)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
  };
  while (kills < kKillsMax && clients_done.load() < kThreads) {
    const int at = done_count_.load() + std::uniform_int_distribution<int>(
                                            total / (kKillsMax + 2), total / (kKillsMax + 1))(rng);
    wait_done(at);
    if (clients_done.load() == kThreads) break;
    KillDaemon();
    ++kills;
    wait_done(done_count_.load() + std::uniform_int_distribution<int>(3, 12)(rng));
    ASSERT_TRUE(RestartDaemon(static_cast<uint32_t>(kills))) << d_->Log();
  }
  for (auto& t : clients) t.join();
  ASSERT_TRUE(s_->Alive());
  ASSERT_TRUE(d_->Alive());

  // After the last restart a swapped-out turn resumes from kvtierd (units + hot state).
  {
    Record q;
    q.tenant = 0;
    q.kind = "final-turn";
    q.path = "/v1/completions";
    q.body = {{"model", "kvmini-trained"},
              {"prompt", PromptText(260, static_cast<uint32_t>(seed_))},
              {"max_tokens", 8},
              {"temperature", 0}};
    Send(&q);
    ASSERT_EQ(q.status, 200) << q.raw;
    for (int i = 0; i < 3; ++i) {  // push it out of the two idle places
      Record o;
      o.tenant = 0;
      o.kind = "final-filler";
      o.path = "/v1/completions";
      o.body = {{"model", "kvmini-trained"},
                {"prompt", "filler " + PromptText(40, static_cast<uint32_t>(seed_) + 1 + i)},
                {"max_tokens", 2},
                {"temperature", 0}};
      Send(&o);
    }
    const std::string before = Http(s_->port(), "GET", "/metrics").body;
    Record r;
    r.tenant = 0;
    r.kind = "final-resume";
    r.path = "/v1/completions";
    r.continues = q.id;
    r.body = q.body;
    r.body["prompt"] = q.body["prompt"].get<std::string>() + q.text + " and more";
    Send(&r);
    const std::string after = Http(s_->port(), "GET", "/metrics").body;
    EXPECT_EQ(Metric(after, "kvtier_serve_hot_state_restores_total") -
                  Metric(before, "kvtier_serve_hot_state_restores_total"),
              1);
    EXPECT_EQ(Metric(after, "kvtier_serve_resident_hits_total"),
              Metric(before, "kvtier_serve_resident_hits_total"));
  }

  // Judge every response (all requests are in; the bounds need the whole history).
  std::vector<Record> all = records_;
  for (Record& r : all) Judge(r, all);
  int disconnects = 0, hits = 0, page_hits = 0, while_down = 0;
  for (const Record& r : all) {
    disconnects += r.disconnect;
    while_down += r.phase_sent % 2 == 1 || r.phase_done != r.phase_sent;
    if (r.disconnect || !r.usage.is_object()) continue;
    const int64_t cached = r.usage["prompt_tokens_details"]["cached_tokens"];
    hits += cached > 0;
    page_hits += cached > 0 && cached % kPageTokens == 0;
  }
  std::printf(
      "billing judge: seed %llu, %zu requests (%d disconnected, %d sent or answered while "
      "kvtierd was down), %d kvtierd kills, %d hits (%d page multiples), %d outputs compared "
      "with the oracle, %d lower bounds checked\n",
      static_cast<unsigned long long>(seed_), all.size(), disconnects, while_down, kills, hits,
      page_hits, texts_compared_, lower_bounds_checked_);
  EXPECT_GT(lower_bounds_checked_, 0);

  // /metrics: each tenant's counters are the sums of the usage its clients saw (a tenant whose
  // clients went away: at least those, as a cancelled request is counted but not reported),
  // and its cost is its prices applied to them.
  const std::string m = Http(s_->port(), "GET", "/metrics").body;
  for (int t = 0; t < kTenantCount; ++t) {
    SCOPED_TRACE(kTenants[t].name);
    serving::Usage sum;
    double cost = 0;
    for (const Record& r : all) {
      if (r.tenant != t || r.disconnect || !r.usage.is_object()) continue;
      serving::Usage u;
      u.prompt_tokens = r.usage["prompt_tokens"];
      u.cached_tokens = r.usage["prompt_tokens_details"]["cached_tokens"];
      u.completion_tokens = r.usage["completion_tokens"];
      sum.prompt_tokens += u.prompt_tokens;
      sum.cached_tokens += u.cached_tokens;
      sum.completion_tokens += u.completion_tokens;
      cost += serving::Cost(u, kTenants[t].prices);
    }
    const std::string label = std::string("{tenant=\"") + kTenants[t].name + "\"}";
    serving::Usage got;
    got.prompt_tokens = static_cast<int64_t>(Metric(m, "kvtier_serve_prompt_tokens_total" + label));
    got.cached_tokens =
        static_cast<int64_t>(Metric(m, "kvtier_serve_prompt_cache_hit_tokens_total" + label));
    got.completion_tokens =
        static_cast<int64_t>(Metric(m, "kvtier_serve_completion_tokens_total" + label));
    EXPECT_EQ(Metric(m, "kvtier_serve_prompt_cache_miss_tokens_total" + label),
              static_cast<double>(got.miss_tokens()));
    const double got_cost = Metric(m, "kvtier_serve_cost_total" + label);
    EXPECT_NEAR(got_cost, serving::Cost(got, kTenants[t].prices), 1e-9 * (1 + got_cost));
    if (kTenants[t].disconnects) {
      EXPECT_GE(got.prompt_tokens, sum.prompt_tokens);
      EXPECT_GE(got.cached_tokens, sum.cached_tokens);
      EXPECT_GE(got.completion_tokens, sum.completion_tokens);
    } else {
      EXPECT_EQ(got.prompt_tokens, sum.prompt_tokens);
      EXPECT_EQ(got.cached_tokens, sum.cached_tokens);
      EXPECT_EQ(got.completion_tokens, sum.completion_tokens);
      EXPECT_NEAR(got_cost, cost, 1e-9 * (1 + cost));
    }
  }
  // Cached tokens were not computed: the steps prefilled every reported miss token, and no
  // more than those plus the prompts of the requests whose clients went away.
  int64_t miss = 0, slack = 0;
  for (const Record& r : all) {
    if (r.disconnect) {
      slack += static_cast<int64_t>(r.prompt.size());
    } else if (r.usage.is_object()) {
      miss += r.usage["prompt_cache_miss_tokens"].get<int64_t>();
    }
  }
  const double prefilled = Metric(m, "kvtier_serve_prefill_tokens_total");
  EXPECT_GE(prefilled, static_cast<double>(miss));
  EXPECT_LE(prefilled, static_cast<double>(miss + slack)) << "cached tokens were recomputed";
  EXPECT_TRUE(s_->Alive());
  EXPECT_TRUE(d_->Alive());
}

}  // namespace
}  // namespace kvtier::testing
