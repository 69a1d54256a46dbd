// HTTP admin front end on Boost.Beast: GET /metrics, /healthz, /readyz, GET /v1/stats,
// GET|POST /v1/policy. One request at a time per connection, keep-alive, bounded body and
// read time. With auth on, POST /v1/policy needs "Authorization: Bearer <admin token>".
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <nlohmann/json.hpp>

#include "cache_daemon/daemon_internal.h"
#include "common/clock.h"

namespace kvtier::daemon::internal {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
using Tcp = asio::ip::tcp;
constexpr size_t kFirstReadBytes = 4096;

class HttpSession : public Session, public std::enable_shared_from_this<HttpSession> {
 public:
  HttpSession(Shared* shared, Tcp::socket socket) : shared_(shared), stream_(std::move(socket)) {}
  ~HttpSession() override {
    shared_->front_open[static_cast<size_t>(Front::kHttp)].fetch_sub(1);
    shared_->metrics->connections_open.fetch_sub(1);
  }

  beast::tcp_stream::executor_type executor() { return stream_.get_executor(); }
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
    stream_.socket().shutdown(Tcp::socket::shutdown_both, ec);
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
                         return self->DoClose();
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

  static void Text(http::response<http::string_body>* res, http::status s, std::string body,
                   const char* type = "text/plain; charset=utf-8") {
    res->result(s);
    res->set(http::field::content_type, type);
    res->body() = std::move(body);
  }

  void Route(const http::request<http::string_body>& req, http::response<http::string_body>* res) {
    std::string_view target(req.target().data(), req.target().size());
    if (size_t q = target.find('?'); q != std::string_view::npos) target = target.substr(0, q);
    Service* svc = shared_->service;
    bool get = req.method() == http::verb::get;
    if (target == "/metrics" && get) {
      return Text(res, http::status::ok, RenderMetrics(shared_),
                  "text/plain; version=0.0.4; charset=utf-8");
    }
    if (target == "/healthz" && get) return Text(res, http::status::ok, "ok\n");
    if (target == "/readyz" && get) {
      bool ready = shared_->ready.load() && !shared_->draining.load();
      return Text(res, ready ? http::status::ok : http::status::service_unavailable,
                  ready ? "ready\n" : "draining\n");
    }
    if (target == "/v1/stats" && get) {
      return Text(res, http::status::ok, svc->StatsJson(nullptr), "application/json");
    }
    if (target == "/v1/policy" && get) {
      return Text(res, http::status::ok, svc->PolicyJson(), "application/json");
    }
    if (target == "/v1/policy" && req.method() == http::verb::post) {
      if (shared_->tenants->auth_enabled()) {
        std::string_view auth(req[http::field::authorization].data(),
                              req[http::field::authorization].size());
        constexpr std::string_view kBearer = "Bearer ";
        StatusOr<const Tenant*> t = Status::PermissionDenied("missing bearer token");
        if (auth.substr(0, kBearer.size()) == kBearer) {
          t = shared_->tenants->Authenticate(auth.substr(kBearer.size()));
        }
        if (!t.ok() || !(*t)->admin) {
          shared_->metrics->auth_failures.fetch_add(1);
          return Text(res, http::status::forbidden,
                      "{\"error\":\"an admin bearer token is required\"}", "application/json");
        }
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
  beast::tcp_stream stream_;
  beast::flat_buffer buf_;
  std::optional<http::request_parser<http::string_body>> parser_;
  uint64_t id_ = 0;
  bool closed_ = false;
  std::atomic<bool> busy_{false};
};

}  // namespace

void StartHttpSession(Shared* shared, asio::ip::tcp::socket socket) {
  shared->metrics->connections_open.fetch_add(1);
  shared->metrics->connections_total.fetch_add(1);
  auto s = std::make_shared<HttpSession>(shared, std::move(socket));
  asio::post(s->executor(), [s] { s->Begin(); });
}

}  // namespace kvtier::daemon::internal
