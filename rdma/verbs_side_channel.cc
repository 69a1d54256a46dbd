// SideChannel (verbs_side_channel.h): the verbs transport's TCP control channel to the row
// server, one request at a time, on its own Boost.Asio I/O thread.
#include "rdma/verbs_side_channel.h"

#include <chrono>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

namespace kvtier::rdma::internal {

SideChannel::SideChannel(std::function<void(uint64_t)> lost) : lost_(std::move(lost)) {
  thread_ = std::thread([this] { io_.run(); });
}

SideChannel::~SideChannel() {
  Close();
  work_.reset();
  io_.stop();
  if (thread_.joinable()) thread_.join();
}

StatusOr<uint64_t> SideChannel::Connect(const TcpEndpoint& endpoint, uint32_t timeout_ms) {
  Close();
  auto result = std::make_shared<std::promise<boost::system::error_code>>();
  std::future<boost::system::error_code> done = result->get_future();
  asio::post(io_, [this, endpoint, timeout_ms, result] {
    boost::system::error_code ec;
    socket_.close(ec);
    tcp::resolver resolver(io_);
    auto endpoints = resolver.resolve(endpoint.host, std::to_string(endpoint.port), ec);
    if (ec) return result->set_value(ec);
    auto connecting = std::make_shared<bool>(true);
    timer_.expires_after(std::chrono::milliseconds(timeout_ms));
    timer_.async_wait([this, connecting](const boost::system::error_code& tec) {
      if (!tec && *connecting) {
        boost::system::error_code ignored;
        socket_.close(ignored);  // aborts the connect
      }
    });
    asio::async_connect(
        socket_, endpoints,
        [this, result, connecting](const boost::system::error_code& cec, const tcp::endpoint&) {
          *connecting = false;
          timer_.cancel();
          if (!cec) {
            boost::system::error_code ignored;
            socket_.set_option(tcp::no_delay(true), ignored);
            uint64_t gen = 0;
            {
              std::lock_guard<std::mutex> lock(mu_);
              connected_ = true;
              gen = ++generation_;
            }
            ReadHeader(gen);
          }
          result->set_value(cec);
        });
  });
  const boost::system::error_code ec = done.get();
  if (ec) {
    return Status::IOError("cannot connect the verbs side channel to " + endpoint.host + ":" +
                           std::to_string(endpoint.port) + ": " + ec.message());
  }
  std::lock_guard<std::mutex> lock(mu_);
  return generation_;
}

StatusOr<std::vector<uint8_t>> SideChannel::Call(std::vector<uint8_t> frame, uint64_t request_id,
                                                 wire::FrameType type, uint32_t timeout_ms) {
  auto waiter = std::make_shared<Waiter>();
  waiter->request_id = request_id;
  waiter->type = type;
  std::future<StatusOr<std::vector<uint8_t>>> reply = waiter->promise.get_future();
  uint64_t gen = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!connected_) return Status::IOError("verbs side channel not connected");
    if (waiter_ != nullptr) return Status::Internal("side channel call already in progress");
    waiter_ = waiter;
    gen = generation_;
  }
  auto bytes = std::make_shared<std::vector<uint8_t>>(std::move(frame));
  asio::post(io_, [this, gen, bytes] {
    asio::async_write(socket_, asio::buffer(*bytes),
                      [this, gen, bytes](const boost::system::error_code& ec, size_t) {
                        if (ec) Lost(gen, Status::IOError("side channel write: " + ec.message()));
                      });
  });
  if (reply.wait_for(std::chrono::milliseconds(timeout_ms)) != std::future_status::ready) {
    asio::post(io_, [this, gen] {
      Lost(gen, Status::IOError("row server did not answer the side channel in time"));
    });
    return Status::IOError(
        "row server did not answer the side channel within "
        "request_timeout_ms");
  }
  return reply.get();
}

void SideChannel::Close(uint64_t only_gen) {
  std::shared_ptr<Waiter> waiter;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!connected_ || (only_gen != 0 && only_gen != generation_)) return;
    connected_ = false;
    ++generation_;
    waiter.swap(waiter_);
  }
  if (waiter != nullptr) waiter->promise.set_value(Status::IOError("side channel closed"));
  std::promise<void> closed;
  std::future<void> done = closed.get_future();
  asio::post(io_, [this, &closed] {
    boost::system::error_code ec;
    socket_.shutdown(tcp::socket::shutdown_both, ec);
    socket_.close(ec);
    closed.set_value();
  });
  done.wait();
}

void SideChannel::Lost(uint64_t gen, const Status& why) {
  std::shared_ptr<Waiter> waiter;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (gen != generation_ || !connected_) return;
    connected_ = false;
    waiter.swap(waiter_);
  }
  boost::system::error_code ec;
  socket_.close(ec);
  if (waiter != nullptr) waiter->promise.set_value(why);
  lost_(gen);
}

void SideChannel::ReadHeader(uint64_t gen) {
  asio::async_read(
      socket_, asio::buffer(header_), [this, gen](const boost::system::error_code& ec, size_t) {
        if (ec) {
          return Lost(gen, Status::IOError("verbs side channel lost: " + ec.message()));
        }
        OnHeader(gen);
      });
}

void SideChannel::OnHeader(uint64_t gen) {
  if (Status st = wire::DecodeResponseHeader(header_.data(), &reply_); !st.ok()) {
    return Lost(gen, Status::IOError("bad side-channel reply: " + st.message()));
  }
  bool matches = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    matches = waiter_ != nullptr && waiter_->request_id == reply_.request_id &&
              waiter_->type == reply_.type;
  }
  if (!matches) return Lost(gen, Status::IOError("side-channel reply matches no request"));
  const uint64_t want = wire::FixedReplyDataBytes(reply_.type);
  if (reply_.code == StatusCode::kOk && (want == 0 || reply_.data_bytes != want)) {
    return Lost(gen, Status::IOError("side-channel reply has the wrong data length"));
  }
  message_.resize(reply_.message_bytes);
  data_.resize(reply_.code == StatusCode::kOk ? want : 0);
  std::array<asio::mutable_buffer, 2> bufs = {asio::buffer(message_), asio::buffer(data_)};
  asio::async_read(socket_, bufs, [this, gen](const boost::system::error_code& ec, size_t) {
    if (ec) return Lost(gen, Status::IOError("verbs side channel lost: " + ec.message()));
    std::shared_ptr<Waiter> waiter;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (gen != generation_) return;
      waiter.swap(waiter_);
    }
    if (waiter == nullptr) {
      return Lost(gen, Status::IOError("side-channel reply matches no request"));
    }
    if (reply_.code != StatusCode::kOk) {
      waiter->promise.set_value(Status(reply_.code, message_));
    } else {
      waiter->promise.set_value(data_);
    }
    ReadHeader(gen);
  });
}

}  // namespace kvtier::rdma::internal
