#include "serving/openai_server.h"

#include <chrono>
#include <ctime>
#include <nlohmann/json.hpp>
#include <random>

#include "serving/chat_template.h"

namespace kvtier::serving {
namespace {

using ojson = nlohmann::ordered_json;

// Poll interval of a connection thread waiting for its generation (client-gone checks).
constexpr int kWaitSliceMs = 50;

std::string Dump(const ojson& j) {
  return j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

void ReplyError(HttpResponder* out, const ApiError& e) {
  out->Reply(e.status, "application/json", e.ToJson());
}

ApiError Error(int status, std::string type, std::string message, std::string code = "") {
  ApiError e;
  e.status = status;
  e.type = std::move(type);
  e.message = std::move(message);
  e.code = std::move(code);
  return e;
}

}  // namespace

OpenAiFrontend::OpenAiFrontend(std::string model_id, engine::ByteTokenizer tokenizer,
                               Scheduler* scheduler, const ApiKeys* keys, ServingMetrics* metrics,
                               ApiLimits limits)
    : model_id_(std::move(model_id)),
      tokenizer_(tokenizer),
      scheduler_(scheduler),
      keys_(keys),
      metrics_(metrics),
      limits_(limits) {
  seed_counter_ = std::random_device{}();
}

std::string OpenAiFrontend::NewId(bool chat) {
  char buf[48];
  std::snprintf(buf, sizeof(buf), "%s-%016llx", chat ? "chatcmpl" : "cmpl",
                static_cast<unsigned long long>(next_id_.fetch_add(1)));
  return buf;
}

void OpenAiFrontend::Handle(const HttpRequest& req, HttpResponder* out) {
  if (req.target == "/metrics" || req.target == "/health") {
    if (req.method != "GET")
      return ReplyError(out, Error(405, "invalid_request_error", "use GET", "method_not_allowed"));
    if (req.target == "/health") {
      out->Reply(200, "text/plain", "ok\n");
      return;
    }
    out->Reply(200, "text/plain; version=0.0.4", metrics_->Render());
    return;
  }
  const bool chat = req.target == "/v1/chat/completions";
  const bool completions = req.target == "/v1/completions";
  const bool models = req.target == "/v1/models";
  if (!chat && !completions && !models)
    return ReplyError(out, Error(404, "invalid_request_error",
                                 "unknown route " + req.target.substr(0, 128), "unknown_url"));
  if (req.method != (models ? "GET" : "POST"))
    return ReplyError(
        out, Error(405, "invalid_request_error", std::string("use ") + (models ? "GET" : "POST"),
                   "method_not_allowed"));
  const Tenant* tenant = keys_->Find(req.authorization);
  if (tenant == nullptr)
    return ReplyError(out, Error(401, "authentication_error",
                                 req.authorization.empty() ? "missing API key (Authorization: "
                                                             "Bearer <key>)"
                                                           : "invalid API key",
                                 "invalid_api_key"));
  if (models) {
    ojson m = {{"id", model_id_}, {"object", "model"}, {"created", 0}, {"owned_by", "kvtier"}};
    ojson j = {{"object", "list"}, {"data", ojson::array({m})}};
    out->Reply(200, "application/json", Dump(j));
    return;
  }
  Generate(req, chat, tenant, out);
}

void OpenAiFrontend::Generate(const HttpRequest& req, bool chat, const Tenant* tenant,
                              HttpResponder* out) {
  CompletionRequest cr;
  if (ApiError e = ParseCompletionRequest(req.body, chat, limits_, &cr); !e.ok()) {
    // The body's JSON shape limits are the front's, as body_bytes_max is.
    if (e.code == "json_depth_max" || e.code == "json_values_max") metrics_->HttpRejected(e.code);
    return ReplyError(out, e);
  }
  if (cr.model != model_id_) {
    ApiError e =
        Error(404, "invalid_request_error",
              "model '" + cr.model + "' does not exist; this server serves '" + model_id_ + "'",
              "model_not_found");
    e.param = "model";
    return ReplyError(out, e);
  }
  const std::string prompt_text = chat ? RenderChat(cr.messages) : std::move(cr.prompt);
  cr.messages = {};  // rendered into prompt_text
  // A prompt over the context is refused before its ids (4 bytes per token) are built.
  if (Status st = scheduler_->CheckPromptTokens(tokenizer_.TokenCount(prompt_text)); !st.ok())
    return ReplyError(
        out, InvalidRequest(st.message(), chat ? "messages" : "prompt", "context_length_exceeded"));
  GenerationParams p;
  p.prompt = tokenizer_.Encode(prompt_text);
  // Without max_tokens a request gets --max-tokens-max (as DeepSeek's API defaults to its
  // 4096), or the context left if less: the limit bounds every request, not only those that
  // name a max_tokens.
  p.max_tokens = cr.max_tokens.value_or(limits_.max_tokens_max);
  p.temperature = cr.temperature;
  p.top_p = cr.top_p;
  p.seed = cr.seed.value_or(seed_counter_.fetch_add(0x9e3779b97f4a7c15ULL));
  p.stop = cr.stop;
  auto submitted = scheduler_->Submit(tenant, std::move(p));
  if (!submitted.ok()) {
    const Status& s = submitted.status();
    if (s.code() == StatusCode::kInvalidArgument) {
      ApiError e =
          InvalidRequest(s.message(), chat ? "messages" : "prompt", "context_length_exceeded");
      return ReplyError(out, e);
    }
    if (s.code() == StatusCode::kRejected)
      return ReplyError(out, Error(429, "rate_limit_error", s.message(), "queue_full"));
    return ReplyError(out, Error(503, "server_error", s.message(), "unavailable"));
  }
  std::shared_ptr<Generation> gen = std::move(submitted).value();
  const std::string id = NewId(chat);
  const int64_t created = static_cast<int64_t>(std::time(nullptr));
  const char* object = chat ? "chat.completion" : "text_completion";
  const char* chunk_object = chat ? "chat.completion.chunk" : "text_completion";

  auto chunk = [&](const std::string& text, const char* finish, bool role) {
    ojson choice = {{"index", 0}};
    if (chat) {
      ojson delta = ojson::object();
      if (role) delta["role"] = "assistant";
      if (!text.empty() || role) delta["content"] = text;
      choice["delta"] = delta;
    } else {
      choice["text"] = text;
    }
    choice["finish_reason"] = finish ? ojson(finish) : ojson(nullptr);
    ojson j = {{"id", id},
               {"object", chunk_object},
               {"created", created},
               {"model", model_id_},
               {"choices", ojson::array({choice})}};
    return "data: " + Dump(j) + "\n\n";
  };

  if (cr.stream) {
    if (!out->BeginStream(200, "text/event-stream") ||
        (chat && !out->Chunk(chunk("", nullptr, true)))) {
      gen->Cancel();
      return;
    }
  }
  std::string text;
  GenerationEvent ev;
  // A client that went away is noticed within a wait slice whether or not events arrive: a
  // non-streaming request writes nothing until it ends, and its events may come faster than
  // one a slice.
  auto check_peer_at = std::chrono::steady_clock::now();
  while (true) {
    const bool got = gen->Next(&ev, kWaitSliceMs);
    // (A stream's failed write catches its client; a non-streamed request writes nothing.)
    if (const auto now = std::chrono::steady_clock::now();
        !got || (!cr.stream && ev.kind == GenerationEvent::Kind::kText && now >= check_peer_at)) {
      check_peer_at = now + std::chrono::milliseconds(kWaitSliceMs);
      if (out->PeerGone()) {
        gen->Cancel();
        return;
      }
    }
    if (!got) continue;
    if (ev.kind == GenerationEvent::Kind::kText) {
      if (cr.stream) {
        if (!out->Chunk(chunk(ev.text, nullptr, false))) {
          gen->Cancel();
          return;
        }
      } else {
        text += ev.text;
      }
      continue;
    }
    if (ev.kind == GenerationEvent::Kind::kError) {
      if (cr.stream) {  // headers are gone: an error event, then the end of the stream
        out->Chunk("data: " + ev.error.ToJson() + "\n\n");
        out->EndStream();
      } else {
        ReplyError(out, ev.error);
      }
      return;
    }
    break;  // kDone
  }
  if (cr.stream) {
    out->Chunk(chunk("", ev.finish_reason.c_str(), false));
    if (cr.include_usage) {
      ojson u = {{"id", id},           {"object", chunk_object},    {"created", created},
                 {"model", model_id_}, {"choices", ojson::array()}, {"usage", UsageJson(ev.usage)}};
      out->Chunk("data: " + Dump(u) + "\n\n");
    }
    out->Chunk("data: [DONE]\n\n");
    out->EndStream();
    return;
  }
  ojson choice = {{"index", 0}};
  if (chat) {
    choice["message"] = {{"role", "assistant"}, {"content", text}};
  } else {
    choice["text"] = text;
    choice["logprobs"] = nullptr;
  }
  choice["finish_reason"] = ev.finish_reason;
  ojson j = {{"id", id},
             {"object", object},
             {"created", created},
             {"model", model_id_},
             {"choices", ojson::array({choice})},
             {"usage", UsageJson(ev.usage)}};
  out->Reply(200, "application/json", Dump(j));
}

}  // namespace kvtier::serving
