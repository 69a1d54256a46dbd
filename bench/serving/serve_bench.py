#!/usr/bin/python3
"""Benchmark of `kvtier-engine serve` (docs/performance/serving.md, "Serving").

Starts its own kvtierd and servers on 127.0.0.1 free ports and a temporary directory, and
measures, each against its peer in the same run:

  throughput  output tokens/s of R greedy completion requests run at concurrency C (C client
              threads, continuous batching in the server) against the same R requests one
              after another on the same server; the ratio is the batching gain, and cpu_ratio
              the same ratio per CPU second of the server process (all its threads, spinning
              engine workers included; steadier than wall time on a loaded machine).
  ttft        time to first token of a request that continues a long saved conversation
              (T tokens), resumed from kvtierd, against the same request on a server with the
              cache off (the whole prompt computed).
  spec        (--spec) output tokens/s of the same R greedy requests at concurrency C on a
              server with --speculative (DSpark draft, load-aware draft scheduler, or
              --spec-draft-len) against one without, the two passes back to back (plain first at
              the 1st, 3rd, ... concurrency, speculative first at the 2nd, 4th, ...); with the
              speculative counters of the pass (accepted per verification, undrafted rounds)
              and cpu_ratio, the same ratio per CPU second of each server process.
  gap         the inter-token gap of S running streams while a long prompt (G tokens) arrives:
              the largest gap between two of their tokens while it is prefilled, against their
              median gap before it arrived (ratio = stall in steps' worth of time). Run it on two
              builds (e.g. before and after chunked prefill) to compare them.
  restore_gap the same gap while a request that continues a saved conversation of G tokens is
              restored from kvtierd (--guard fetch, nothing resident; after one restore of it
              that warms the server, or with --restore-gap-ssd of another conversation, so that
              its units come from kvtierd's SSD tier): the cost a restore puts on the running
              streams (its fetch, and its hot state or replay on the engine), and the restored
              request's own time.
  transport   time to first token of a request that continues a saved conversation of T
              tokens, restored from kvtierd through its Unix socket (shared memory), its native
              TCP port, and that port under TLS (the certificate deploy/k8s/kvtierd-tls.sh
              makes, verified), against the same request with the cache off; the Unix socket
              and TCP also with the server's allocator left at glibc's defaults (unix_glibc,
              tcp_glibc: common/malloc_tuning.h), and TCP to a kvtierd that keeps no reply
              buffers (tcp_unkept: limits.reply_buffers_kept_bytes_max = 0). Each arm is its
              own server; its first request is a fresh server's first restore (reported apart,
              with the page faults it took), then the arms' requests alternate (a new suffix
              each, nothing resident), each arm reported as the median of --transport-rounds,
              with its median page faults per restore and the CPU its kvtierd spent meanwhile.
              All on loopback: it measures what each transport costs the two processes, not a
              network.

Usage (from the repository root, after building kvtierd and kvtier-engine):
  /usr/bin/python3 bench/serving/serve_bench.py --build build/release \
      [--concurrency 1,4,16,32] [--requests 32] [--max-tokens 64] [--ttft-tokens 16384]
      [--gap-tokens 4096] [--gap-streams 4] [--restore-gap-tokens 16384 [--restore-gap-ssd]]
      [--spec [--spec-draft-len N]] [--transport-tokens 16384,65472 [--transport-rounds 7]]
      [--model W.safetensors --config C.json [--model-id NAME]] [--prompt-bytes N]

--model/--config serve another model than the trained miniature (e.g. random weights of
deploy/models/mini-v4.1.json from `kvtier-engine init`): its output is meaningless bytes, which
is fine for throughput; the throughput rows count the requests that ended before max_tokens
(eos or a stop string) in each pass (`short_sequential`, `short_concurrent`): greedy decoding
gives both passes the same tokens, so the counts must agree.

Prints one JSON object per measurement and a summary table. Deterministic requests (fixed
prompts, temperature 0). Bounded: every request has a timeout; the servers are stopped at exit.
"""
import argparse
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time


def sse_events(response):
    """The JSON events of a completion's server-sent-event stream, in order, up to [DONE]."""
    for line in response:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def text(n, seed):
    """Deterministic printable text of n bytes."""
    words = ["the ", "cache ", "tier ", "page ", "unit ", "hit ", "of ", "a ", "token ", "kv "]
    out, x = [], seed * 2654435761 + 1
    size = 0
    while size < n:
        x = (x * 1664525 + 1013904223) % (1 << 32)
        w = words[(x >> 16) % 10]
        out.append(w)
        size += len(w)
    return "".join(out)[:n]


class Server:
    """A running `kvtier-engine serve` (stopped by stop())."""

    # Flags every server gets: the model to serve (--model, --config, --model-id of main()).
    model_flags = []

    def __init__(self, build, workdir, name, extra, env=None):
        self.port_file = os.path.join(workdir, name + ".port")
        if os.path.exists(self.port_file):
            os.remove(self.port_file)
        self.log = open(os.path.join(workdir, name + ".log"), "w")
        cmd = [os.path.join(build, "engine/kvtier-engine"), "serve", "--port", "0",
               "--port-file", self.port_file] + Server.model_flags + extra
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=self.log,
                                     env=dict(os.environ, **env) if env else None)
        for _ in range(600):
            if os.path.exists(self.port_file):
                self.port = int(open(self.port_file).read())
                return
            if self.proc.poll() is not None:
                raise RuntimeError("serve exited; see " + self.log.name)
            time.sleep(0.05)
        raise RuntimeError("serve did not start")

    def post(self, body, stream=False, timeout=1800):
        """POST /v1/completions. Returns (usage, seconds to first data event, total seconds)."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        t0 = time.monotonic()
        body = dict(body, stream=stream)
        if stream:
            body["stream_options"] = {"include_usage": True}
        c.request("POST", "/v1/completions", json.dumps(body),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError("HTTP %d: %s" % (r.status, r.read()[:300]))
        if not stream:
            j = json.loads(r.read())
            return j["usage"], None, time.monotonic() - t0
        first, usage = None, None
        for j in sse_events(r):
            if first is None:
                first = time.monotonic() - t0
            if j.get("usage"):
                usage = j["usage"]
        return usage, first, time.monotonic() - t0

    def stream_times(self, body, times, timeout=1800):
        """Streams a completion and appends the arrival time of every text event to times."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        c.request("POST", "/v1/completions", json.dumps(dict(body, stream=True)),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError("HTTP %d: %s" % (r.status, r.read()[:300]))
        for j in sse_events(r):
            if j.get("choices") and j["choices"][0].get("text"):
                times.append(time.monotonic())

    def stat_fields(self):
        """/proc/PID/stat of the server after its command name: [0] is proc(5)'s field 3."""
        with open("/proc/%d/stat" % self.proc.pid) as f:
            return f.read().rsplit(")", 1)[1].split()

    def cpu_seconds(self):
        """User + system CPU seconds the server process has used so far (all its threads)."""
        fields = self.stat_fields()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def minor_faults(self):
        """Minor page faults of the server process so far (all its threads)."""
        return int(self.stat_fields()[7])

    def metrics(self):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        c.request("GET", "/metrics")
        return c.getresponse().read().decode()

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_daemon(build, workdir, name="d", config="", flags=(), dram_bytes=256 << 20):
    """A kvtierd in workdir (its files named `name`), with a DRAM tier of dram_bytes, `config`
    appended to its config and `flags` to its command line; returns (process, socket path)."""
    sock = os.path.join(workdir, name + ".sock")
    cfg = os.path.join(workdir, name + ".toml")
    with open(cfg, "w") as f:
        f.write("[storage]\ndram_capacity_bytes = %d\nssd_capacity_bytes = 1073741824\n"
                "ssd_segment_bytes = 67108864\n%s" % (dram_bytes, config))
    log = open(os.path.join(workdir, name + ".log"), "w")
    proc = subprocess.Popen([os.path.join(build, "cache_daemon/kvtierd"), "--config", cfg,
                             "--data-dir", os.path.join(workdir, name + "-data"), "--socket", sock,
                             "--resp-port", str(free_port()), "--http-port", str(free_port())] +
                            list(flags), stdout=log, stderr=log)
    for _ in range(600):
        if os.path.exists(sock):
            return proc, sock
        time.sleep(0.05)
    raise RuntimeError("kvtierd did not start")


def stop_daemon(proc, workdir):
    """Stops start_daemon's kvtierd and removes the run's directory."""
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    shutil.rmtree(workdir, ignore_errors=True)


def prompt_bytes(args, i):
    """Prompt length of request i: --prompt-bytes, or 16 + 3i bytes when that is 0."""
    return args.prompt_bytes if args.prompt_bytes else 16 + 3 * i


def throughput(build, workdir, args):
    # Cache off: every pass does the same work (no unit is saved by one pass and found by the
    # next).
    server = Server(build, workdir, "tput", ["--idle-sequences-max", "0",
                                             "--active-sequences-max", "64",
                                             "--threads", str(args.threads)])
    # Short prompts: the measurement is about decode steps (the prompts' prefill chunks are
    # the same work in both runs).
    bodies = [{"model": args.model_id, "prompt": text(prompt_bytes(args, i), 1000 + i),
               "max_tokens": args.max_tokens, "temperature": 0} for i in range(args.requests)]
    rows = []
    try:
        for b in bodies[:4]:  # warm-up
            server.post(b, stream=True)
        for c in args.concurrency:
            # The peer, measured right before: the same streamed requests one after another.
            t0, cpu0 = time.monotonic(), server.cpu_seconds()
            seq_counts = [server.post(b, stream=True)[0]["completion_tokens"] for b in bodies]
            seq_s, cpu1 = time.monotonic() - t0, server.cpu_seconds()
            seq_tokens = sum(seq_counts)
            out_tokens, s, short = run_concurrent(server, bodies, c)
            cpu2 = server.cpu_seconds()
            row = {"bench": "throughput", "concurrency": c, "requests": len(bodies),
                   "output_tokens": out_tokens, "sequential_output_tokens": seq_tokens,
                   "short_sequential": sum(1 for n in seq_counts if n < args.max_tokens),
                   "short_concurrent": short, "seconds": round(s, 3),
                   "tokens_per_s": round(out_tokens / s, 1),
                   "sequential_tokens_per_s": round(seq_tokens / seq_s, 1),
                   "ratio": round((out_tokens / s) / (seq_tokens / seq_s), 2),
                   "cpu_ratio": round((out_tokens / max(cpu2 - cpu1, 1e-9)) /
                                      (seq_tokens / max(cpu1 - cpu0, 1e-9)), 2),
                   "load": os.getloadavg()[0]}
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        server.stop()
    return rows


def metric(text, name):
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def run_concurrent(server, bodies, c):
    """Runs bodies at concurrency c (streamed); returns (completion tokens, seconds, requests
    that ended before their max_tokens)."""
    tokens, short, lock, idx = [0], [0], threading.Lock(), [0]

    def worker():
        while True:
            with lock:
                if idx[0] >= len(bodies):
                    return
                b = bodies[idx[0]]
                idx[0] += 1
            u = server.post(b, stream=True)[0]
            with lock:
                tokens[0] += u["completion_tokens"]
                short[0] += u["completion_tokens"] < b["max_tokens"]

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return tokens[0], time.monotonic() - t0, short[0]


def spec(build, workdir, args):
    """Decode tokens/s with --speculative against without, same requests, same concurrency."""
    common = ["--idle-sequences-max", "0", "--active-sequences-max", "64", "--threads",
              str(args.threads)]
    flags = ["--speculative"]
    if args.spec_draft_len is not None:
        flags += ["--draft-len", str(args.spec_draft_len)]
    plain = Server(build, workdir, "spec_off", common)
    fast = Server(build, workdir, "spec_on", common + flags)
    bodies = [{"model": args.model_id, "prompt": text(prompt_bytes(args, i), 1000 + i),
               "max_tokens": args.max_tokens, "temperature": 0} for i in range(args.requests)]
    rows = []
    try:
        for b in bodies[:4]:  # warm-up
            plain.post(b, stream=True)
            fast.post(b, stream=True)
        for i, c in enumerate(args.concurrency):
            def run_plain():
                c0 = plain.cpu_seconds()
                tokens, secs, _ = run_concurrent(plain, bodies, c)
                return tokens, secs, plain.cpu_seconds() - c0

            def run_spec():
                m0 = fast.metrics()
                c0 = fast.cpu_seconds()
                tokens, secs, _ = run_concurrent(fast, bodies, c)
                return tokens, secs, fast.cpu_seconds() - c0, m0, fast.metrics()

            # Alternate which server goes first, so that neither always runs second (after
            # the other's pass, in whatever the machine does next).
            if i % 2 == 0:
                off_tokens, off_s, off_cpu = run_plain()
                on_tokens, on_s, on_cpu, m0, m1 = run_spec()
            else:
                on_tokens, on_s, on_cpu, m0, m1 = run_spec()
                off_tokens, off_s, off_cpu = run_plain()
            d = {k: metric(m1, "kvtier_serve_spec_" + k) - metric(m0, "kvtier_serve_spec_" + k)
                 for k in ("verifications_total", "drafted_tokens_total",
                           "accepted_tokens_total", "rounds_total", "rounds_undrafted_total",
                           "draft_passes_total")}
            ver = d["verifications_total"] or 1
            row = {"bench": "spec", "concurrency": c, "requests": len(bodies),
                   "first": "plain" if i % 2 == 0 else "spec",
                   "draft_len": args.spec_draft_len if args.spec_draft_len is not None
                   else "scheduler",
                   "output_tokens": on_tokens, "same_tokens": on_tokens == off_tokens,
                   "tokens_per_s_spec": round(on_tokens / on_s, 1),
                   "tokens_per_s_plain": round(off_tokens / off_s, 1),
                   "ratio": round((on_tokens / on_s) / (off_tokens / off_s), 2),
                   # Tokens per CPU second of the server process, spec / plain: less
                   # sensitive to other processes on a shared machine than the wall clock.
                   "cpu_ratio": round((on_tokens / max(on_cpu, 1e-9)) /
                                      (off_tokens / max(off_cpu, 1e-9)), 2),
                   "drafted_per_verification": round(d["drafted_tokens_total"] / ver, 2),
                   "accepted_per_verification": round(d["accepted_tokens_total"] / ver, 2),
                   "undrafted_rounds": int(d["rounds_undrafted_total"]),
                   "rounds": int(d["rounds_total"]),
                   # Draft passes run (probes included); absent (0) before the counter existed.
                   "draft_passes": int(d["draft_passes_total"]),
                   "load": os.getloadavg()[0]}
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        plain.stop()
        fast.stop()
    return rows


def ttft(build, workdir, sock, tokens, args):
    """Continue a saved conversation of `tokens` tokens: cache on (resumed from kvtierd)
    against cache off (computed)."""
    # A "64K" history is 65472 tokens (1023 whole pages), as measured before chunked prefill
    # lifted the 65536-token context cap.
    tokens = min(tokens, 65536 - 64)
    ctx = str(tokens + 1024)
    common = ["--context-tokens-max", ctx, "--kv-pool-tokens-max", ctx, "--idle-sequences-max",
              "0", "--max-tokens-max", "8", "--threads", str(args.threads),
              "--body-bytes-max", str(4 * tokens + 65536)]
    history = text(tokens, 7)
    turn = {"model": args.model_id, "prompt": history + " and then", "max_tokens": 1,
            "temperature": 0}
    on = Server(build, workdir, "ttft_on", ["--socket", sock, "--guard", "fetch"] + common)
    try:
        on.post({"model": args.model_id, "prompt": history, "max_tokens": 1,
                 "temperature": 0})  # the saved conversation
        usage_on, first_on, _ = on.post(turn, stream=True)
    finally:
        on.stop()
    off = Server(build, workdir, "ttft_off", common)
    try:
        usage_off, first_off, _ = off.post(turn, stream=True)
    finally:
        off.stop()
    row = {"bench": "ttft", "history_tokens": tokens, "prompt_tokens": usage_on["prompt_tokens"],
           "cached_tokens": usage_on["prompt_tokens_details"]["cached_tokens"],
           "ttft_cache_s": round(first_on, 3), "ttft_no_cache_s": round(first_off, 3),
           "ratio": round(first_off / first_on, 1), "load": os.getloadavg()[0]}
    print(json.dumps(row), flush=True)
    return row


def stream_gaps(server, args, body):
    """Runs S greedy streams on `server`, sends `body` once they all decode, and returns its
    usage with the streams' gaps: the median before it arrived and those while it ran."""
    server.post({"model": args.model_id, "prompt": text(64, 1), "max_tokens": 4,
                 "temperature": 0})  # warm-up
    times = [[] for _ in range(args.gap_streams)]
    streams = [threading.Thread(target=server.stream_times, args=(
        {"model": args.model_id, "prompt": text(16 + 5 * i, 3000 + i),
         "max_tokens": args.gap_stream_tokens, "temperature": 0}, times[i]))
        for i in range(args.gap_streams)]
    for t in streams:
        t.start()
    while min(len(t) for t in times) < 20:  # every stream is decoding
        time.sleep(0.005)
    t_arrive = time.monotonic()
    usage, _, _ = server.post(body)
    t_done = time.monotonic()
    for t in streams:
        t.join()
    before, during = [], []
    for ts in times:
        for a, b in zip(ts, ts[1:]):
            if b <= t_arrive:
                before.append(b - a)
            elif a < t_done and b > t_arrive:
                during.append(b - a)
    before.sort()
    if any(len(ts) < args.gap_stream_tokens // 2 for ts in times):
        print("serve_bench: a stream ended early (eos); its gaps are still counted",
              file=sys.stderr)
    return usage, t_done - t_arrive, before[len(before) // 2], during


def print_gap_row(row, median_before, during):
    """Completes a gap row with the streams' gaps, prints it and returns it."""
    worst = max(during) if during else float("nan")
    row.update({"median_gap_before_s": round(median_before, 4),
                "max_gap_during_s": round(worst, 3), "tokens_during": len(during),
                "ratio": round(worst / median_before, 1), "load": os.getloadavg()[0]})
    print(json.dumps(row), flush=True)
    return row


def gap(build, workdir, args):
    """S greedy streams run; a G-token prompt arrives; how long do the streams stall?"""
    g = args.gap_tokens
    ctx = str(g + 1024)
    server = Server(build, workdir, "gap", ["--idle-sequences-max", "0", "--threads",
                                            str(args.threads), "--context-tokens-max", ctx,
                                            "--kv-pool-tokens-max", str(8 * (g + 1024)),
                                            "--body-bytes-max", str(4 * g + 65536)])
    try:
        usage, took, median_before, during = stream_gaps(
            server, args, {"model": args.model_id, "prompt": text(g, 9), "max_tokens": 1,
                           "temperature": 0})
    finally:
        server.stop()
    return print_gap_row({"bench": "gap", "long_prompt_tokens": usage["prompt_tokens"],
                          "streams": args.gap_streams, "prefill_s": round(took, 3)},
                         median_before, during)


def restore_gap(build, workdir, sock, args):
    """S greedy streams run; a request continuing a saved G-token conversation is restored
    from kvtierd; how long do the streams stall?"""
    g = args.restore_gap_tokens
    ctx = str(g + 1024)
    server = Server(build, workdir, "restore_gap",
                    ["--socket", sock, "--guard", "fetch", "--idle-sequences-max", "0",
                     "--threads", str(args.threads), "--context-tokens-max", ctx,
                     "--kv-pool-tokens-max", str(8 * (g + 1024)),
                     "--body-bytes-max", str(4 * g + 65536)])
    history = text(g, 11)
    try:
        server.post({"model": args.model_id, "prompt": history, "max_tokens": 1,
                     "temperature": 0})  # the saved conversation
        # One restore first: a fresh server's first restore is slower than the next ones
        # (docs/performance/serving.md, "kvtierd off the step thread"). With --restore-gap-ssd
        # it restores another conversation, so that the measured one's units are read from
        # kvtierd's SSD tier (where they are put; a first read promotes them to DRAM).
        warm = text(g, 12) if args.restore_gap_ssd else history
        if args.restore_gap_ssd:
            server.post({"model": args.model_id, "prompt": warm, "max_tokens": 1,
                         "temperature": 0})
        server.post({"model": args.model_id, "prompt": warm + " at first", "max_tokens": 1,
                     "temperature": 0})
        usage, took, median_before, during = stream_gaps(
            server, args, {"model": args.model_id, "prompt": history + " and then",
                           "max_tokens": 1, "temperature": 0})
    finally:
        server.stop()
    return print_gap_row({"bench": "restore_gap", "from": "ssd" if args.restore_gap_ssd else "dram",
                          "prompt_tokens": usage["prompt_tokens"],
                          "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                          "streams": args.gap_streams, "request_s": round(took, 3)},
                         median_before, during)


def transport(build, workdir, tokens, args):
    """Continue a saved conversation of `tokens` tokens, restored from kvtierd over the Unix
    socket, plain TCP and TLS (loopback), against the same request computed."""
    tokens = min(tokens, 65536 - 64)
    ctx = str(tokens + 1024)
    common = ["--context-tokens-max", ctx, "--kv-pool-tokens-max", ctx, "--idle-sequences-max",
              "0", "--max-tokens-max", "8", "--threads", str(args.threads),
              "--body-bytes-max", str(4 * tokens + 65536), "--guard", "fetch"]
    pki = os.path.join(workdir, "pki")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not os.path.exists(os.path.join(pki, "tls.crt")):  # made once per run
        subprocess.run([os.path.join(root, "deploy/k8s/kvtierd-tls.sh"), pki], check=True,
                       stdout=subprocess.DEVNULL)
    # Three kvtierds: TLS is per front, and the Unix socket and plain TCP share the first; the
    # third keeps no reply buffers (limits.reply_buffers_kept_bytes_max = 0), as kvtierd was
    # before it kept them.
    plain_port, tls_port, unkept_port = free_port(), free_port(), free_port()
    procs, servers = [], {}
    try:
        d1, sock1 = start_daemon(build, workdir, "tp%d" % tokens,
                                 flags=["--native-port", str(plain_port)])
        procs.append(d1)
        d2, _ = start_daemon(build, workdir, "tt%d" % tokens, flags=["--native-port", str(tls_port)],
                             config='[tls]\ncert_file = "%s/tls.crt"\nkey_file = "%s/tls.key"\n'
                                    'native = true\n' % (pki, pki))
        procs.append(d2)
        d3, sock3 = start_daemon(build, workdir, "tk%d" % tokens,
                                 flags=["--native-port", str(unkept_port)],
                                 config="[limits]\nreply_buffers_kept_bytes_max = 0\n")
        procs.append(d3)
        wait_port(tls_port)
        wait_port(plain_port)
        wait_port(unkept_port)
        tcp = ["--kvtierd", "127.0.0.1:%d" % plain_port]
        tcp_unkept = ["--kvtierd", "127.0.0.1:%d" % unkept_port]
        tls = ["--kvtierd", "127.0.0.1:%d" % tls_port, "--kvtierd-tls", "--kvtierd-ca",
               os.path.join(pki, "ca.crt"), "--kvtierd-server-name", "kvtierd"]
        history = text(tokens, 13)
        # The saved conversation, in each kvtierd, by servers of their own: every measured
        # server's first request is then its first restore.
        for name, f in (("save_unix", ["--socket", sock1]), ("save_tls", tls),
                        ("save_unkept", ["--socket", sock3])):
            saver = Server(build, workdir, "transport_" + name, f + common)
            try:
                saver.post({"model": args.model_id, "prompt": history, "max_tokens": 1,
                            "temperature": 0})
            finally:
                saver.stop()
        flags = {"unix": ["--socket", sock1], "unix_glibc": ["--socket", sock1], "tcp": tcp,
                 "tcp_glibc": tcp, "tcp_unkept": tcp_unkept, "tls": tls, "off": []}
        daemon_of = {"unix": d1, "unix_glibc": d1, "tcp": d1, "tcp_glibc": d1, "tcp_unkept": d3,
                     "tls": d2}
        for name, f in flags.items():
            # *_glibc: a malloc tunable at its default value leaves the server's allocator as
            # glibc sets it (common/malloc_tuning.h), the arm before that tuning.
            env = {"GLIBC_TUNABLES": "glibc.malloc.arena_test=8"} if name.endswith("_glibc") else None
            servers[name] = Server(build, workdir, "transport_" + name, f + common, env)

        def restore(name, prompt):
            """TTFT of `prompt` on arm `name`, the page faults it took, its cached tokens, and
            the CPU its kvtierd spent meanwhile (ms; None with the cache off)."""
            f0 = servers[name].minor_faults()
            d = daemon_of.get(name)
            k0 = daemon_cpu_ns(d.pid) if d else 0
            usage, first, _ = servers[name].post(
                {"model": args.model_id, "prompt": prompt, "max_tokens": 1, "temperature": 0},
                stream=True)
            kcpu = (daemon_cpu_ns(d.pid) - k0) / 1e6 if d else None
            return first, servers[name].minor_faults() - f0, \
                usage["prompt_tokens_details"]["cached_tokens"], kcpu

        order = [n for n in flags if n != "off"] + ["off"]
        first_restore = {n: restore(n, history + " at first " + n)[:2] for n in order if n != "off"}
        firsts = {name: [] for name in order}
        faults = {name: [] for name in order}
        kvtierd_ms = {name: [] for name in order if name != "off"}
        cached = {}
        for r in range(args.transport_rounds):
            for name in order[r % len(order):] + order[:r % len(order)]:  # rotated
                if name == "off" and r >= 3:
                    continue  # the computed prompt takes seconds: three are enough
                # A suffix of its own: no request continues another's saved turn, so each
                # restores the history's pages and its hot state, then prefills the suffix.
                first, fault, hit, kcpu = restore(name, history + " and then %s %d" % (name, r))
                firsts[name].append(first)
                faults[name].append(fault)
                if kcpu is not None:
                    kvtierd_ms[name].append(kcpu)
                cached.setdefault(name, set()).add(hit)
        med = {name: sorted(v)[len(v) // 2] for name, v in firsts.items()}
        row = {"bench": "transport", "history_tokens": tokens,
               "cached_tokens": {n: sorted(c) for n, c in cached.items()},
               "rounds": args.transport_rounds,
               "ttft_unix_s": round(med["unix"], 4),
               "ttft_unix_glibc_s": round(med["unix_glibc"], 4),
               "ttft_tcp_s": round(med["tcp"], 4),
               "ttft_tcp_glibc_s": round(med["tcp_glibc"], 4),
               "ttft_tcp_unkept_s": round(med["tcp_unkept"], 4),
               "ttft_tls_s": round(med["tls"], 4), "ttft_no_cache_s": round(med["off"], 3),
               "tcp_over_unix": round(med["tcp"] / med["unix"], 2),
               "unix_glibc_over_unix": round(med["unix_glibc"] / med["unix"], 2),
               "tcp_glibc_over_tcp": round(med["tcp_glibc"] / med["tcp"], 2),
               "tcp_unkept_over_tcp": round(med["tcp_unkept"] / med["tcp"], 2),
               "tls_over_unix": round(med["tls"] / med["unix"], 2),
               "no_cache_over_tls": round(med["off"] / med["tls"], 1),
               "samples_s": {n: [round(x, 4) for x in v] for n, v in firsts.items()},
               "page_faults_per_restore": {n: sorted(v)[len(v) // 2]
                                           for n, v in faults.items() if n != "off"},
               "kvtierd_cpu_ms_per_restore": {n: round(sorted(v)[len(v) // 2], 1)
                                              for n, v in kvtierd_ms.items()},
               "first_restore": {n: {"s": round(t, 4), "page_faults": pf}
                                 for n, (t, pf) in first_restore.items()},
               "load": os.getloadavg()[0]}
        print(json.dumps(row), flush=True)
        return row
    finally:
        for srv in servers.values():
            srv.stop()
        for p in procs:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=60)


def daemon_cpu_ns(pid):
    """CPU nanoseconds the threads of process `pid` have run (schedstat, all live threads)."""
    total = 0
    for tid in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/schedstat" % (pid, tid)) as f:
                total += int(f.read().split()[0])
        except OSError:
            pass  # the thread ended meanwhile
    return total


def wait_port(port):
    """Waits (up to 30 s) until 127.0.0.1:port accepts."""
    for _ in range(600):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("port %d does not accept" % port)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build/release")
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ttft-tokens", default="16384", help="comma list; empty skips")
    ap.add_argument("--threads", type=int, default=1, help="engine threads")
    ap.add_argument("--model", default=None, help="weights (.safetensors); default: the server's")
    ap.add_argument("--config", default=None, help="config.json of --model")
    ap.add_argument("--model-id", default="kvmini-trained", help="model name sent and served")
    ap.add_argument("--prompt-bytes", type=int, default=0,
                    help="throughput prompts of this many bytes each (0: 16 + 3i for request i)")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--spec", action="store_true",
                    help="measure --speculative against plain decoding")
    ap.add_argument("--spec-draft-len", type=int, default=None,
                    help="fixed draft length for --spec (default: the draft scheduler)")
    ap.add_argument("--gap-tokens", type=int, default=0,
                    help="long prompt of the gap measurement; 0 skips it")
    ap.add_argument("--gap-streams", type=int, default=4)
    ap.add_argument("--restore-gap-tokens", type=int, default=0,
                    help="saved conversation of the restore_gap measurement; 0 skips it")
    ap.add_argument("--restore-gap-ssd", action="store_true",
                    help="restore_gap reads the restored units from kvtierd's SSD tier")
    ap.add_argument("--gap-stream-tokens", type=int, default=600)
    ap.add_argument("--transport-tokens", default="",
                    help="comma list of saved conversations for the transport measurement")
    ap.add_argument("--transport-rounds", type=int, default=7)
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    if (args.model is None) != (args.config is None):
        sys.exit("serve_bench: --model and --config go together")
    if args.model is not None:
        Server.model_flags = ["--model", args.model, "--config", args.config]
    Server.model_flags += ["--model-id", args.model_id]
    if args.spec_draft_len is not None and not 0 <= args.spec_draft_len <= 15:
        sys.exit("serve_bench: --spec-draft-len in [0, 15]")
    if args.requests < 1 or args.requests > 256 or args.max_tokens < 1 or args.max_tokens > 1024:
        sys.exit("serve_bench: --requests in [1, 256], --max-tokens in [1, 1024]")
    if not 0 <= args.prompt_bytes <= 4096:
        sys.exit("serve_bench: --prompt-bytes in [0, 4096]")
    if not 0 <= args.gap_tokens <= 65536 or not 1 <= args.gap_streams <= 32 or \
            not 40 <= args.gap_stream_tokens <= 4096 or \
            not 0 <= args.restore_gap_tokens <= 65536 - 1024:
        sys.exit("serve_bench: --gap-tokens in [0, 65536], --gap-streams in [1, 32], "
                 "--gap-stream-tokens in [40, 4096], --restore-gap-tokens in [0, 64512]")
    if not 1 <= args.transport_rounds <= 101:
        sys.exit("serve_bench: --transport-rounds in [1, 101]")
    workdir = tempfile.mkdtemp(prefix="kvtier_serve_bench_")
    daemon, sock = start_daemon(args.build, workdir)
    try:
        if not args.skip_throughput:
            throughput(args.build, workdir, args)
        if args.spec:
            spec(args.build, workdir, args)
        for t in [int(x) for x in args.ttft_tokens.split(",") if x]:
            ttft(args.build, workdir, sock, t, args)
        if args.gap_tokens:
            gap(args.build, workdir, args)
        if args.restore_gap_tokens:
            restore_gap(args.build, workdir, sock, args)
        for t in [int(x) for x in args.transport_tokens.split(",") if x]:
            transport(args.build, workdir, t, args)
    finally:
        stop_daemon(daemon, workdir)


if __name__ == "__main__":
    main()
