#!/usr/bin/python3
"""Put and get latency while SSD segments roll and clean, against a quiet window.

Starts kvtierd (RESP front on a free loopback port, data under a temporary directory) with a
small SSD tier (small segments, a capacity the key space overwrites several times, so that
segments roll every few hundred puts and the cleaner relocates sparse ones) and a DRAM tier too
small to hold the key space (gets are mostly served from SSD). Then holds a steady, paced load:
SET threads and GET threads, each on its own connection, each sending one request every
1/rate seconds (a request late on its schedule is sent at once; latency is measured from the
send). A poller reads /metrics every 50 ms. Time is cut into windows of --window-ms: a window
is "roll/clean" when the SSD tier's written bytes crossed a segment boundary or a segment was
cleaned during it (or the window before: a pause straddles the edge), "quiet" otherwise.
Prints p50 / p99 / max of SET and GET latency in each class, with counts.

Usage: bench/ssd_latency.py KVTIERD [--seconds 20] [--durability sync] [...]  (--help)
Reports only; asserts nothing. Loopback only; bounded in time (--seconds) and space.
"""
import argparse
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, proc, seconds=10.0):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("kvtierd exited early")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("kvtierd does not listen on port %d" % port)


class Resp:
    """One blocking RESP connection; replies are read whole (simple, bulk, error)."""

    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def _line(self):
        while b"\r\n" not in self.buf:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise RuntimeError("connection closed")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _exact(self, n):
        while len(self.buf) < n + 2:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise RuntimeError("connection closed")
            self.buf += chunk
        data, self.buf = self.buf[:n], self.buf[n + 2:]
        return data

    def call(self, *args):
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            out.append(b"$%d\r\n%s\r\n" % (len(a), a))
        self.sock.sendall(b"".join(out))
        line = self._line()
        if line.startswith(b"-"):
            raise RuntimeError(line.decode(errors="replace"))
        if line.startswith(b"$"):
            n = int(line[1:])
            return None if n < 0 else self._exact(n)
        return line


def metrics(http_port):
    text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % http_port, timeout=2).read()
    out = {}
    for line in text.decode().splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        out[name] = float(value)
    return out


def percentile(values, q):
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kvtierd")
    ap.add_argument("--seconds", type=float, default=20.0, help="load duration")
    ap.add_argument("--durability", default="sync", choices=["none", "batched", "sync"])
    ap.add_argument("--value-bytes", type=int, default=65536)
    ap.add_argument("--keys", type=int, default=120, help="key space (overwritten at random)")
    ap.add_argument("--segment-mib", type=int, default=4)
    ap.add_argument("--capacity-mib", type=int, default=32)
    ap.add_argument("--dram-mib", type=int, default=4)
    ap.add_argument("--set-threads", type=int, default=2)
    ap.add_argument("--get-threads", type=int, default=2)
    ap.add_argument("--rate", type=float, default=50.0, help="requests/s per thread")
    ap.add_argument("--window-ms", type=int, default=250)
    a = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="kvtier_ssd_latency.")
    port, http = free_port(), free_port()
    segment_bytes = a.segment_mib << 20
    with open(os.path.join(tmp, "kvtierd.toml"), "w") as f:
        f.write("[server]\nio_threads = %d\nworker_threads = 2\nhttp_port = %d\n"
                "[storage]\ndram_capacity_bytes = %d\nssd_capacity_bytes = %d\n"
                "ssd_segment_bytes = %d\ndurability = \"%s\"\n"
                % (a.set_threads + a.get_threads + 2, http, a.dram_mib << 20,
                   a.capacity_mib << 20, segment_bytes, a.durability))
    log = open(os.path.join(tmp, "kvtierd.log"), "w")
    proc = subprocess.Popen([a.kvtierd, "--config", tmp + "/kvtierd.toml", "--data-dir", tmp,
                             "--socket", tmp + "/kvtierd.sock", "--listen", "127.0.0.1",
                             "--resp-port", str(port), "--http-port", str(http)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_port(port, proc)
        rng = random.Random(1)
        value = bytes(rng.getrandbits(8) for _ in range(a.value_bytes))
        # Fill the key space once, so that gets hit and the load is overwrites from the start.
        c = Resp(port)
        for k in range(a.keys):
            c.call(b"SET", b"k%d" % k, value)
        stop = threading.Event()
        samples = {"set": [], "get": []}  # (send time, latency us)
        marks = []  # (time, ssd written bytes, segments cleaned)
        errors = []

        def worker(kind, seed):
            conn = Resp(port)
            r = random.Random(seed)
            period = 1.0 / a.rate
            nxt = time.perf_counter()
            out = samples[kind]
            while not stop.is_set():
                now = time.perf_counter()
                if now < nxt:
                    time.sleep(nxt - now)
                nxt += period
                key = b"k%d" % r.randrange(a.keys)
                t0 = time.perf_counter()
                try:
                    if kind == "set":
                        conn.call(b"SET", key, value)
                    else:
                        conn.call(b"GET", key)
                except Exception as e:  # reported, ends this thread
                    errors.append(str(e))
                    return
                out.append((t0, (time.perf_counter() - t0) * 1e6))

        def poller():
            while not stop.is_set():
                m = metrics(http)
                marks.append((time.perf_counter(),
                              m.get('kvtier_tier_written_bytes_total{tier="ssd"}', 0.0),
                              m.get("kvtier_ssd_segments_cleaned_total", 0.0)))
                time.sleep(0.05)

        threads = [threading.Thread(target=poller)]
        threads += [threading.Thread(target=worker, args=("set", 10 + i))
                    for i in range(a.set_threads)]
        threads += [threading.Thread(target=worker, args=("get", 20 + i))
                    for i in range(a.get_threads)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        time.sleep(a.seconds)
        stop.set()
        for t in threads:
            t.join()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    if errors:
        print("errors: %d, first: %s" % (len(errors), errors[0]), file=sys.stderr)

    w = a.window_ms / 1000.0
    nwin = int(a.seconds / w) + 2
    busy = [False] * nwin
    rolls = cleans = 0
    for (t0, b0, c0), (t1, b1, c1) in zip(marks, marks[1:]):
        rolled = int(b1 // segment_bytes) > int(b0 // segment_bytes)
        cleaned = c1 > c0
        rolls += int(b1 // segment_bytes) - int(b0 // segment_bytes)
        cleans += int(c1 - c0)
        if rolled or cleaned:
            for t in (t0, t1):
                i = int((t - start) / w)
                for j in (i, i + 1):
                    if 0 <= j < nwin:
                        busy[j] = True
    print("durability=%s value=%dB keys=%d segment=%dMiB capacity=%dMiB dram=%dMiB "
          "%d set + %d get threads x %.0f req/s, %.0f s, windows of %d ms"
          % (a.durability, a.value_bytes, a.keys, a.segment_mib, a.capacity_mib, a.dram_mib,
             a.set_threads, a.get_threads, a.rate, a.seconds, a.window_ms))
    print("segment rolls: %d, segments cleaned: %d, windows roll/clean: %d of %d"
          % (rolls, cleans, sum(busy), nwin))
    print("%-4s %-11s %8s %10s %10s %10s" % ("op", "window", "count", "p50 us", "p99 us",
                                            "max us"))
    for kind in ("set", "get"):
        for label, want in (("roll/clean", True), ("quiet", False)):
            lat = [us for t, us in samples[kind] if busy[min(nwin - 1, int((t - start) / w))] == want]
            print("%-4s %-11s %8d %10.0f %10.0f %10.0f" % (kind, label, len(lat),
                                                         percentile(lat, 0.5),
                                                         percentile(lat, 0.99),
                                                         max(lat) if lat else float("nan")))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
