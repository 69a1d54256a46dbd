#!/usr/bin/python3
"""redis-py against a running kvtierd: what a KV-cache Redis connector (LMCache's) sends.

Usage: resp_redis_py.py --port P --http-port H --token-a A --token-b B

The daemon must run with auth on (two tenants, tokens A and B) and the small limits that
resp_clients_e2e_test.cc writes (resp_multi_commands_max = 1000, resp_multi_bytes_max =
4 MiB, resp_keys_reply_bytes_max = 65536, resp_scan_count_max = 1000). Exits 0 when every
check passes; an AssertionError (with the failing check) otherwise. Deterministic: seeded.
"""
import argparse
import os
import random
import socket
import threading
import time
import urllib.request

import redis

MULTI_COMMANDS_MAX = 1000
KEYS_REPLY_BYTES_MAX = 65536
SCAN_COUNT_MAX = 1000


class Resp:
    """A minimal RESP2/RESP3 client on a raw socket, for what redis-py 4 cannot send or read
    (RESP3 replies, hostile streams). Replies: str for +, Exception for -, int, bytes, None,
    list for * and dict for %."""

    def __init__(self, port, token=None):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.buf = b""
        if token is not None:
            assert self.call("AUTH", token) == "OK"

    @staticmethod
    def encode(*args):
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            a = a if isinstance(a, bytes) else str(a).encode()
            out.append(b"$%d\r\n%s\r\n" % (len(a), a))
        return b"".join(out)

    def send(self, *args):
        self.sock.sendall(self.encode(*args))

    def call(self, *args):
        self.send(*args)
        return self.read()

    def _line(self):
        while b"\r\n" not in self.buf:
            chunk = self.sock.recv(1 << 20)
            assert chunk, "connection closed"
            self.buf += chunk
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _exact(self, n):
        while len(self.buf) < n + 2:
            chunk = self.sock.recv(1 << 20)
            assert chunk, "connection closed"
            self.buf += chunk
        data, self.buf = self.buf[:n], self.buf[n + 2:]
        return data

    def read(self):
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            return Exception(rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"_":
            return None
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else self._exact(n)
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self.read() for _ in range(n)]
        if kind == b"%":
            return {self.read(): self.read() for _ in range(int(rest))}
        raise AssertionError("unexpected reply line %r" % line)

    def close(self):
        self.sock.close()


def is_error(reply, text):
    return isinstance(reply, Exception) and text in str(reply)


def connector(r):
    """LMCache's Redis connector: a data key and a metadata key per chunk, pipelined."""
    rng = random.Random(1234)
    chunks = 32
    keys = ["lmcache:mini-v4@1@0@%064x" % rng.getrandbits(256) for _ in range(chunks)]
    data = {k: rng.randbytes(65536 + i) for i, k in enumerate(keys)}
    meta = {k: b'{"shape":[2,16,64],"dtype":"bf16","fmt":"vllm","i":%d}' % i
            for i, k in enumerate(keys)}
    pipe = r.pipeline()  # transaction=True: MULTI ... EXEC, as redis-py does by default
    for k in keys:
        pipe.set(k + "kv_bytes", data[k])
        pipe.set(k + "metadata", meta[k])
    assert pipe.execute() == [True] * (2 * chunks)
    # Existence checks, one key and many.
    assert all(r.exists(k + "metadata") == 1 for k in keys)
    assert r.exists(*[k + "metadata" for k in keys]) == chunks
    assert r.exists(keys[0] + "kv_bytes", "lmcache:absent") == 1
    # Pipelined MGETs without a transaction, then one MGET with a missing key in it.
    pipe = r.pipeline(transaction=False)
    for k in keys:
        pipe.mget(k + "metadata", k + "kv_bytes")
    for k, (m, d) in zip(keys, pipe.execute()):
        assert m == meta[k] and d == data[k], k
    got = r.mget([keys[1] + "kv_bytes", "lmcache:absent", keys[2] + "metadata"])
    assert got == [data[keys[1]], None, meta[keys[2]]]
    # SCAN listing of the metadata keys (the connector's key listing).
    listed = set(r.scan_iter(match="lmcache:*metadata", count=7))
    assert listed == {(k + "metadata").encode() for k in keys}, len(listed)
    assert r.type(keys[0] + "kv_bytes") == b"string"
    # Removal: UNLINK and DEL, then the listing shrinks.
    assert r.unlink(keys[0] + "metadata", keys[0] + "kv_bytes", "lmcache:absent") == 2
    assert r.delete(keys[1] + "metadata") == 1
    listed = set(r.scan_iter(match="lmcache:*metadata"))
    assert len(listed) == chunks - 2
    assert r.exists(keys[0] + "kv_bytes") == 0
    assert r.type(keys[0] + "kv_bytes") == b"none"


def set_options(r, port, token):
    assert r.set("nx", "1", nx=True) is True
    assert r.set("nx", "2", nx=True) is None
    assert r.get("nx") == b"1"
    assert r.set("xx", "1", xx=True) is None
    assert r.exists("xx") == 0
    assert r.set("nx", "3", xx=True) is True and r.get("nx") == b"3"
    assert r.setnx("snx", "a") is True
    assert r.setnx("snx", "b") is False
    assert r.get("snx") == b"a"
    # GET returns the previous value; with NX it still returns it and does not write.
    assert r.set("g", "new", get=True) is None
    assert r.set("g", "newer", get=True) == b"new"
    assert r.get("g") == b"newer"
    # Expiry: PX / EX, KEEPTTL, and a plain SET clears it.
    assert r.set("px", "v", px=300) is True
    assert 0 < r.pttl("px") <= 300
    assert r.set("kt", "a", ex=100) is True
    assert r.set("kt", "b", keepttl=True) is True
    assert 90 <= r.ttl("kt") <= 100 and r.get("kt") == b"b"
    assert r.set("kt", "c") is True and r.ttl("kt") == -1
    time.sleep(0.45)
    assert r.get("px") is None and r.exists("px") == 0
    assert b"px" not in set(r.scan_iter())
    # Malformed options answer Redis's errors and leave the value alone.
    for args, text in [(("EX", "abc"), "not an integer"), (("NX", "XX"), "syntax error"),
                       (("EX", "0"), "invalid expire time"), (("PX",), "syntax error"),
                       (("EX", "1", "KEEPTTL"), "syntax error"), (("BOGUS",), "syntax error"),
                       (("EX", "9223372036854775807"), "invalid expire time")]:
        try:
            r.execute_command("SET", "nx", "bad", *args)
            raise AssertionError("SET %s accepted" % (args,))
        except redis.ResponseError as e:
            assert text in str(e), (args, e)
    assert r.get("nx") == b"3"
    # SET NX from several connections at once: exactly one writer per key.
    winners = {}
    lock = threading.Lock()

    def contend(tid):
        c = redis.Redis(port=port, password=token)
        for i in range(100):
            if c.set("race:%d" % i, str(tid), nx=True):
                with lock:
                    winners.setdefault(i, []).append(tid)

    threads = [threading.Thread(target=contend, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(winners) == list(range(100)), len(winners)
    for i, w in winners.items():
        assert len(w) == 1 and r.get("race:%d" % i) == str(w[0]).encode(), (i, w)


def transactions(r, port, token):
    pipe = r.pipeline()
    pipe.set("t1", "a").get("t1").exists("t1", "t-absent").setnx("t1", "b").get("t-absent")
    assert pipe.execute() == [True, b"a", 1, False, None]
    # A queue-time error (unknown command, wrong arity) aborts the whole transaction.
    pipe = r.pipeline()
    pipe.set("t2", "x")
    pipe.execute_command("NOSUCHCOMMAND", "a")
    try:
        pipe.execute()
        raise AssertionError("EXEC after an unknown command did not abort")
    except redis.ResponseError as e:
        assert "EXECABORT" in str(e) or "unknown command" in str(e), e
    assert r.exists("t2") == 0
    c = Resp(port, token)
    assert c.call("MULTI") == "OK"
    assert c.call("SET", "t3") is not None  # wrong arity: an error, transaction flagged
    assert c.call("SET", "t3", "v") == "QUEUED"
    assert is_error(c.call("EXEC"), "EXECABORT")
    assert c.call("EXISTS", "t3") == 0
    # Nested MULTI is an error that does not end the transaction; EXEC/DISCARD need MULTI.
    assert c.call("MULTI") == "OK"
    assert is_error(c.call("MULTI"), "can not be nested")
    assert c.call("SET", "t4", "v") == "QUEUED"
    assert c.call("EXEC") == ["OK"]
    assert is_error(c.call("EXEC"), "EXEC without MULTI")
    assert is_error(c.call("DISCARD"), "DISCARD without MULTI")
    assert c.call("MULTI") == "OK"
    assert c.call("SET", "t5", "v") == "QUEUED"
    assert c.call("DISCARD") == "OK"
    assert c.call("EXISTS", "t5") == 0
    assert c.call("MULTI") == "OK"
    assert is_error(c.call("AUTH", "x"), "not allowed inside a transaction")
    assert is_error(c.call("EXEC"), "EXECABORT")
    # Per-connection atomicity: an EXEC whose replies overflow the connection's reply buffer
    # (so it is resumed after writes) still runs before a command pipelined after it.
    big = b"b" * (1 << 20)
    assert c.call("SET", "t-big", big) == "OK"
    assert c.call("SET", "t-mark", "old") == "OK"
    stream = [c.encode("MULTI")]
    stream += [c.encode("GET", "t-big")] * 24
    stream += [c.encode("GET", "t-mark"), c.encode("EXEC"), c.encode("SET", "t-mark", "new"),
               c.encode("GET", "t-mark")]
    c.sock.sendall(b"".join(stream))
    assert c.read() == "OK"
    assert [c.read() for _ in range(25)] == ["QUEUED"] * 25
    replies = c.read()
    assert len(replies) == 25 and all(v == big for v in replies[:24])
    assert replies[24] == b"old", replies[24]
    assert c.read() == "OK" and c.read() == b"new"
    c.close()


def hello3(port, token):
    c = Resp(port)
    hello = c.call("HELLO", "3", "AUTH", "default", token)
    assert isinstance(hello, dict), hello
    assert hello[b"proto"] == 3 and hello[b"server"] == b"kvtier", hello
    c.send("GET", "h3-absent")
    line = c._line()
    assert line == b"_", line  # RESP3 null
    assert c.call("SET", "h3", "v") == "OK"
    assert c.call("MGET", "h3", "h3-absent") == [b"v", None]
    assert c.call("SET", "h3", "w", "NX") is None
    hello = c.call("HELLO", "2")
    assert isinstance(hello, list) and hello[hello.index(b"proto") + 1] == 2, hello
    c.send("GET", "h3-absent")
    assert c._line() == b"$-1"
    assert is_error(c.call("HELLO", "4"), "NOPROTO")
    c.close()


def metric(http_port, name):
    """The value of one sample (name with its labels) on /metrics."""
    text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % http_port, timeout=10).read()
    for line in text.decode().splitlines():
        sample, _, value = line.rpartition(" ")
        if sample == name:
            return float(value)
    raise AssertionError("no metric " + name)


def hostile(r, port, http_port, token):
    # A million commands after MULTI: answered, never held past the limit, EXECABORT.
    n = 1000000
    c = Resp(port, token)
    one = c.encode("SET", "hostile-multi", "v")
    payload = c.encode("MULTI") + one * n + c.encode("EXEC") + c.encode("PING")
    sender = threading.Thread(target=c.sock.sendall, args=(payload,))
    sender.start()
    tail = b"-EXECABORT Transaction discarded because of previous errors.\r\n+PONG\r\n"
    data = bytearray()
    while not data.endswith(tail):
        chunk = c.sock.recv(1 << 20)
        assert chunk, "connection closed during the MULTI flood"
        data += chunk
    sender.join()
    lines = bytes(data).split(b"\r\n")[:-1]
    assert lines[0] == b"+OK"
    assert lines[1:MULTI_COMMANDS_MAX + 1] == [b"+QUEUED"] * MULTI_COMMANDS_MAX
    assert lines[MULTI_COMMANDS_MAX + 1].startswith(b"-ERR MULTI queue over limits."
                                                    b"resp_multi_commands_max"), lines[1001]
    assert lines.count(b"+QUEUED") == n - 1
    assert len(lines) == n + 3
    c.buf = b""
    assert c.call("EXISTS", "hostile-multi") == 0
    # One queued value over resp_multi_bytes_max (4 MiB).
    assert c.call("MULTI") == "OK"
    assert is_error(c.call("SET", "hostile-big", b"x" * (6 << 20)), "resp_multi_bytes_max")
    assert is_error(c.call("EXEC"), "EXECABORT")
    assert c.call("EXISTS", "hostile-big") == 0
    c.close()
    assert metric(http_port, 'kvtier_connection_limit_refusals_total{reason="resp_multi"}') >= 2
    # KEYS over many keys: bounded reply, a clear error; SCAN still lists them all.
    pipe = r.pipeline(transaction=False)
    for i in range(5000):
        pipe.set("many:%05d" % i, "v")
    pipe.execute()
    try:
        r.keys("*")
        raise AssertionError("KEYS * over resp_keys_reply_bytes_max answered")
    except redis.ResponseError as e:
        assert "resp_keys_reply_bytes_max" in str(e) and "SCAN" in str(e), e
    assert metric(http_port, 'kvtier_connection_limit_refusals_total{reason="resp_keys"}') >= 1
    assert sorted(r.keys("many:004[0-4]?")) == [b"many:%05d" % i for i in range(400, 450)]
    assert r.keys("many:\\*") == []
    assert len(set(r.scan_iter(match="many:*"))) == 5000
    # Absurd and malformed SCAN arguments.
    cursor, names = r.scan(0, count=10 ** 15)
    assert cursor != 0 and SCAN_COUNT_MAX - 50 <= len(names) <= SCAN_COUNT_MAX + 8, len(names)
    for args, text in [((0, "COUNT", 0), "syntax error"), ((0, "COUNT", -1), "syntax error"),
                       (("abc",), "invalid cursor"), ((0, "COUNT", "x"), "not an integer"),
                       ((0, "MATCH"), "syntax error"), (("-1",), "invalid cursor")]:
        try:
            r.execute_command("SCAN", *args)
            raise AssertionError("SCAN %s accepted" % (args,))
        except redis.ResponseError as e:
            assert text in str(e), (args, e)
    assert r.scan(0, _type="hash") == (r.scan(0)[0], [])
    assert r.ping() is True


def tenants(port, token_a, token_b):
    a = redis.Redis(port=port, password=token_a)
    b = redis.Redis(port=port, password=token_b)
    assert b.set("shared-name", "b-value") is True
    assert b.set("only-b", "1") is True
    assert a.get("shared-name") != b"b-value"
    assert a.exists("only-b") == 0
    assert b"only-b" not in set(a.scan_iter()) and a.keys("only-*") == []
    assert set(b.scan_iter()) == {b"shared-name", b"only-b"}
    assert b.dbsize() == 2
    assert a.set("only-b", "a", nx=True) is True  # a's own key of that name
    assert b.get("only-b") == b"1"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--http-port", type=int, required=True)
    ap.add_argument("--token-a", required=True)
    ap.add_argument("--token-b", required=True)
    ap.add_argument("--sections", default=os.environ.get("KVTIER_RESP_PY_SECTIONS", ""),
                    help="comma-separated subset to run (default all; env KVTIER_RESP_PY_SECTIONS)")
    args = ap.parse_args()
    only = set(filter(None, args.sections.split(",")))
    r = redis.Redis(host="127.0.0.1", port=args.port, password=args.token_a)
    for name, fn in [("connector", lambda: connector(r)),
                     ("set_options", lambda: set_options(r, args.port, args.token_a)),
                     ("transactions", lambda: transactions(r, args.port, args.token_a)),
                     ("hello3", lambda: hello3(args.port, args.token_a)),
                     ("hostile", lambda: hostile(r, args.port, args.http_port, args.token_a)),
                     ("tenants", lambda: tenants(args.port, args.token_a, args.token_b))]:
        if only and name not in only:
            continue
        t0 = time.monotonic()
        fn()
        print("PASS %s (%.2f s)" % (name, time.monotonic() - t0), flush=True)


if __name__ == "__main__":
    main()
