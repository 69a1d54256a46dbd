// The load-aware draft scheduler of speculative decoding (speculative.h): how many draft tokens
// a round verifies, chosen from the draft's confidences and the measured costs of verify
// passes and drafts, each timed with a CostClock (CPU time by default); and MeasureSps /
// MeasureSpsBatch, which fill its table at start.
//
// Thread safety: a DraftScheduler is not thread-safe; whoever shares one between threads
// serialises its calls.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "common/status.h"
#include "engine/model.h"

namespace kvtier::engine {

// The clock a DraftScheduler measures passes with: seconds, read on the thread that runs a
// pass just before and just after it; only differences are meaningful.
using CostClock = std::function<double()>;
// CPU seconds the calling thread has run (CLOCK_THREAD_CPUTIME_ID) and the whole process
// has (CLOCK_PROCESS_CPUTIME_ID): time spent descheduled or asleep does not count.
double ThreadCpuSeconds();
double ProcessCpuSeconds();
// The clock for passes of `engine`: CPU time, not wall time. On a machine whose cores other
// processes take, a pass's wall time grows by whatever time it spent descheduled, by chance,
// a plain step's as much as a verify pass's, so a table of wall times is noise, and every
// preempted plain step makes drafting look worth it; the CPU time a pass uses does not depend
// on that. With engine.threads() == 1 the engine and the draft run on the caller: the thread's
// CPU time. With more: the process's (the pool's workers, their spinning between calls
// included, and whatever else of the process runs meanwhile, e.g. a server's connection
// threads: a cost per emitted token, the same for plain and drafted steps).
CostClock CpuCostClock(const Engine& engine);

// Chooses how many draft tokens to verify from the draft's confidences and measured costs:
// c(t), the cost of a verify pass of t tokens (SPS(t) = 1 / c(t), passes per second), and a
// draft's cost, both in seconds of the scheduler's CostClock (CPU time by default). A draft's
// cost is all that drafting adds to a round outside the verify pass, per drafting sequence:
// the draft context's update, the draft pass, the checkpoint, acceptance and rollback (timing
// the draft pass alone left out a fifth of what a drafted round costs beyond its pass).
// Each estimate: the first sample sets it; each later sample x moves it an eighth of the way
// in the log domain, with x / c first clamped to [1/2, 2]:
//   c <- c * clamp(x / c, 1/2, 2)^(1/8).
// So one sample changes an estimate by at most 2^(1/8) (9 %) either way however far off it is
// (a pass that took a page fault or was timed across a clock step), and a lasting change by a
// factor f <= 2 is followed geometrically: after n samples the estimate is off by f^((7/8)^n)
// (a doubling: within 10 % after 17 samples). A plain step (RecordUndrafted) moves the whole
// table by the factor its own entry moved: the verify sizes no pass ran lately drifted with it
// (the load on the cores, the contexts' lengths), and a table whose verify entries kept the
// costs of the start while the plain step's grew made drafting look cheaper by as much (at
// C = 4 the plain step's estimate rose 27 % over a run, and 74 rounds of 4 drafted for all 4).
// A verify pass's sample moves its own entry only.
// A round drafting B tokens for one sequence runs at rate(B) = 1 / (draft time + 1 /
// SPS(1 + B)); a round of R sequences, whose R draft passes run one after another, at
// 1 / (R x draft time + 1 / SPS(R + B)) (B: the draft tokens of all R together).
//   Survival: draft position k's survival is estimated from the confidences as
//   a_k = c_1 * ... * c_k and then calibrated by what verification measured (Calibrated): the
//   confidence head of a small draft is over-confident (the shipped one: 4.4 expected draft
//   tokens accepted of 5 against 3.1 accepted), and drafting judged on its word alone looked
//   worth it where it was not (rounds of 4 sequences drafting at 0.95x plain CPU rate).
//   Choose: candidates (request, position k) are taken by descending calibrated survival
//   s_k = min(s_{k-1}, Calibrated(a_k)); with R requests and B candidates taken, the objective
//   is (R + sum of their s) * rate(R + B); the B with the largest objective wins.
//   ShouldDraft(R): whether drafting at all pays: the best objective with the running mean of
//   past calibrated survivals (every request drafting the same k) beats kPaysMargin x R x
//   SPS(R) (a plain decode step of the R sequences; the margin, because estimates of single
//   CPU-timed passes are off by a few percent: rounds of 4 that drafted on a predicted gain of
//   0.5-2 % lost). Under saturation (verify cost growing with tokens, or a
//   draft pass as costly as the tokens it saves) it stops drafting, down to none, and probes
//   to keep its estimates current: after kProbeRounds rounds without drafting, then after
//   twice as many each time a probe confirms that drafting does not pay, up to
//   kProbeRoundsMax (back to kProbeRounds once it pays). The other way round too: while
//   drafting pays, a plain probe (one round without drafting, its pass always timed) after
//   kProbeRounds rounds, then twice as many each time it confirms, up to kProbeRoundsMax; so
//   neither side of the comparison goes stale (the cost of a plain step, SPS(R), is measured
//   only by undrafted passes: without plain probes one high sample of it could keep the
//   scheduler drafting for good). Both intervals are kept per batch size R: drafting that pays
//   for the last sequence of a group (R = 1) says nothing about a full batch, and once reset
//   the full batch's interval every few rounds probed it every 32 rounds again.
//   So where drafting does not pay, at most 1 round in kProbeRounds drafts, falling to 1 in
//   kProbeRoundsMax (about 0.1 %) after six probes, and a probe round drafts for one sequence.
class DraftScheduler {
 public:
  static constexpr int kProbeRounds = 32;
  static constexpr int kProbeRoundsMax = 1024;
  static constexpr double kPaysMargin = 1.05;
  // Survival calibration: verified positions are filed by their a_k in kCalibrationBins equal
  // bins of [0, 1]; a bin's calibrated survival is (survived + kCalibrationPrior x centre) /
  // (verified + kCalibrationPrior): the head's own estimate until verifications outweigh it.
  // A bin keeps at most kCalibrationWindow verifications (both counts halve beyond it), so it
  // follows a change of text.
  static constexpr int kCalibrationBins = 20;
  static constexpr double kCalibrationPrior = 4;
  static constexpr double kCalibrationWindow = 512;
  // What ShouldDraft answered, and why (monotonic counts, for benchmarks and metrics).
  struct Decisions {
    uint64_t pays = 0;          // yes: drafting pays
    uint64_t probes = 0;        // yes: a probe while it does not pay (one sequence drafts)
    uint64_t first = 0;         // yes: no survival measured yet (a probe too)
    uint64_t no = 0;            // no: drafting does not pay
    uint64_t plain_probes = 0;  // no: a plain probe while it pays
    uint64_t new_size = 0;      // no: a plain step of that many sequences was never timed
    uint64_t full = 0;          // no: no room in the table for a draft token
  };
  // max_tokens: the largest verify pass in the table (>= 1); R x (K + 1) for rounds of R
  // sequences drafting K tokens each. clock: what Now() reads (tests inject a fake one);
  // empty = ThreadCpuSeconds.
  explicit DraftScheduler(int max_tokens, CostClock clock = {});
  // The clock's reading. Whoever runs a pass for this scheduler times it as Now() after minus
  // Now() before, on the thread that runs it, and records it.
  double Now() const { return clock_(); }
  // Undrafted passes (plain decode rows: the most frequent pass, and the cheapest) are timed
  // one in kUndraftedTimedEvery: a CPU-clock read is a system call (about 1.7 us of CPU on
  // the 2-core VM against 0.04 us for the wall clock's, and more in what it does to the
  // passes after it): timing one pass in 16 cost about 2 % of plain decoding's CPU time at
  // C = 1 and 4 (docs/performance/speculative.md), one in 128 about a quarter of a percent.
  // A size whose entry has fewer than kTableMoveSamples samples is timed one pass in
  // kUndraftedTimedEveryEarly: its entry may be a start-up outlier (a median of 3 passes on a
  // loaded machine: c(4) at 332 us against 285 us for c(5)), and at one in 128 it stayed so for
  // a whole run, every round of 4 drafting on it. Whether to time the next undrafted pass: true at
  // the first call and every kUndraftedTimedEvery-th after it. Draft passes and drafted verify
  // passes are always timed (they are rare when drafting does not pay, and the table needs them).
  // A plain probe's undrafted pass (below) is always timed.
  static constexpr int kUndraftedTimedEvery = 128;
  static constexpr int kUndraftedTimedEveryEarly = 16;
  // sequences: the pass's rows (one per sequence).
  bool TimeUndrafted(int sequences = 1);
  // Records one verify pass of `tokens` tokens that cost `seconds` (ignored when tokens is
  // outside 1 .. max_tokens or seconds is not a positive finite number).
  void Record(int tokens, double seconds);
  // Records one undrafted pass (a plain decode row for each of `sequences` sequences) as
  // Record, and moves every other measured entry by the same factor once its own entry has
  // kTableMoveSamples samples (before that they mostly correct its first one, a single pass
  // that may have been an outlier: they move it alone).
  static constexpr int kTableMoveSamples = 8;
  void RecordUndrafted(int sequences, double seconds);
  // Records one draft: its cost (see above; ignored unless > 0 and finite) and its
  // confidences (for the mean survivals; empty: the cost alone).
  void RecordDraft(double seconds, const std::vector<float>& confidences);
  // Records what verifying the first `verified` tokens of a draft with these confidences
  // measured: `accepted` of them survived (position k < verified survived iff k < accepted).
  // Ignored unless 0 <= accepted <= verified <= confidences.size().
  void RecordVerified(const std::vector<float>& confidences, int verified, int accepted);
  // The calibrated survival of a draft position whose confidences give survival a (in [0, 1]).
  double Calibrated(double a) const;
  // SPS of a pass of `tokens` tokens (0 when never measured).
  double Sps(int tokens) const;
  // The draft pass's estimated cost in seconds (0 when never measured).
  double draft_seconds() const { return draft_s_; }
  // Per request, how many of its drafted tokens to verify. confidences[i]: request i's c_k
  // (empty when it did not draft: it gets 0; the rate counts one draft pass per non-empty one).
  // probe: the round is a probe (probing()): survivals are the head's own, uncalibrated, so
  // that a probe verifies what the head claims and the calibration measures it (a calibration
  // that had come to think too little of the head would otherwise never be corrected).
  std::vector<int> Choose(const std::vector<std::vector<float>>& confidences,
                          bool probe = false) const;
  // Whether the next round of `requests` sequences should draft; counts the rounds it says no.
  // Never when requests >= max_tokens (the table has no room for a draft token). Always before
  // any draft was recorded (survivals are measured by drafting), as a probe (probing() says
  // so: one sequence drafts). Not while a plain step of `requests` sequences was never timed:
  // that round runs undrafted and its pass is timed (TimeUndrafted says yes next), so the
  // comparison has both sides.
  bool ShouldDraft(int requests = 1);
  // Whether one of the next `rounds` calls of ShouldDraft(requests) could say yes, the table
  // and the survivals staying as they are: while drafting pays for that many sequences (or
  // no survival or plain step is known yet) always; while it does not, only when a probe
  // falls among them. False guarantees no for those calls unless a Record* call changes the
  // estimates in between (then drafting may pay sooner: the caller drafts on a shorter
  // context, which costs acceptance, never correctness). Undrafted rounds ask it to skip
  // capturing the rows that only a later draft's context would read.
  bool MayDraftWithin(int requests, int rounds) const;
  int max_tokens() const { return static_cast<int>(cost_s_.size()) - 1; }
  // Whether the last ShouldDraft that said yes was a probe (drafting did not pay then, or no
  // survival was measured yet). A round of several requests probes with one request's draft:
  // the estimates need no more.
  bool probing() const { return probing_; }
  const Decisions& decisions() const { return decisions_; }

 private:
  // Rounds per second of a verify pass of `tokens` after `drafts` draft passes.
  double Rate(int tokens, int drafts) const;
  // Survivals of one draft's positions (non-increasing), calibrated unless `raw`.
  std::vector<double> Survivals(const std::vector<float>& confidences, bool raw) const;
  // Whether drafting pays for rounds of R sequences (ShouldDraft's test, above).
  bool Pays(int R) const;
  // The probe counters of one batch size.
  struct Probes {
    int skipped = 0;  // rounds without drafting since the last probe
    int interval = kProbeRounds;
    bool probing = false;  // the last ShouldDraft of this size was a probe
    int drafting = 0;      // drafted rounds since the last plain probe
    int plain_interval = kProbeRounds;
    bool plain_probing = false;  // the last ShouldDraft of this size was a plain probe
  };
  CostClock clock_;
  std::vector<double> cost_s_;  // c(t), index t: tokens per pass; 0 = never measured
  std::vector<int> samples_;    // samples recorded per entry, at most kTableMoveSamples
  double draft_s_ = 0;
  uint64_t undrafted_passes_ = 0;      // TimeUndrafted calls
  std::vector<double> mean_survival_;  // per draft position; empty until a draft was recorded
  // Per calibration bin: verified positions and, of those, survived ones (decayed counts).
  double verified_[kCalibrationBins] = {};
  double survived_[kCalibrationBins] = {};
  std::vector<Probes> probes_;        // index R: rounds of R sequences (1 .. max_tokens - 1)
  bool probing_ = false;              // the last ShouldDraft was a probe
  bool time_next_undrafted_ = false;  // TimeUndrafted says yes next
  Decisions decisions_;
};

// Fills the scheduler's table at start: `reps` verify passes of each size 1 .. max_tokens on
// copies of `base` (a prefilled state; it is not changed), timed on this engine with the
// scheduler's clock, and records each size's median (one unrecorded pass first, so that no
// sample is a cold one; the median, because the first sample of an estimate sets it and a
// later one moves it by at most 9 %: one slow outlier must not set it).
Status MeasureSps(Engine* engine, const SequenceState& base, int reps, DraftScheduler* scheduler);
// The same for rounds of bases.size() sequences: passes of every size R .. max_tokens through
// Engine::ForwardBatch over copies of `bases` (the tokens spread evenly, earlier sequences
// taking the remainder), and plain steps of the first t < R of them (one token each: the
// rounds left when sequences of the batch finished, whose first timed pass otherwise set
// their entry alone, one sample however far off). InvalidArgument for no bases, an empty base or
// max_tokens < R.
Status MeasureSpsBatch(Engine* engine, std::span<const SequenceState> bases, int reps,
                       DraftScheduler* scheduler);

}  // namespace kvtier::engine
