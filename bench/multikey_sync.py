#!/usr/bin/env python3
"""Multi-key RESP commands under durability "sync", one connection, one command at a time.

Starts kvtierd (durability = "sync", data under a new directory in $TMPDIR, default /tmp) once
per case and times ROUNDS commands of each case, waiting for each reply:
  mset      MSET of 64 keys x 1,024 bytes
  pipeline  64 SETs of the same sizes sent in one write (one pipeline)
  set       one SET of 1,024 bytes
  del       DEL of 64 keys (an untimed MSET of them before each)
  pipedel   64 one-key DELs sent in one write (the same untimed MSET before each)
It prints milliseconds per command and SSD commits per command (kvtier_ssd_commits_total on
/metrics; for del the untimed MSETs' commits are left out). With --strace each daemon runs
under `strace -f -c -e trace=fdatasync,fsync` and the fdatasync and fsync calls per command
are printed, less those of a daemon that only started, took one SET and stopped (the same
ROUNDS, nothing else). Reports only; asserts nothing.

Usage: bench/multikey_sync.py KVTIERD [ROUNDS=20] [--strace]
"""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

KEYS, VALUE_BYTES = 64, 1024


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


def value(key, rnd):
    return (("%d:%d:" % (rnd, key)) + "v" * VALUE_BYTES)[:VALUE_BYTES]


def mset(rnd):
    args = ["MSET"]
    for k in range(KEYS):
        args += ["m%d" % k, value(k, rnd)]
    return cmd(*args)


CASES = {
    "mset": (mset, b"+OK\r\n", None),
    "pipeline": (lambda r: b"".join(cmd("SET", "p%d" % k, value(k, r)) for k in range(KEYS)),
                 b"+OK\r\n" * KEYS, None),
    "set": (lambda r: cmd("SET", "one", value(0, r)), b"+OK\r\n", None),
    "del": (lambda r: cmd("DEL", *["m%d" % k for k in range(KEYS)]), b":%d\r\n" % KEYS, mset),
    "pipedel": (lambda r: b"".join(cmd("DEL", "m%d" % k) for k in range(KEYS)), b":1\r\n" * KEYS,
                mset),
    "idle": None,
}


class Daemon:
    def __init__(self, kvtierd, strace):
        self.dir = tempfile.mkdtemp(prefix="kvtier_multikey.")
        self.port, self.http = free_port(), free_port()
        with open(os.path.join(self.dir, "kvtierd.toml"), "w") as f:
            f.write("[server]\nhttp_port = %d\n[storage]\ndram_capacity_bytes = 268435456\n"
                    "ssd_capacity_bytes = 1073741824\nssd_segment_bytes = 67108864\n"
                    "durability = \"sync\"\n" % self.http)
        argv = [kvtierd, "--config", os.path.join(self.dir, "kvtierd.toml"), "--data-dir",
                self.dir, "--socket", os.path.join(self.dir, "s.sock"), "--listen", "127.0.0.1",
                "--resp-port", str(self.port), "--http-port", str(self.http)]
        self.strace_out = os.path.join(self.dir, "strace.txt") if strace else None
        if strace:
            argv = ["strace", "-f", "-c", "-e", "trace=fdatasync,fsync", "-o",
                    self.strace_out] + argv
        self.log = open(os.path.join(self.dir, "kvtierd.log"), "w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=self.log)
        for _ in range(400):
            try:
                self.sock = socket.create_connection(("127.0.0.1", self.port))
                break
            except OSError:
                time.sleep(0.025)
        else:
            raise SystemExit("kvtierd did not listen; log in " + self.dir)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def roundtrip(self, data, want):
        self.sock.sendall(data)
        got = b""
        while len(got) < len(want):
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise SystemExit("connection closed after %r" % got[:200])
            got += chunk
        if got != want:
            raise SystemExit("unexpected reply %r" % got[:200])

    def commits(self):
        page = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % self.http).read()
        for line in page.decode().splitlines():
            if line.startswith("kvtier_ssd_commits_total "):
                return float(line.split()[1])
        return -1.0

    def stop(self):
        """Stops the daemon; returns {syscall: calls} when it ran under strace."""
        self.sock.close()
        pid = self.proc.pid
        if self.strace_out:  # kvtierd is strace's child: signal it, strace then exits
            kids = open("/proc/%d/task/%d/children" % (pid, pid)).read().split()
            pid = int(kids[0]) if kids else pid
        os.kill(pid, signal.SIGTERM)
        self.proc.wait(timeout=60)
        calls = {}
        if self.strace_out:
            for line in open(self.strace_out):
                f = line.split()
                if f and f[-1] in ("fdatasync", "fsync"):
                    calls[f[-1]] = int(f[3])  # % time, seconds, usecs/call, calls
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        return calls


def run(kvtierd, name, rounds, strace):
    d = Daemon(kvtierd, strace)
    d.roundtrip(cmd("SET", "warm", "x"), b"+OK\r\n")
    elapsed, commits = 0.0, 0.0
    if CASES[name] is not None:
        make, want, setup = CASES[name]
        for r in range(rounds):
            if setup:
                d.roundtrip(setup(r), b"+OK\r\n")
            time.sleep(0.02)  # a commit is counted after its waiters were released
            c0 = d.commits()
            t0 = time.perf_counter()
            d.roundtrip(make(r), want)
            elapsed += time.perf_counter() - t0
            time.sleep(0.02)
            commits += d.commits() - c0
    return elapsed / rounds * 1e3, commits / rounds, d.stop()


def main():
    args = [a for a in sys.argv[1:] if a != "--strace"]
    strace = "--strace" in sys.argv[1:]
    if not args:
        raise SystemExit(__doc__)
    kvtierd, rounds = args[0], int(args[1]) if len(args) > 1 else 20
    base = run(kvtierd, "idle", rounds, strace)[2] if strace else {}
    print("%d rounds per case; %d keys x %d bytes; kvtierd %s" % (rounds, KEYS, VALUE_BYTES,
                                                                  kvtierd))
    print("%-9s %10s %12s %s" % ("case", "ms/cmd", "commits/cmd",
                                 "fdatasync/cmd fsync/cmd" if strace else ""))
    for name in ("mset", "pipeline", "set", "del", "pipedel"):
        ms, commits, calls = run(kvtierd, name, rounds, strace)
        extra = ""
        if strace:
            per = [(calls.get(s, 0) - base.get(s, 0)) / rounds for s in ("fdatasync", "fsync")]
            if name == "del":
                extra = "(with the untimed MSETs) "
            extra += "%.2f %.2f" % tuple(per)
        print("%-9s %10.3f %12.2f %s" % (name, ms, commits, extra), flush=True)


if __name__ == "__main__":
    main()
