// HTTP admin front end on Boost.Beast: GET /metrics, /healthz, /readyz, GET /v1/stats,
// GET|POST /v1/policy, GET /v1/whatif, GET /v1/unit, and the dashboard page (GET / and
// /dashboard/*, files embedded at build time; docs/DASHBOARD.md). One request at a time per
// connection, keep-alive, bounded header (16 KiB: 431), body (http_max_body_bytes: 413) and read
// time; anything else the parser refuses is 400, then the connection closes.
//
// Authorization with auth on ("Authorization: Bearer <token>"; docs/CONFIG.md [auth]):
//   - POST /v1/policy needs an admin tenant's token (401 without a valid token, 403 for a
//     tenant that is not admin);
//   - GET /metrics and /v1/stats answer everyone, but per-tenant figures (series with a
//     tenant label, the tenant_bytes object) only to an admin token; /v1/stats shows a
//     non-admin tenant its own bytes; without a token both show aggregate figures only;
//   - GET /v1/whatif (aggregate curves) and the page's files answer everyone;
//   - GET /v1/unit?key=<64 hex> (or resp=<RESP key>) describes the caller's own unit of that
//     chain key (or RESP key) (401 without a valid token); only an admin may add
//     &tenant=<name> for another tenant's (403);
//   - a malformed Authorization header or an unknown token is answered 401 and counted in
//     kvtier_auth_failures_total, never silently downgraded.
// With auth off (loopback only) every request is the admin tenant "default".
//
// Browsers (docs/CONFIG.md "The HTTP admin front and browsers"). A web page the operator opens
// can send requests to this port; two kinds are refused before any route:
//   - DNS rebinding, with auth off: a page whose host name was re-pointed at 127.0.0.1 is
//     same-origin with this port and could read /v1/stats and /metrics or POST; its Host
//     header still names that host. Auth off, a Host header that is not an IP literal,
//     `localhost` or a name in [server] http_allowed_hosts is refused (403), any method (as
//     etcd's --host-whitelist, Rails' HostAuthorization). A request without Host (not a
//     browser) passes. Auth on, what answers without a token is aggregate, and a page cannot
//     attach a token by itself, so Host is not checked.
//   - Cross-origin writes: a page on any site may POST a "simple" request (text/plain, no
//     preflight, mode no-cors) here. Every request but GET/HEAD/OPTIONS must come from this
//     origin (Sec-Fetch-Site same-origin or none; without it, an Origin header naming this Host;
//     Go's net/http CrossOriginProtection), else 403; and must carry Content-Type:
//     application/json, else 415: a cross-origin page can only send that after a CORS
//     preflight, which this server never grants. curl and kvtier send neither Origin nor
//     Sec-Fetch-Site and pass (with the Content-Type).
#include <arpa/inet.h>

#include <algorithm>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cctype>
#include <chrono>
#include <iterator>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "cache_daemon/cluster_json.h"
#include "cache_daemon/daemon_internal.h"
#include "cache_daemon/dashboard_assets.h"
#include "common/clock.h"
#include "common/key_spec.h"
#include "common/url_query.h"

namespace kvtier::daemon::internal {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
using GenericSocket = asio::generic::stream_protocol::socket;
constexpr size_t kFirstReadBytes = 4096;
// TCP, or the plaintext end of a TLS relay (tls_front.h).
using Stream = beast::basic_stream<asio::generic::stream_protocol>;

// What an Authorization header is worth.
struct Caller {
  const Tenant* tenant = nullptr;  // nullptr: no token presented (auth on)
  bool invalid = false;            // a malformed header or an unknown token
  bool admin() const { return tenant != nullptr && tenant->admin; }
};

std::string_view View(beast::string_view v) { return std::string_view(v.data(), v.size()); }

std::string_view HeaderValue(const http::request<http::string_body>& req, http::field f) {
  auto it = req.find(f);
  return it == req.end() ? std::string_view() : View(it->value());
}

// The host of a Host header value ("name", "name:port", "[v6]", "[v6]:port"), lower-cased;
// "" when malformed.
std::string HostOf(std::string_view value) {
  std::string_view host = value;
  if (!host.empty() && host.front() == '[') {
    const size_t end = host.find(']');
    if (end == std::string_view::npos) return "";
    host = host.substr(0, end + 1);
  } else if (const size_t colon = host.rfind(':'); colon != std::string_view::npos) {
    host = host.substr(0, colon);
  }
  std::string out(host);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

bool IsIpLiteral(const std::string& host) {
  unsigned char addr[16];
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    return ::inet_pton(AF_INET6, host.substr(1, host.size() - 2).c_str(), addr) == 1;
  }
  return ::inet_pton(AF_INET, host.c_str(), addr) == 1;
}

// Case-insensitive equality (Beast's, over std::string_view).
bool IEquals(std::string_view a, std::string_view b) {
  return boost::beast::iequals(boost::beast::string_view(a.data(), a.size()),
                               boost::beast::string_view(b.data(), b.size()));
}

// Whether a request that may change state comes from this origin, as far as a browser says:
// Sec-Fetch-Site (every current browser), else Origin against Host; a request with neither
// is not from a browser's page.
bool SameOrigin(const http::request<http::string_body>& req) {
  if (auto it = req.find("Sec-Fetch-Site"); it != req.end()) {
    const std::string_view site = View(it->value());
    return IEquals(site, "same-origin") || IEquals(site, "none");
  }
  auto origin = req.find(http::field::origin);
  if (origin == req.end()) return true;
  const std::string_view o = View(origin->value());
  const size_t scheme = o.find("://");
  const std::string_view host = HeaderValue(req, http::field::host);
  return scheme != std::string_view::npos && !host.empty() && IEquals(o.substr(scheme + 3), host);
}

// Content-Type application/json, parameters (charset) allowed.
bool JsonContentType(const http::request<http::string_body>& req) {
  std::string_view type = HeaderValue(req, http::field::content_type);
  type = type.substr(0, type.find(';'));
  while (!type.empty() && (type.back() == ' ' || type.back() == '\t')) type.remove_suffix(1);
  return IEquals(type, "application/json");
}

class HttpSession : public Session, public std::enable_shared_from_this<HttpSession> {
 public:
  HttpSession(Shared* shared, GenericSocket socket, std::shared_ptr<ConnectionCount> count)
      : shared_(shared), count_(std::move(count)), stream_(std::move(socket)) {}

  Stream::executor_type executor() { return stream_.get_executor(); }
  void Begin() {
    id_ = shared_->Register(shared_from_this());
    Read();
  }
  void Close() override {
    asio::post(stream_.get_executor(), [self = shared_from_this()] { self->DoClose(); });
  }
  bool Busy() const override { return busy_.load(); }

 private:
  void DoClose() {
    if (closed_) return;
    closed_ = true;
    beast::error_code ec;
    stream_.socket().shutdown(GenericSocket::shutdown_both, ec);
    stream_.close();
    shared_->Unregister(id_);
  }

  // Waits up to limits.idle_timeout_ms for the first byte of the next request (keep-alive),
  // then gives the request frame_timeout_ms to arrive whole.
  void Read() {
    if (closed_ || shared_->draining.load()) return DoClose();
    if (buf_.size() > 0) return ReadRequest();
    stream_.expires_after(std::chrono::milliseconds(shared_->options->idle_timeout_ms));
    stream_.async_read_some(buf_.prepare(kFirstReadBytes),
                            [self = shared_from_this()](beast::error_code ec, size_t n) {
                              self->buf_.commit(n);
                              self->shared_->metrics->AddBytes(true, n);
                              if (ec == beast::error::timeout)
                                self->shared_->metrics->Refuse(Refusal::kIdle);
                              if (ec) return self->DoClose();
                              self->ReadRequest();
                            });
  }

  void ReadRequest() {
    if (closed_ || shared_->draining.load()) return DoClose();
    parser_.emplace();
    parser_->body_limit(shared_->options->http_max_body_bytes);
    parser_->header_limit(16 * 1024);
    stream_.expires_after(std::chrono::milliseconds(shared_->options->frame_timeout_ms));
    http::async_read(stream_, buf_, *parser_,
                     [self = shared_from_this()](beast::error_code ec, size_t n) {
                       self->shared_->metrics->AddBytes(true, n);
                       if (ec) {
                         if (ec != http::error::end_of_stream && ec != asio::error::eof &&
                             ec != beast::error::timeout && ec != asio::error::operation_aborted) {
                           self->shared_->metrics->protocol_errors.fetch_add(1);
                         }
                         return self->RefuseOrClose(ec);
                       }
                       self->Handle(self->parser_->release());
                     });
  }

  void Handle(http::request<http::string_body> req) {
    busy_.store(true);
    auto res = std::make_shared<http::response<http::string_body>>();
    res->version(req.version());
    res->keep_alive(req.keep_alive());
    res->set(http::field::server, "kvtierd");
    Route(req, res.get());
    res->prepare_payload();
    stream_.expires_after(std::chrono::milliseconds(shared_->options->frame_timeout_ms));
    http::async_write(stream_, *res,
                      [self = shared_from_this(), res](beast::error_code ec, size_t n) {
                        self->shared_->metrics->AddBytes(false, n);
                        self->busy_.store(false);
                        if (ec || !res->keep_alive()) return self->DoClose();
                        self->Read();
                      });
  }

  // A request the parser refused gets its status before the connection closes (431 over the
  // header limit, 413 over http_max_body_bytes, 400 for anything malformed), so that a client
  // or an operator with curl sees why; a timeout or a client that went away closes silently.
  void RefuseOrClose(beast::error_code ec) {
    http::status status = http::status::bad_request;
    const char* why = "malformed HTTP request";
    if (ec == http::error::header_limit) {
      status = http::status::request_header_fields_too_large;
      why = "request header too large";
    } else if (ec == http::error::body_limit) {
      status = http::status::payload_too_large;
      why = "request body too large (http_max_body_bytes)";
    } else if (ec.category() != http::make_error_code(http::error::bad_method).category() ||
               ec == http::error::end_of_stream || ec == http::error::partial_message) {
      return DoClose();
    }
    auto res = std::make_shared<http::response<http::string_body>>();
    res->version(11);
    res->keep_alive(false);
    res->set(http::field::server, "kvtierd");
    Text(res.get(), status, nlohmann::json{{"error", why}}.dump(), "application/json");
    res->prepare_payload();
    busy_.store(true);
    stream_.expires_after(std::chrono::milliseconds(shared_->options->frame_timeout_ms));
    http::async_write(stream_, *res, [self = shared_from_this(), res](beast::error_code, size_t n) {
      self->shared_->metrics->AddBytes(false, n);
      self->busy_.store(false);
      self->DoClose();
    });
  }

  static void Text(http::response<http::string_body>* res, http::status s, std::string body,
                   const char* type = "text/plain; charset=utf-8") {
    res->result(s);
    res->set(http::field::content_type, type);
    res->body() = std::move(body);
  }

  Caller Authorize(const http::request<http::string_body>& req) const {
    const TenantRegistry* reg = shared_->tenants;
    if (!reg->auth_enabled()) return Caller{reg->default_tenant(), false};
    auto it = req.find(http::field::authorization);
    if (it == req.end()) return Caller{};
    std::string_view auth(it->value().data(), it->value().size());
    // The scheme name is case-insensitive (RFC 7235); one space, then the token.
    constexpr std::string_view kBearer = "bearer ";
    if (auth.size() <= kBearer.size()) return Caller{nullptr, true};
    for (size_t i = 0; i < kBearer.size(); ++i) {
      if (std::tolower(static_cast<unsigned char>(auth[i])) != kBearer[i]) {
        return Caller{nullptr, true};
      }
    }
    StatusOr<const Tenant*> t = reg->Authenticate(auth.substr(kBearer.size()));
    if (!t.ok()) return Caller{nullptr, true};
    return Caller{*t, false};
  }

  void Unauthorized(http::response<http::string_body>* res,
                    const char* why = "malformed Authorization header or unknown bearer token") {
    shared_->metrics->auth_failures.fetch_add(1);
    res->set(http::field::www_authenticate, "Bearer");
    Text(res, http::status::unauthorized, nlohmann::json{{"error", why}}.dump(),
         "application/json");
  }

  // Auth off: the Host header names this server (an IP literal, localhost, or a name in
  // http_allowed_hosts), or is absent (not a browser). See the file comment.
  bool HostAllowed(const http::request<http::string_body>& req) const {
    if (shared_->tenants->auth_enabled()) return true;
    auto it = req.find(http::field::host);
    if (it == req.end()) return true;
    const std::string host = HostOf(View(it->value()));
    if (host.empty()) return false;
    if (host == "localhost" || IsIpLiteral(host)) return true;
    const std::vector<std::string>& names = shared_->options->http_allowed_hosts;
    return std::find(names.begin(), names.end(), host) != names.end();
  }

  // The browser protections (file comment); true when `res` holds the refusal.
  bool RefusedForBrowsers(const http::request<http::string_body>& req,
                          http::response<http::string_body>* res) {
    if (!HostAllowed(req)) {
      Text(res, http::status::forbidden,
           nlohmann::json{{"error",
                           "Host header names no address of this server (auth off: an IP "
                           "address, localhost, or a name in [server] http_allowed_hosts)"}}
               .dump(),
           "application/json");
      return true;
    }
    const http::verb m = req.method();
    if (m == http::verb::get || m == http::verb::head || m == http::verb::options) return false;
    if (!SameOrigin(req)) {
      Text(res, http::status::forbidden,
           "{\"error\":\"cross-origin request refused (Origin / Sec-Fetch-Site)\"}",
           "application/json");
      return true;
    }
    if (!JsonContentType(req)) {
      Text(res, http::status::unsupported_media_type,
           "{\"error\":\"a request that changes state must send Content-Type: "
           "application/json\"}",
           "application/json");
      return true;
    }
    return false;
  }

  // /v1/stats for this caller: everything for an admin, the caller's own bytes for another
  // tenant, no tenant_bytes without a token.
  std::string StatsFor(const Caller& caller) const {
    Service* svc = shared_->service;
    if (caller.tenant != nullptr) return svc->StatsJson(caller.tenant);
    nlohmann::json j = nlohmann::json::parse(svc->StatsJson(nullptr));
    j.erase("tenant_bytes");
    return j.dump();
  }

  // The page's files: same-origin only, never cached stale, never sniffed.
  static void Asset(http::response<http::string_body>* res, const DashboardAsset& a) {
    Text(res, http::status::ok, std::string(a.body),
         (std::string(a.content_type) + "; charset=utf-8").c_str());
    res->set(http::field::cache_control, "no-cache");
    res->set("X-Content-Type-Options", "nosniff");
    res->set("Content-Security-Policy",
             "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
             "frame-ancestors 'none'");
  }

  void WhatIfJson(std::string_view query, http::response<http::string_body>* res) {
    // No parameters: the curves' window, capacities and interval are daemon config.
    if (!query.empty()) {
      return Text(res, http::status::bad_request,
                  "{\"error\":\"/v1/whatif takes no query parameters\"}", "application/json");
    }
    if (shared_->whatif == nullptr) {
      nlohmann::json off = {{"state", "off"},
                            {"reason",
                             "the daemon records no trace window: set [trace] path (and "
                             "whatif_window_records_max > 0)"}};
      return Text(res, http::status::ok, off.dump(), "application/json");
    }
    return Text(res, http::status::ok, shared_->whatif->Json(), "application/json");
  }

  // GET /v1/unit?key=<64 hex digits>|resp=<name>[&tenant=<name>]: what this node holds of a
  // unit (Service::UnitJson, RespUnitJson). Values are form-encoded (PercentDecode). Each
  // parameter at most once, exactly one of key and resp, no others: 400 otherwise.
  void UnitJson(const Caller& caller, std::string_view query,
                http::response<http::string_body>* res) {
    auto bad = [&](const std::string& why) {
      Text(res, http::status::bad_request, nlohmann::json{{"error", why}}.dump(),
           "application/json");
    };
    static constexpr std::string_view kUsage =
        "/v1/unit takes key=<64 hex digits> or resp=<form-encoded RESP key> and, for an admin, "
        "tenant=<name>, once each";
    static constexpr std::string_view kNames[] = {"key", "resp", "tenant"};
    std::optional<std::string> values[3];
    for (std::string_view rest = query; !query.empty();) {
      const size_t amp = rest.find('&');
      const std::string_view part = rest.substr(0, amp);
      const size_t eq = part.find('=');
      const std::string_view name = part.substr(0, eq);
      const auto* at = std::find(std::begin(kNames), std::end(kNames), name);
      if (at == std::end(kNames) || eq == std::string_view::npos) return bad(std::string(kUsage));
      std::optional<std::string>& value = values[at - std::begin(kNames)];
      if (value.has_value()) return bad(std::string(kUsage));
      value = PercentDecode(part.substr(eq + 1));
      if (!value.has_value()) return bad(std::string(name) + ": a '%' without two hex digits");
      if (amp == std::string_view::npos) break;
      rest = rest.substr(amp + 1);
    }
    const std::optional<std::string>&key_hex = values[0], &resp_name = values[1],
          &tenant_name = values[2];
    if (key_hex.has_value() == resp_name.has_value()) return bad(std::string(kUsage));
    std::optional<Digest> chain;
    if (key_hex.has_value()) {
      StatusOr<Digest> parsed = DigestFromHex(*key_hex);
      if (!parsed.ok()) return bad("key: want the unit's chain key as 64 hex digits");
      chain = *parsed;
    }  // a RESP key may be any bytes, empty included (as redis's), bounded by the header limit
    const Tenant* tenant = caller.tenant;
    if (tenant_name.has_value() && *tenant_name != tenant->name) {
      if (!caller.admin()) {
        shared_->metrics->auth_failures.fetch_add(1);
        return Text(res, http::status::forbidden,
                    "{\"error\":\"another tenant's unit needs an admin bearer token\"}",
                    "application/json");
      }
      tenant = shared_->tenants->FindByName(*tenant_name);
      if (tenant == nullptr) {
        return Text(res, http::status::not_found, "{\"error\":\"no such tenant\"}",
                    "application/json");
      }
    }
    Service* svc = shared_->service;
    Text(
        res, http::status::ok,
        chain.has_value() ? svc->UnitJson(*tenant, *chain) : svc->RespUnitJson(*tenant, *resp_name),
        "application/json");
  }

  void Route(const http::request<http::string_body>& req, http::response<http::string_body>* res) {
    std::string_view target(req.target().data(), req.target().size()), query;
    if (size_t q = target.find('?'); q != std::string_view::npos) {
      query = target.substr(q + 1);
      target = target.substr(0, q);
    }
    if (RefusedForBrowsers(req, res)) return;
    Service* svc = shared_->service;
    bool get = req.method() == http::verb::get;
    if (get) {
      if (const DashboardAsset* a = FindDashboardAsset(target)) return Asset(res, *a);
    }
    if (target == "/v1/whatif" && get) {
      Caller caller = Authorize(req);
      if (caller.invalid) return Unauthorized(res);
      return WhatIfJson(query, res);
    }
    if (target == "/metrics" && get) {
      Caller caller = Authorize(req);
      if (caller.invalid) return Unauthorized(res);
      return Text(res, http::status::ok, RenderMetrics(shared_, caller.admin()),
                  "text/plain; version=0.0.4; charset=utf-8");
    }
    if (target == "/healthz" && get) return Text(res, http::status::ok, "ok\n");
    if (target == "/readyz" && get) {
      bool ready = shared_->ready.load() && !shared_->draining.load();
      // Cluster mode: etcd unreachable leaves the node ready (it serves what it holds) and
      // says so on a second line.
      std::string cluster = shared_->cluster != nullptr ? shared_->cluster->ReadyText() : "";
      return Text(res, ready ? http::status::ok : http::status::service_unavailable,
                  (ready ? "ready\n" : "draining\n") + cluster);
    }
    if (target == "/v1/stats" && get) {
      Caller caller = Authorize(req);
      if (caller.invalid) return Unauthorized(res);
      return Text(res, http::status::ok, StatsFor(caller), "application/json");
    }
    if (target == "/v1/cluster" && get) {
      // As /metrics: a bad token is refused; members and cluster gauges need no admin.
      Caller caller = Authorize(req);
      if (caller.invalid) return Unauthorized(res);
      return Text(res, http::status::ok, ClusterJson(shared_->cluster), "application/json");
    }
    if (target == "/v1/unit" && get) {
      Caller caller = Authorize(req);
      if (caller.invalid) return Unauthorized(res);
      if (caller.tenant == nullptr) return Unauthorized(res, "a bearer token is required");
      return UnitJson(caller, query, res);
    }
    if (target == "/v1/policy" && get) {
      return Text(res, http::status::ok, svc->PolicyJson(), "application/json");
    }
    if (target == "/v1/policy" && req.method() == http::verb::post) {
      Caller caller = Authorize(req);
      if (caller.invalid) return Unauthorized(res);
      if (caller.tenant == nullptr) return Unauthorized(res, "an admin bearer token is required");
      if (!caller.admin()) {
        shared_->metrics->auth_failures.fetch_add(1);
        return Text(res, http::status::forbidden,
                    "{\"error\":\"an admin bearer token is required\"}", "application/json");
      }
      Status st = svc->SetPolicyJson(req.body());
      if (!st.ok()) {
        nlohmann::json e = {{"error", st.ToString()}};
        return Text(res, http::status::bad_request, e.dump(), "application/json");
      }
      return Text(res, http::status::ok, svc->PolicyJson(), "application/json");
    }
    return Text(res, http::status::not_found, "not found\n");
  }

  Shared* shared_;
  std::shared_ptr<ConnectionCount> count_;  // released when the session is destroyed
  Stream stream_;
  beast::flat_buffer buf_;
  std::optional<http::request_parser<http::string_body>> parser_;
  uint64_t id_ = 0;
  bool closed_ = false;
  std::atomic<bool> busy_{false};
};

}  // namespace

void StartHttpSession(Shared* shared, GenericSocket socket,
                      std::shared_ptr<ConnectionCount> count) {
  auto s = std::make_shared<HttpSession>(shared, std::move(socket), std::move(count));
  asio::post(s->executor(), [s] { s->Begin(); });
}

}  // namespace kvtier::daemon::internal
