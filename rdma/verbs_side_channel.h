// Private to rdma/ (VerbsTransport, verbs_transport_impl.h; built only with KVTIER_WITH_RDMA):
// SideChannel, the verbs transport's TCP control channel to the row server.
#pragma once

// Boost 1.74's asio/awaitable.hpp uses std::exchange without including <utility>.
#include <utility>
// (must precede boost/asio.hpp)
#include <array>
#include <boost/asio.hpp>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "rdma/tcp_transport.h"
#include "rdma/wire.h"

namespace kvtier::rdma::internal {
namespace asio = boost::asio;
using asio::ip::tcp;

// The TCP control channel: one request at a time (callers serialise), replies read by a
// loop that also notices the server closing the connection (which it does when it cuts the
// queue pair). Owns an I/O thread.
class SideChannel {
 public:
  // `lost(generation)` runs on the channel's thread when a connection of that generation
  // drops by itself (not after Close()).
  explicit SideChannel(std::function<void(uint64_t)> lost);
  ~SideChannel();

  // Connects (closing any previous connection). Returns the new generation.
  StatusOr<uint64_t> Connect(const TcpEndpoint& endpoint, uint32_t timeout_ms);

  // Sends one request frame and waits for its reply's data (an error reply's Status).
  StatusOr<std::vector<uint8_t>> Call(std::vector<uint8_t> frame, uint64_t request_id,
                                      wire::FrameType type, uint32_t timeout_ms);

  // Closes the connection without calling `lost`; with `only_gen` != 0, only when the
  // current connection is of that generation. Never call on the channel's own thread.
  void Close(uint64_t only_gen = 0);

 private:
  struct Waiter {
    uint64_t request_id = 0;
    wire::FrameType type = wire::FrameType::kOpen;
    std::promise<StatusOr<std::vector<uint8_t>>> promise;
  };

  // ---- I/O thread ----
  void Lost(uint64_t gen, const Status& why);

  void ReadHeader(uint64_t gen);

  void OnHeader(uint64_t gen);

  std::function<void(uint64_t)> lost_;
  asio::io_context io_{1};
  asio::executor_work_guard<asio::io_context::executor_type> work_{io_.get_executor()};
  tcp::socket socket_{io_};
  asio::steady_timer timer_{io_};
  std::thread thread_;

  std::mutex mu_;  // connected_, generation_, waiter_
  bool connected_ = false;
  uint64_t generation_ = 0;
  std::shared_ptr<Waiter> waiter_;

  // I/O thread only.
  std::array<uint8_t, wire::kHeaderBytes> header_{};
  wire::ResponseHeader reply_;
  std::string message_;
  std::vector<uint8_t> data_;
};

}  // namespace kvtier::rdma::internal
