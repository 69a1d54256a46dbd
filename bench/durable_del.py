#!/usr/bin/env python3
"""DEL under durability "sync" against redis-server --appendonly yes --appendfsync always.

Both servers run on free loopback ports with data directories under one new directory in
$TMPDIR (default /tmp), the same clients against each, alternating ROUNDS times:
  pairs     CONNS connections (default 32), each in a loop: SET of a 100-byte value to one of
            its 64 keys, then DEL of it, waiting for each reply; SET+DEL pairs per second over
            SECONDS (default 4)
  pipedel   one connection: an MSET of 64 keys x 1,024 bytes (untimed), then 64 one-key DELs
            sent in one write (a pipeline), timed until the 64th reply; milliseconds per
            pipeline, 20 pipelines per round
The medians over the rounds and their ratio (kvtierd / redis-server: pairs/s, and redis's
milliseconds over kvtierd's for pipedel, so that above 1.0 means kvtierd is faster) are
printed, with kvtierd's SSD commits per DEL (kvtier_ssd_commits_total on /metrics, over the
pipedel rounds, the MSETs' own commits left out). Reports only; asserts nothing.

Usage: bench/durable_del.py KVTIERD [ROUNDS=3] [CONNS=32] [SECONDS=4]
"""
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

KEYS, VALUE_BYTES, PIPELINES = 64, 1024, 20


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def cmd(*args):
    out = b"*%d\r\n" % len(args)
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out += b"$%d\r\n%s\r\n" % (len(a), a)
    return out


class Server:
    """kvtierd (http_port set) or redis-server, started on a free port, waited for."""

    def __init__(self, root, kvtierd=None):
        self.port = free_port()
        self.http = None
        self.dir = tempfile.mkdtemp(dir=root)
        if kvtierd:
            self.http = free_port()
            conf = os.path.join(self.dir, "kvtierd.toml")
            with open(conf, "w") as f:
                f.write("[storage]\ndram_capacity_bytes = 268435456\n"
                        "ssd_capacity_bytes = 1073741824\nssd_segment_bytes = 67108864\n"
                        "durability = \"sync\"\n")
            argv = [kvtierd, "--config", conf, "--data-dir", self.dir, "--socket",
                    os.path.join(self.dir, "s.sock"), "--listen", "127.0.0.1", "--resp-port",
                    str(self.port), "--http-port", str(self.http)]
        else:
            argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                    "--dir", self.dir, "--appendonly", "yes", "--appendfsync", "always",
                    "--save", ""]
        self.log = open(os.path.join(self.dir, "server.log"), "w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=self.log)
        for _ in range(400):
            try:
                socket.create_connection(("127.0.0.1", self.port)).close()
                return
            except OSError:
                time.sleep(0.025)
        raise SystemExit("server did not listen; log in " + self.dir)

    def commits(self):
        page = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % self.http).read()
        for line in page.decode().splitlines():
            if line.startswith("kvtier_ssd_commits_total "):
                return float(line.split()[1])
        return -1.0

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.log.close()


async def pair_loop(port, conn, deadline, counts):
    r, w = await asyncio.open_connection("127.0.0.1", port)
    n = 0
    value = "v" * 100
    while time.monotonic() < deadline:
        key = "c%d:%d" % (conn, n % KEYS)
        w.write(cmd("SET", key, value))
        await w.drain()
        await r.readline()
        w.write(cmd("DEL", key))
        await w.drain()
        await r.readline()
        n += 1
    counts[conn] = n
    w.close()


def pairs_per_s(port, conns, seconds):
    counts = [0] * conns

    async def run():
        deadline = time.monotonic() + seconds
        await asyncio.gather(*[pair_loop(port, c, deadline, counts) for c in range(conns)])

    asyncio.run(run())
    return sum(counts) / seconds


def roundtrip(sock, data, want_bytes):
    sock.sendall(data)
    got = b""
    while len(got) < want_bytes:
        chunk = sock.recv(1 << 20)
        if not chunk:
            raise SystemExit("connection closed")
        got += chunk
    return got


def pipedel(server):
    """Milliseconds per pipeline of 64 one-key DELs, and commits per DEL (kvtierd only)."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    mset = [b"MSET"]
    for k in range(KEYS):
        mset += [b"m%d" % k, b"x" * VALUE_BYTES]
    dels = b"".join(cmd("DEL", "m%d" % k) for k in range(KEYS))
    elapsed, commits = 0.0, 0.0
    for _ in range(PIPELINES):
        roundtrip(sock, cmd(*mset), 5)
        time.sleep(0.02)  # the MSET's commit is counted after its waiters were released
        c0 = server.commits() if server.http else 0
        t0 = time.perf_counter()
        got = roundtrip(sock, dels, 4 * KEYS)
        elapsed += time.perf_counter() - t0
        if got != b":1\r\n" * KEYS:
            raise SystemExit("unexpected DEL replies %r" % got[:100])
        if server.http:
            time.sleep(0.02)
            commits += server.commits() - c0
    sock.close()
    return elapsed / PIPELINES * 1e3, commits / (PIPELINES * KEYS)


def main():
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    kvtierd = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    conns = int(sys.argv[3]) if len(sys.argv) > 3 else 32
    seconds = float(sys.argv[4]) if len(sys.argv) > 4 else 4
    root = tempfile.mkdtemp(prefix="kvtier_durable_del.")
    res = {"kvtierd": {"pairs": [], "pipedel": [], "commits": []},
           "redis": {"pairs": [], "pipedel": []}}
    try:
        for _ in range(rounds):
            for name in ("kvtierd", "redis"):
                s = Server(root, kvtierd if name == "kvtierd" else None)
                try:
                    res[name]["pairs"].append(pairs_per_s(s.port, conns, seconds))
                    ms, per_del = pipedel(s)
                    res[name]["pipedel"].append(ms)
                    if name == "kvtierd":
                        res[name]["commits"].append(per_del)
                finally:
                    s.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in res.items()}
    print("kvtierd %s; %d rounds; pairs: %d connections x %.0f s; pipedel: %d x %d DELs"
          % (kvtierd, rounds, conns, seconds, PIPELINES, KEYS))
    print("pairs/s    kvtierd %.0f (%s)  redis %.0f (%s)  ratio %.2f" % (
        med["kvtierd"]["pairs"], " ".join("%.0f" % v for v in res["kvtierd"]["pairs"]),
        med["redis"]["pairs"], " ".join("%.0f" % v for v in res["redis"]["pairs"]),
        med["kvtierd"]["pairs"] / med["redis"]["pairs"]))
    print("pipedel ms kvtierd %.3f  redis %.3f  ratio (redis/kvtierd) %.2f  "
          "kvtierd commits per DEL %.3f" % (
              med["kvtierd"]["pipedel"], med["redis"]["pipedel"],
              med["redis"]["pipedel"] / med["kvtierd"]["pipedel"], med["kvtierd"]["commits"]))


if __name__ == "__main__":
    main()
