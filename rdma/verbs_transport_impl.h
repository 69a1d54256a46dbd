// Private to rdma/ (built only with KVTIER_WITH_RDMA): VerbsTransport::Impl, the state of a
// VerbsTransport (verbs_transport.h), one struct over three files split by concern:
//   verbs_transport.cc             the Transport interface: Create, Connect, OpenRegion,
//                                  local buffers, Submit, Close, counters
//   verbs_transport_connect.cc     caller threads: side-channel calls, attaching regions,
//                                  (re)connecting the queue pair
//   verbs_transport_completion.cc  the completion thread: polling the CQ, async events,
//                                  deadlines, teardown
// and its TCP side channel to the row server in verbs_side_channel.h/.cc.
#pragma once

#include <unistd.h>

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "common/clock.h"
#include "rdma/verbs_device.h"
#include "rdma/verbs_side_channel.h"
#include "rdma/verbs_transport.h"
#include "rdma/wire.h"

namespace kvtier::rdma {
namespace internal {

inline uint64_t NowUs() { return DefaultSteadyClock().NowUs(); }

struct RegionEntry {
  RegionCredentials credentials;
  RegionInfo info;
  uint32_t server_id = 0;
  Status attach_status;  // non-OK when re-attaching after a reconnect failed
};

}  // namespace internal

struct VerbsTransport::Impl {
  Impl(TcpEndpoint e, TransportOptions o, verbs::VerbsOptions v)
      : endpoint(std::move(e)),
        options(o),
        verbs_options(std::move(v)),
        tracker(verbs_options.send_queue_depth) {}

  TcpEndpoint endpoint;
  TransportOptions options;
  verbs::VerbsOptions verbs_options;
  std::shared_ptr<verbs::VerbsZone> zone;
  std::unique_ptr<internal::SideChannel> side;
  int wake_fd = -1;
  std::thread thread;
  std::thread::id completion_thread_id;

  std::mutex connect_mu;  // serialises Connect / Reconnect / OpenRegion / reconnecting Submit
  mutable std::mutex mu;  // everything below
  std::condition_variable cv;
  bool closed = false;
  bool stop = false;
  uint64_t side_gen = 0;  // the side channel generation the QP belongs to
  // Connected and every open region re-attached (its RemoteRegion known): only then may
  // reads be submitted. Cleared by every teardown.
  bool ready = false;
  std::unique_ptr<verbs::VerbsQp> qp;
  verbs::QpStateMachine sm;
  verbs::RemoteRegionTable remote;
  verbs::LocalKeyTable local;
  verbs::InflightTracker tracker;
  std::map<uint64_t, uint64_t> deadlines_us;   // batch seq -> deadline
  std::vector<internal::RegionEntry> regions;  // index = client RegionId
  std::map<LocalBufferId, uint8_t*> buffers;
  LocalBufferId next_buffer_id = 1;
  uint64_t next_request_id = 1;
  uint64_t next_batch_seq = 1;
  Status failure_request;          // non-OK: the completion thread must tear down
  uint64_t failure_gen = 0;        // ... the QP of this side-channel generation
  bool reconnect_request = false;  // Reconnect(): tear down whatever is there
  uint64_t teardowns = 0;          // completed teardowns (Reconnect waits on it)
  TransportCounters c;

  bool OnCompletionThread() const { return std::this_thread::get_id() == completion_thread_id; }

  void Wake() const {
    const uint64_t one = 1;
    ssize_t n = write(wake_fd, &one, sizeof(one));
    (void)n;
  }

  // Asks the completion thread to tear down the QP of side-channel generation `gen` with
  // `why`. Caller holds mu.
  void RequestFailureLocked(uint64_t gen, const Status& why) {
    if (failure_request.ok()) {
      failure_request = why;
      failure_gen = gen;
    }
    Wake();
  }

  bool ConnectedLocked() const {
    return qp != nullptr && (sm.state() == verbs::QpState::kReadyToSend ||
                             sm.state() == verbs::QpState::kExchanging);
  }

  // ---- completion thread (verbs_transport_completion.cc) ---------------------------------

  // Fails everything in flight with `why`, destroys the QP, closes the side channel.
  void Teardown(const Status& why);

  void DrainCq();

  // Polls once; returns the number of completions handled (or -1 after a teardown).
  int PollOnce();

  void HandleAsyncEvents();

  // Handles a requested failure and expired deadlines.
  void CheckFailuresAndDeadlines();

  void CompletionLoop();

  // ---- caller threads (hold connect_mu; verbs_transport_connect.cc) ---------------------

  StatusOr<std::vector<uint8_t>> Call(std::vector<uint8_t> frame, uint64_t request_id,
                                      wire::FrameType type);

  uint64_t NextRequestId();

  StatusOr<wire::OpenReply> OpenOnWire(const RegionCredentials& cred);

  // kVerbsConnect with this QP's params; on OK the QP goes RTR/RTS towards the server's.
  Status ExchangeQpParams(bool probe_only);

  StatusOr<verbs::RemoteRegion> RegionOnWire(uint32_t server_id);

  // Drops a half-made connection (nothing can be in flight: the QP never reached RTS
  // since the last teardown).
  void DropConnection();

  // Opens region `credentials` on the wire and fetches its RemoteRegion, bringing the QP to
  // RTS first if this is the connection's first region.
  StatusOr<std::pair<wire::OpenReply, verbs::RemoteRegion>> Attach(
      const RegionCredentials& credentials);

  Status EnsureConnected();
};

}  // namespace kvtier::rdma
