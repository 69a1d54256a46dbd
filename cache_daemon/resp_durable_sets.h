// RespDurableSets: plain RESP SETs under durability "sync" (with an SSD tier), completed
// asynchronously so that every SET pending in the daemon shares one SSD commit, whichever
// connection sent it and however many it pipelined.
//
// A connection stages a SET (Service::RespSetStage: the name is logged, not synced; the stored
// envelope, which carries the name, copied) and hands it over with Submit; it keeps parsing
// while the SET is pending and writes that SET's reply, in request order, when `done` reports
// it (resp_session.cc). Two threads run the SETs in batches of whatever was submitted
// meanwhile, as a pipeline: the put thread puts each (TierManager deferred commit), first
// waiting once for the log sync of the batch's names that their units do not carry (keys
// over kRespCarriedNameBytesMax; RespKeyIndex::WaitDurable; usually none); the commit thread
// completes every SET put so far (the first completion commits for all,
// TierManager::CompletePut) and calls each done. So the durability contract is that of a lone
// SET: done(OK) only after the name, the data and its index are on disk, with one fdatasync
// for all of them (the name is in the unit: docs/RESP.md "Names across restarts").
//
// Errors: a batch whose name sync fails fails the SETs that logged a name in it (nothing
// written); a put or commit error fails that SET with it (Put's IOError contract).
// Limits: nothing here is unbounded by itself; each connection bounds what it submits (its
// pending SETs count against its reply budget with their envelope bytes, docs/RESP.md).
//
// Thread safety: Submit may be called from any thread; done runs on the batch thread (post it
// to the connection's strand; it must not block).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "cache_daemon/metrics.h"
#include "cache_daemon/service.h"
#include "common/status.h"

namespace kvtier::daemon {

class RespDurableSets {
 public:
  using Done = std::function<void(const Status&)>;

  // service and metrics must outlive this object. Starts the batch thread.
  RespDurableSets(Service* service, DaemonMetrics* metrics);
  // Stop().
  ~RespDurableSets();
  RespDurableSets(const RespDurableSets&) = delete;
  RespDurableSets& operator=(const RespDurableSets&) = delete;

  // Runs the staged SET (Service::RespSetStage returned OK for it) and calls done once with
  // its outcome. After Stop: done(Unavailable) at once, on the caller's thread.
  void Submit(std::unique_ptr<RespSetJob> job, Done done);
  // Runs every SET submitted so far, then stops the thread. Idempotent.
  void Stop();

 private:
  struct Item {
    std::unique_ptr<RespSetJob> job;
    Done done;
  };
  void PutLoop();
  void CommitLoop();
  // The put thread's part of a batch: names, then puts; each item's status into *st.
  void PutBatch(std::vector<Item>* batch, std::vector<Status>* st);

  Service* const service_;
  DaemonMetrics* const metrics_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Item> queue_;  // submitted, not yet put; guarded by mu_
  // Put (or failed: status not OK), not yet completed; guarded by mu_.
  std::vector<Item> put_;
  std::vector<Status> put_status_;
  std::condition_variable put_cv_;  // put_ became non-empty, or stopping
  bool stop_ = false;               // guarded by mu_
  bool putting_ = false;            // the put thread holds a batch; guarded by mu_
  std::thread put_thread_, commit_thread_;
};

}  // namespace kvtier::daemon
