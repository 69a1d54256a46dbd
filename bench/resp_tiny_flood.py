#!/usr/bin/env python3
"""RESP flood of tiny values: SET key:<i> to a value of SIZE bytes for i in [START, START+N),
pipelined 2,000 at a time, against a running kvtierd's RESP port. Prints how many were
acknowledged; read the daemon's VmRSS (/proc/<pid>/status) and /metrics around it. The
per-object memory figures of docs/CONFIG.md (storage.*_objects_max) came from
`bench/resp_tiny_flood.py PORT 1000000 16` against kvtierd with a 64 MiB DRAM and a 1 GiB SSD
tier. Reports only; asserts nothing.

Usage: bench/resp_tiny_flood.py PORT N SIZE [START=0]
"""
import socket
import sys
import time


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    port, n, size = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    start = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    sock = socket.create_connection(("127.0.0.1", port))
    replies = sock.makefile("rb")
    value = b"v" * size
    batch = 2000
    began = time.time()
    ok = err = 0
    for base in range(start, start + n, batch):
        out = []
        for i in range(base, min(base + batch, start + n)):
            key = b"key:%010d" % i
            out.append(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(key), key, size, value))
        sock.sendall(b"".join(out))
        for _ in out:
            line = replies.readline()
            if line.startswith(b"+OK"):
                ok += 1
            else:
                err += 1
                if err < 3:
                    print(line)
    print("ok", ok, "err", err, "%.1fs" % (time.time() - began))


if __name__ == "__main__":
    main()
