#!/usr/bin/env python3
"""resume_burst: N saved conversations continued at once, one kvtierd thread against several.

An agent platform resumes many long sessions at once (after a deploy, at the start of a work
day). One kvtierd holds N saved conversations of --tokens tokens each. Each round starts, for
each arm in turn (the order alternates between rounds), a fresh server with that many kvtierd
threads (`--kvtierd-threads`), warms it with a burst of N continuations (so that each thread
has made its kvtierd connection), then sends N other continuations at once (one client thread
each, streamed, a suffix of their own per round and arm, nothing resident: each restores its
conversation's pages and hot state from kvtierd).
Records every request's time to first token from the burst's start, and the server's CPU time
and minor page faults over the burst; prints, per arm, the medians over rounds of the burst's
mean and last time to first token, CPU and faults, and the ratio of the first arm's times to
each other's. The peer is the same server with one kvtierd thread (as the
server was before CacheIo had workers), against the same kvtierd, in the same run.

With --ssd kvtierd keeps a DRAM tier too small for the conversations (8 MiB): every restore
reads its units from kvtierd's SSD tier (O_DIRECT), as the 72-hour tail of reuse would. With
--tcp the servers reach kvtierd over its native TCP port on loopback (the units in the frames,
no shared memory).

With --no-hot-state the servers keep no hot states (as after the hot states' TTL, the 72-hour
tail of reuse), so every restore rebuilds its SWA rings by bounded replay (--replay-tokens): an
arm named "Ts" (e.g. "2s") runs with --replays-on-step-thread (the replays on the engine's step
thread, one per step while others run), "T" on its T kvtierd threads' own engines. With
--decoding K, K streams (short prompts) decode through the burst: the largest gap between two
of a stream's tokens during the burst is what the restores cost the running sequences.

Reports only; asserts nothing but that every continuation restored its whole conversation.

Usage (from the repository root, after building kvtierd and kvtier-engine):
  /usr/bin/python3 bench/serving/resume_burst.py --build build/release \\
      [--tokens 16384] [--conversations 8] [--threads 1,2,4] [--rounds 4] [--ssd] [--tcp]
      [--no-hot-state [--replay-tokens N] --threads 2s,2] [--decoding K]
"""
import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_bench as sb  # noqa: E402


def burst(server, bodies, tokens):
    """Posts bodies at once (one thread each, released together); returns each one's seconds
    to its first token."""
    firsts, errors = [None] * len(bodies), []
    start = threading.Barrier(len(bodies))

    def one(i):
        start.wait()
        try:
            usage, firsts[i], _ = server.post(bodies[i], stream=True)
            if usage["prompt_tokens_details"]["cached_tokens"] != tokens:
                errors.append("not a whole restore: %s" % usage)
        except Exception as e:  # reported below: the run is invalid
            errors.append(repr(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        sys.exit("resume_burst: " + errors[0])
    return firsts


def start_streams(server, k, model_id):
    """K streams decoding, each until the server stops; returns their token arrival times once
    each has a few tokens (one list per stream)."""
    times = [[] for _ in range(k)]

    def one(i):
        try:
            server.stream_times({"model": model_id, "prompt": sb.text(64, 900 + i),
                                 "max_tokens": 4000, "temperature": 0}, times[i])
        except Exception:  # the server stopped under it: the arm is over
            pass

    for i in range(k):
        threading.Thread(target=one, args=(i,), daemon=True).start()
    deadline = time.monotonic() + 60
    while any(len(t) < 8 for t in times):
        if time.monotonic() > deadline:
            sys.exit("resume_burst: the decoding streams did not start")
        time.sleep(0.005)
    return times


def largest_gap(times, t0, t1):
    """The largest gap between consecutive tokens of any stream that overlaps [t0, t1]."""
    g = 0.0
    for ts in times:
        for a, b in zip(ts, ts[1:]):
            if b >= t0 and a <= t1:
                g = max(g, b - a)
    return g


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build/release")
    ap.add_argument("--tokens", type=int, default=16384, help="each saved conversation's tokens")
    ap.add_argument("--conversations", type=int, default=8, help="continued at once")
    ap.add_argument("--threads", default="1,2,4",
                    help="kvtierd threads of each arm (first: peer); a trailing s: replays on "
                         "the step thread (--replays-on-step-thread)")
    ap.add_argument("--no-hot-state", action="store_true",
                    help="the servers keep no hot states: every restore replays")
    ap.add_argument("--replay-tokens", type=int, default=0,
                    help="the servers' --replay-tokens (0: their default, 2 sliding windows)")
    ap.add_argument("--decoding", type=int, default=0,
                    help="streams decoding through each burst (their largest gap is reported)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--ssd", action="store_true", help="restores read kvtierd's SSD tier")
    ap.add_argument("--tcp", action="store_true",
                    help="the servers reach kvtierd over its native TCP port (loopback), not "
                         "its Unix socket")
    ap.add_argument("--before", default=None,
                    help="a build directory of another commit: each thread count also runs on "
                         "its kvtier-engine (arms named 'before N'), against the same kvtierd")
    ap.add_argument("--model-id", default="kvmini-trained")
    args = ap.parse_args()
    try:
        # (name, kvtierd threads, replays on the step thread)
        specs = [(t, int(t.rstrip("s")), t.endswith("s")) for t in args.threads.split(",") if t]
    except ValueError:
        sys.exit("resume_burst: --threads is a comma list of thread counts, each optionally "
                 "followed by s, e.g. 1,2,4 or 2s,2")
    # An arm: (its name, the build whose kvtier-engine serves it, its kvtierd threads, replays
    # on the step thread).
    arms = [(name, args.build, t, st) for name, t, st in specs]
    if args.before:
        if not os.access(os.path.join(args.before, "engine/kvtier-engine"), os.X_OK):
            sys.exit("resume_burst: no engine/kvtier-engine in " + args.before)
        arms = [a for name, t, st in specs for a in (("before " + name, args.before, t, st),
                                                     (name, args.build, t, st))]
    if not 64 <= args.tokens <= 65536 - 64 or not 1 <= args.conversations <= 32 or \
            not 1 <= args.rounds <= 50 or len(arms) < 2 or \
            not all(1 <= t <= 64 for _, t, _ in specs) or not 0 <= args.decoding <= 16 or \
            args.replay_tokens < 0:
        sys.exit("resume_burst: --tokens in [64, 65472], --conversations in [1, 32], "
                 "--rounds in [1, 50], --threads two or more of [1, 64], --decoding in [0, 16]")
    sb.Server.model_flags = ["--model-id", args.model_id]
    n = args.conversations
    ctx = args.tokens + 8192
    seqs = n + args.decoding + 1
    common = ["--context-tokens-max", str(ctx), "--kv-pool-tokens-max", str(seqs * ctx),
              "--active-sequences-max", str(seqs), "--idle-sequences-max", "0",
              "--max-tokens-max", "4096", "--threads", "1", "--guard", "fetch",
              "--body-bytes-max", str(4 * args.tokens + 65536)]
    if args.no_hot_state:
        common.append("--no-hot-state")
    if args.replay_tokens:
        common += ["--replay-tokens", str(args.replay_tokens)]
    workdir = tempfile.mkdtemp(prefix="kvtier_resume_burst_")
    port = sb.free_port()
    daemon, sock = sb.start_daemon(args.build, workdir, flags=["--native-port", str(port)],
                                   dram_bytes=(8 << 20) if args.ssd else 256 << 20)
    sb.wait_port(port)
    cache = ["--kvtierd", "127.0.0.1:%d" % port] if args.tcp else ["--socket", sock]
    res = {a[0]: {"mean": [], "last": [], "cpu": [], "faults": [], "gap": []} for a in arms}
    try:
        histories = [sb.text(args.tokens, 100 + i) for i in range(n)]
        saver = sb.Server(args.build, workdir, "save", cache + common)
        try:
            for h in histories:
                saver.post({"model": args.model_id, "prompt": h, "max_tokens": 1,
                            "temperature": 0})
        finally:
            saver.stop()
        for r in range(args.rounds):
            for a, (name, build, t, step) in enumerate(arms if r % 2 == 0 else arms[::-1]):
                server = sb.Server(build, workdir, "a%d_%d" % (a, r),
                                   cache + ["--kvtierd-threads", str(t)] + common +
                                   (["--replays-on-step-thread"] if step else []))
                try:
                    # Warm-up: a burst of its own (other suffixes), so that every kvtierd
                    # thread has made its connection (a first connection maps and touches its
                    # shared memory) and the server its first restore.
                    burst(server, [{"model": args.model_id,
                                    "prompt": histories[i] + " warm %s %d" % (name, r),
                                    "max_tokens": 1, "temperature": 0} for i in range(n)],
                          args.tokens)
                    bodies = [{"model": args.model_id,
                               "prompt": histories[i] + " then %s %d" % (name, r),
                               "max_tokens": 1, "temperature": 0} for i in range(n)]
                    streams = start_streams(server, args.decoding, args.model_id)
                    cpu0, faults0 = server.cpu_seconds(), server.minor_faults()
                    t0 = time.monotonic()
                    firsts = burst(server, bodies, args.tokens)
                    cpu, faults = server.cpu_seconds() - cpu0, server.minor_faults() - faults0
                    gap = largest_gap(streams, t0, t0 + max(firsts))
                finally:
                    server.stop()
                res[name]["mean"].append(statistics.mean(firsts))
                res[name]["last"].append(max(firsts))
                res[name]["cpu"].append(cpu)
                res[name]["faults"].append(faults)
                res[name]["gap"].append(gap)
                v = res[name]
                print("round %d, %8s kvtierd threads: mean %.4f s, last %.4f s, server CPU %.3f "
                      "s, %d page faults, streams' largest gap %.4f s (load %.1f)" % (
                          r, name, v["mean"][-1], v["last"][-1], cpu, faults, gap,
                          os.getloadavg()[0]), flush=True)
        peer = arms[0][0]
        for name, _, _, _ in arms:
            v = res[name]
            mean, last = statistics.median(v["mean"]), statistics.median(v["last"])
            gaps = ""
            if args.decoding:
                gaps = ", %d streams' largest gap %.4f s (peer / this %.2fx)" % (
                    args.decoding, statistics.median(v["gap"]),
                    statistics.median(res[peer]["gap"]) / max(statistics.median(v["gap"]), 1e-9))
            print("%8s kvtierd threads: %d continuations of %d tokens (%s, units from %s%s) at "
                  "once, time to first token mean %.4f s, last %.4f s, server CPU %.3f s, %d "
                  "page faults (medians of %d rounds); peer (%s) / this: mean %.2fx, last "
                  "%.2fx%s" % (
                      name, n, args.tokens, "TCP" if args.tcp else "Unix socket",
                      "SSD" if args.ssd else "DRAM",
                      ", no hot states" if args.no_hot_state else "", mean, last,
                      statistics.median(v["cpu"]), statistics.median(v["faults"]),
                      args.rounds, peer, statistics.median(res[peer]["mean"]) / mean,
                      statistics.median(res[peer]["last"]) / last, gaps), flush=True)
    finally:
        sb.stop_daemon(daemon, workdir)


if __name__ == "__main__":
    main()
