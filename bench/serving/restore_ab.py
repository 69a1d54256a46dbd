#!/usr/bin/env python3
"""restore_ab: a fresh server's first restore and its later ones, two builds of kvtier-engine.

One kvtierd (of --after) holds a saved conversation of --tokens tokens. Each round starts a
fresh server of each build in turn (the order alternates between rounds), sends it four
requests that continue the conversation, each with a suffix of its own (nothing resident, so
each restores the conversation's pages and hot state from kvtierd through the Unix socket), and
records the time to first token and the server's minor page faults of each: the first request
is the fresh server's first restore, the other three its later ones. Prints, per build, the
medians of both. Reports only; asserts nothing.

Usage (from the repository root; BEFORE is a build directory of the other commit, holding at
least engine/kvtier-engine):
  /usr/bin/python3 bench/serving/restore_ab.py --before BEFORE --after build/release \\
      [--tokens 65472] [--rounds 6]
"""
import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_bench as sb  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="build directory of the first build")
    ap.add_argument("--after", default="build/release", help="build directory of the second")
    ap.add_argument("--tokens", type=int, default=65472, help="the saved conversation's tokens")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--model-id", default="kvmini-trained")
    args = ap.parse_args()
    if not 64 <= args.tokens <= 65536 - 64 or not 1 <= args.rounds <= 50:
        sys.exit("restore_ab: --tokens in [64, 65472], --rounds in [1, 50]")
    builds = {"before": args.before, "after": args.after}
    for b in builds.values():
        if not os.access(os.path.join(b, "engine/kvtier-engine"), os.X_OK):
            sys.exit("restore_ab: no engine/kvtier-engine in " + b)
    sb.Server.model_flags = ["--model-id", args.model_id]
    ctx = str(args.tokens + 1024)
    common = ["--context-tokens-max", ctx, "--kv-pool-tokens-max", ctx, "--idle-sequences-max",
              "0", "--max-tokens-max", "8", "--threads", "1",
              "--body-bytes-max", str(4 * args.tokens + 65536), "--guard", "fetch"]
    workdir = tempfile.mkdtemp(prefix="kvtier_restore_ab_")
    daemon, sock = sb.start_daemon(args.after, workdir)
    res = {b: {"first": [], "first_faults": [], "later": [], "later_faults": []} for b in builds}
    try:
        history = sb.text(args.tokens, 13)
        saver = sb.Server(args.after, workdir, "save", ["--socket", sock] + common)
        try:
            saver.post({"model": args.model_id, "prompt": history, "max_tokens": 1,
                        "temperature": 0})
        finally:
            saver.stop()
        for r in range(args.rounds):
            for b in (list(builds) if r % 2 == 0 else list(builds)[::-1]):
                server = sb.Server(builds[b], workdir, "%s%d" % (b, r), ["--socket", sock] + common)
                try:
                    for i in range(4):
                        f0 = server.minor_faults()
                        usage, first, _ = server.post(
                            {"model": args.model_id, "prompt": history + " %s %d %d" % (b, r, i),
                             "max_tokens": 1, "temperature": 0}, stream=True)
                        if usage["prompt_tokens_details"]["cached_tokens"] != args.tokens:
                            sys.exit("restore_ab: not a whole restore: %s" % usage)
                        kind = "first" if i == 0 else "later"
                        res[b][kind].append(first)
                        res[b][kind + "_faults"].append(server.minor_faults() - f0)
                finally:
                    server.stop()
        for b, v in res.items():
            print("%-6s first restore %.4f s (%d page faults), later restores %.4f s (%d page "
                  "faults); medians of %d and %d" % (
                      b, statistics.median(v["first"]), statistics.median(v["first_faults"]),
                      statistics.median(v["later"]), statistics.median(v["later_faults"]),
                      len(v["first"]), len(v["later"])), flush=True)
    finally:
        sb.stop_daemon(daemon, workdir)


if __name__ == "__main__":
    main()
