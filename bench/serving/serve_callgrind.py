#!/usr/bin/python3
"""Instruction count of `kvtier-engine serve` steps under callgrind (docs/performance/serving.md,
"Speculative serving: instructions per token").

Starts the server under `valgrind --tool=callgrind`, collecting only inside
Scheduler::StepActive (every step: prefill chunks, decode rows, speculative rounds; not the
start-up, HTTP or admission), sends --requests sequential streamed greedy completions of
--max-tokens tokens, stops the server and prints the instructions collected, per output token,
and a digest of the output text (equal digests: equal tokens). Deterministic: the count does not
depend on the machine's load. Compare two runs per function with
`callgrind_annotate --inclusive=yes OUT`.

Usage (from the repository root, after building kvtier-engine; several minutes under valgrind):
  /usr/bin/python3 bench/serving/serve_callgrind.py --build build/release --out /tmp/plain.cg
  /usr/bin/python3 bench/serving/serve_callgrind.py --build build/release --out /tmp/spec.cg \
      -- --speculative [--draft-len 0]
"""
import argparse
import hashlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_bench import sse_events  # noqa: E402

PROMPT = ("The quick brown fox jumps over the lazy dog while the cache tiers hold the keys "
          "and values of every session. ")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build/release")
    ap.add_argument("--out", required=True, help="callgrind output file")
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("serve_flags", nargs="*", help="after --: more flags for serve")
    args = ap.parse_args()
    if not 1 <= args.requests <= 16 or not 1 <= args.max_tokens <= 1024:
        sys.exit("serve_callgrind: --requests in [1, 16], --max-tokens in [1, 1024]")
    port_file = args.out + ".port"
    if os.path.exists(port_file):
        os.remove(port_file)
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=" + args.out,
           "--toggle-collect=kvtier::serving::Scheduler::StepActive()",
           os.path.join(args.build, "engine/kvtier-engine"), "serve", "--port", "0",
           "--port-file", port_file, "--idle-sequences-max", "0", "--active-sequences-max", "64",
           "--threads", "1"]
    log = open(args.out + ".log", "w")
    proc = subprocess.Popen(cmd + args.serve_flags, stdout=log, stderr=log)
    for _ in range(6000):  # start-up under valgrind: up to 10 minutes
        if os.path.exists(port_file) and open(port_file).read().strip():
            break
        if proc.poll() is not None:
            sys.exit("serve exited; see " + log.name)
        time.sleep(0.1)
    port = int(open(port_file).read())
    tokens, digest = 0, hashlib.sha256()
    for i in range(args.requests):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
        body = {"model": "kvmini-trained", "prompt": PROMPT[:40 + 7 * i],
                "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        c.request("POST", "/v1/completions", json.dumps(body),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            sys.exit("HTTP %d: %s" % (r.status, r.read()[:300]))
        for j in sse_events(r):
            if j.get("usage"):
                tokens += j["usage"]["completion_tokens"]
            if j.get("choices"):
                digest.update(j["choices"][0].get("text", "").encode())
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=600)
    ir = 0
    with open(args.out) as f:
        for line in f:
            m = re.match(r"(summary|totals): (\d+)", line)
            if m:
                ir = int(m.group(2))
                break
    print(json.dumps({"instructions": ir, "output_tokens": tokens,
                      "instructions_per_token": round(ir / max(tokens, 1)),
                      "text_sha256": digest.hexdigest()[:16],
                      "serve_flags": " ".join(args.serve_flags)}))


if __name__ == "__main__":
    main()
