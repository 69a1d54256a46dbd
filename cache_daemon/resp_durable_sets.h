// RespDurableSets: plain RESP SETs under durability "sync" (with an SSD tier), completed
// asynchronously so that every SET pending in the daemon shares one SSD commit, whichever
// connection sent it and however many it pipelined.
//
// A connection stages a SET (Service::RespSetStage: the name is logged, not synced; the stored
// envelope, which carries the name, copied) and hands it over with Submit; it keeps parsing
// while the SET is pending and writes that SET's reply, in request order, when `done` reports
// it (resp_session.cc; for a lone pending SET the commit thread writes "+OK" itself). The SETs
// run in batches of whatever was submitted meanwhile: a SET whose unit carries its name is
// put by the submitting thread itself (TierManager deferred commit; no hand-off), others by the
// put thread, which first waits once for the log sync of the batch's names that their units
// do not carry (keys over kRespCarriedNameBytesMax; RespKeyIndex::WaitDurable; rare). The
// commit thread completes every SET put so far (the first completion commits for all,
// TierManager::CompletePut) and calls each done. So the durability contract is that of a lone
// SET: done(OK) only after the name, the data and its index are on disk, with one fdatasync
// for all of them (the name is in the unit: docs/RESP.md "Names across restarts").
//
// An MSET is submitted as one group of SETs with one done (Submit with several jobs): they are
// put in order and handed on together, so the commit that completes the first of them
// completes them all, and done reports the group once, after every one of them completed.
//
// A DEL (or UNLINK) is handed over already made: the connection removes its keys itself
// (Service::RespDelStage; in memory, at once) and submits the commits they wait for
// (SubmitRemovals); the commit thread completes them with the SETs of its batch, so DELs too
// share one commit with everything pending, and done reports the DEL once all its removals are
// durable.
//
// Errors: a batch whose name sync fails fails the SETs that logged a name in it (nothing
// written); a put or commit error fails that SET with it (Put's IOError contract). A group
// fails with its first error in order; after a failed put its later SETs are not put (the
// MSET's keys before it are written, those after it are not, as Service::RespMset does).
// Limits: nothing here is unbounded by itself; each connection bounds what it submits (its
// pending SETs count against its reply budget with their envelope bytes, docs/RESP.md).
//
// Thread safety: Submit may be called from any thread; done runs on the commit thread (or on
// Submit's caller after Stop) and must not block; what it returns (the connection's own
// bookkeeping) runs later, for every SET of one commit in one task handed to `post` (an I/O
// thread: one wake-up per commit instead of one per SET).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "cache_daemon/metrics.h"
#include "cache_daemon/service.h"
#include "common/status.h"

namespace kvtier::daemon {

class RespDurableSets {
 public:
  // A done's follow-up (may be empty): see Thread safety above.
  using Later = std::function<void()>;
  using Done = std::function<Later(const Status&)>;
  using Post = std::function<void(std::function<void()>)>;

  // service and metrics must outlive this object. post runs a task on another thread (an
  // I/O thread); null: the follow-ups run on the commit thread after the commit's dones.
  // Starts the put and commit threads.
  RespDurableSets(Service* service, DaemonMetrics* metrics, Post post = nullptr);
  // Stop().
  ~RespDurableSets();
  RespDurableSets(const RespDurableSets&) = delete;
  RespDurableSets& operator=(const RespDurableSets&) = delete;

  // Runs the staged SET (Service::RespSetStage returned OK for it) and calls done once with
  // its outcome. put_here: the caller may put the SET itself, now (the put takes the store's
  // locks and may wait for SSD buffer room, never for a commit); it does so only when the
  // unit carries the name (job->name_seq == 0). Pass it only when none of the caller's
  // earlier SETs is still with the put thread (Submit returned false for it and its done has
  // not run), so that one caller's puts stay in submission order. Returns whether the SET was
  // put here. After Stop: done(Unavailable) at once, on the caller's thread; returns false.
  bool Submit(std::unique_ptr<RespSetJob> job, Done done, bool put_here = false);
  // Submit for the SETs of one MSET (jobs not empty, each staged; at most the RESP parser's
  // argument limit): done is called once, after all of them completed, with the first error
  // among them in order (OK: every one is durable). put_here applies to all of them, and only
  // when every unit carries its name. Returns whether they were put here.
  bool Submit(std::vector<std::unique_ptr<RespSetJob>> jobs, Done done, bool put_here = false);
  // Completes removals already made (Service::RespDelStage's commits, not empty) with the next
  // commit and calls done once with the outcome (Service::RespDelComplete's). Never puts
  // anything, so it keeps a caller's order only when none of the caller's earlier SETs is
  // still with the put thread (as put_here above). After Stop: completes them on the caller's
  // thread (a removal already made must still be committed) and calls done there.
  void SubmitRemovals(std::vector<storage::DeferredCommit> commits, Done done);
  // Runs every SET submitted so far, then stops the thread. Idempotent.
  void Stop();

 private:
  struct Item {
    std::unique_ptr<RespSetJob> job;  // null: a DEL's removals (SubmitRemovals)
    std::vector<storage::DeferredCommit> removals;
    Done done;  // empty for a group's later members
    // Items this one's done reports: 1 for a SET, the group's size for an MSET's first SET,
    // 0 for its later SETs (which follow it, in order, in queue_ and put_ and in every batch:
    // a group is always moved in one piece, under mu_).
    size_t members = 1;
  };
  // Both Submits: jobs form one group when there are several.
  bool SubmitItems(std::span<std::unique_ptr<RespSetJob>> jobs, Done done, bool put_here);
  void PutLoop();
  void CommitLoop();
  // The put thread's part of a batch: names, then puts; each item's status into *st.
  void PutBatch(std::vector<Item>* batch, std::vector<Status>* st);

  // Runs the follow-ups of one commit's dones (post_, or here when null).
  void RunLater(std::vector<Later>* later);

  Service* const service_;
  DaemonMetrics* const metrics_;
  const Post post_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Item> queue_;  // submitted, not yet put; guarded by mu_
  // Put (or failed: status not OK), not yet completed; guarded by mu_.
  std::vector<Item> put_;
  std::vector<Status> put_status_;
  std::condition_variable put_cv_;  // put_ became non-empty, or stopping
  bool stop_ = false;               // guarded by mu_
  bool putting_ = false;            // the put thread holds a batch; guarded by mu_
  size_t putting_here_ = 0;         // Submit calls putting on their caller's thread; mu_
  std::thread put_thread_, commit_thread_;
};

}  // namespace kvtier::daemon
