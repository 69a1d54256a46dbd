#!/usr/bin/python3
"""The dashboard page in headless Chromium against a running kvtierd under a small load.

Usage: dashboard_browser_test.py KVTIERD_BINARY OUTPUT_DIR

Starts kvtierd with auth on (an admin and a non-admin tenant), a trace and a short what-if
interval; drives RESP SET/GET traffic from a thread; opens http://127.0.0.1:PORT/ in Chromium
(Debian's chromium + chromium-driver, python3-selenium) and checks that:
  * every time chart receives rows (the data-points attribute the page keeps per chart),
  * the what-if chart receives curves from GET /v1/whatif,
  * the per-tenant chart stays empty without a token and fills with the admin token,
  * the policy switch is refused without a token (401) and with a non-admin token (403),
    shown on the page, GET /v1/policy unchanged; and works with the admin token,
  * the cluster panel reads GET /v1/cluster and says this single node is not clustered,
  * a screenshot is written to OUTPUT_DIR/dashboard.png;
then, against a second kvtierd with auth off (every request is the admin tenant), that a page
on another site cannot switch the policy with a no-cors POST (text/plain, no preflight), that
a page whose host name resolves to 127.0.0.1 (DNS rebinding: Chromium's --host-resolver-rules)
cannot read /v1/stats or load the dashboard, and that the dashboard opened at 127.0.0.1 works
there and switches the policy (docs/CONFIG.md, "The HTTP admin front and browsers").
Prints how long each phase took (to see where the time goes on a loaded machine).
Exits 0 on success; prints what failed otherwise. Every wait is bounded.
"""

import functools
import hashlib
import http.server
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
import urllib.request

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

ADMIN_TOKEN = "dashboard-admin-token"
USER_TOKEN = "dashboard-user-token"
WAIT_S = 30  # the longest any one condition is waited for


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sha256(text):
    return hashlib.sha256(text.encode()).hexdigest()


def resp_command(sock, *args):
    """Sends one RESP command and reads one reply line (enough for OK/errors/bulk headers)."""
    out = b"*%d\r\n" % len(args)
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out += b"$%d\r\n%s\r\n" % (len(a), a)
    sock.sendall(out)
    reply = b""
    while not reply.endswith(b"\r\n"):
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("kvtierd closed the RESP connection")
        reply += chunk
    if reply.startswith(b"$") and not reply.startswith(b"$-1"):
        size = int(reply[1:reply.index(b"\r\n")])
        need = reply.index(b"\r\n") + 2 + size + 2
        while len(reply) < need:
            reply += sock.recv(65536)
    return reply


def load(resp_port, stop):
    """Small deterministic RESP load: SETs of 64 keys, GETs of 96 (a third never stored)."""
    with socket.create_connection(("127.0.0.1", resp_port), timeout=10) as s:
        assert resp_command(s, "AUTH", USER_TOKEN).startswith(b"+OK"), "RESP AUTH failed"
        i = 0
        while not stop.is_set():
            resp_command(s, "SET", "k%d" % (i % 64), b"v" * 4096)
            resp_command(s, "GET", "k%d" % ((i * 7) % 96))
            i += 1
            time.sleep(0.005)


def http_json(port, path, token=None):
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path))
    if token:
        req.add_header("Authorization", "Bearer " + token)
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


T0 = time.monotonic()


def phase(name):
    print("dashboard_browser_test: %6.1f s  %s" % (time.monotonic() - T0, name), flush=True)


def wait_for(what, cond):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("timed out after %d s waiting for: %s" % (WAIT_S, what))


def stop_daemon(daemon, log):
    """SIGTERM (a drain), SIGKILL after 30 s; then closes its log."""
    daemon.send_signal(signal.SIGTERM)
    try:
        daemon.wait(timeout=30)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait()
    log.close()


def main():
    kvtierd, out_dir = sys.argv[1], sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="kvtier_dashboard_")
    http_port, resp_port = free_port(), free_port()
    with open(os.path.join(work, "tokens.toml"), "w") as f:
        f.write('[[tenant]]\nname = "ops"\nid = 1\ntoken_sha256 = ["%s"]\nadmin = true\n\n'
                '[[tenant]]\nname = "agents"\nid = 2\ntoken_sha256 = ["%s"]\n'
                % (sha256(ADMIN_TOKEN), sha256(USER_TOKEN)))
    with open(os.path.join(work, "kvtierd.toml"), "w") as f:
        f.write('[storage]\ndram_capacity_bytes = 262144\n\n'
                '[trace]\nwhatif_interval_ms = 500\n')
    log = open(os.path.join(out_dir, "kvtierd.log"), "w")
    daemon = subprocess.Popen(
        [kvtierd, "--config", os.path.join(work, "kvtierd.toml"), "--data-dir",
         os.path.join(work, "data"), "--socket", "off", "--http-port", str(http_port),
         "--resp-port", str(resp_port), "--tokens-file", os.path.join(work, "tokens.toml"),
         "--trace", os.path.join(work, "trace.jsonl.zst")],
        stdout=log, stderr=subprocess.STDOUT)
    stop = threading.Event()
    loader = None
    driver = None
    try:
        wait_for("kvtierd /healthz", lambda: _healthy(http_port))
        loader = threading.Thread(target=load, args=(resp_port, stop), daemon=True)
        loader.start()

        opts = webdriver.ChromeOptions()
        opts.binary_location = "/usr/bin/chromium"
        for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--window-size=1400,1400", "--user-data-dir=" + os.path.join(work, "chrome"),
                  "--host-resolver-rules=MAP rebound.test 127.0.0.1"):
            opts.add_argument(a)
        phase("kvtierd up")
        driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
        phase("chromium up")
        driver.get("http://127.0.0.1:%d/" % http_port)
        js = driver.execute_script
        points = lambda chart: js("return window.kvtierDashboard.points(arguments[0])", chart)

        assert js("return typeof Dygraph") == "function", "the plotting library did not load"
        for chart, n in (("chart-occupancy", 3), ("chart-hits", 2), ("chart-misses", 2),
                         ("chart-ssd", 2)):
            wait_for("%s >= %d points" % (chart, n), lambda: points(chart) >= n)
        wait_for("what-if curves", lambda: points("chart-whatif") > 0)
        curves = int(driver.find_element(By.ID, "chart-whatif").get_attribute("data-curves"))
        assert curves >= 2, "what-if chart has %d curves" % curves
        assert points("chart-tenants") == 0, "tenant series shown without a token"
        assert "admin token" in driver.find_element(By.ID, "tenants-note").text
        cluster = wait_for("cluster panel polled",
                           lambda: js("return window.kvtierDashboard.cluster"))
        assert cluster == {"clustered": False}, cluster
        assert "single node" in driver.find_element(By.ID, "cluster-note").text
        assert http_json(http_port, "/v1/cluster") == {"clustered": False}
        phase("charts, what-if and cluster panel filled")

        msg = driver.find_element(By.ID, "policy-msg")

        def switch(eviction):
            js("document.getElementById('policy-msg').textContent = ''")
            Select(driver.find_element(By.ID, "policy-eviction")).select_by_visible_text(eviction)
            driver.find_element(By.ID, "policy-submit").click()
            return wait_for("policy message", lambda: msg.text)

        def use_token(token):
            field = driver.find_element(By.ID, "token")
            field.clear()
            field.send_keys(token)
            driver.find_element(By.CSS_SELECTOR, "#token-form button[type=submit]").click()

        before = http_json(http_port, "/v1/policy")["eviction"]
        assert before == "lru", before
        text = switch("fifo")
        assert "refused (401)" in text, text
        assert http_json(http_port, "/v1/policy")["eviction"] == "lru"

        use_token(USER_TOKEN)
        text = switch("fifo")
        assert "refused (403)" in text, text
        assert http_json(http_port, "/v1/policy")["eviction"] == "lru"

        use_token(ADMIN_TOKEN)
        text = switch("sieve")
        assert text.startswith("switched"), text
        assert http_json(http_port, "/v1/policy")["eviction"] == "sieve"
        wait_for("policy shown", lambda: driver.find_element(By.ID, "policy-now-eviction").text
                 == "sieve")
        wait_for("per-tenant usage with the admin token", lambda: points("chart-tenants") >= 2)
        wait_for("what-if marks the live policy",
                 lambda: "sieve" in driver.find_element(By.ID, "whatif-note").text)

        phase("policy switch and tenant chart checked")
        js("window.scrollTo(0, 0)")
        shot = os.path.join(out_dir, "dashboard.png")
        driver.save_screenshot(shot)
        assert os.path.getsize(shot) > 10000, "screenshot too small"
        phase("screenshot written")
        check_cross_site(driver, kvtierd, work, out_dir)
        phase("cross-site and rebinding requests refused (auth off)")
        print("dashboard_browser_test: ok; screenshot %s" % shot)
        return 0
    except AssertionError as e:
        if driver is not None:
            driver.save_screenshot(os.path.join(out_dir, "dashboard-failure.png"))
        print("dashboard_browser_test: FAILED: %s" % e)
        return 1
    finally:
        stop.set()
        if loader is not None:
            loader.join(timeout=10)
        if driver is not None:
            driver.quit()
        stop_daemon(daemon, log)
        shutil.rmtree(work, ignore_errors=True)


ATTACK_PAGE = """<!doctype html><title>attack</title><script>
fetch("http://127.0.0.1:%d/v1/policy",
      {method: "POST", mode: "no-cors", body: '{"eviction":"fifo"}'})
  .then(() => { document.title = "sent"; }, (e) => { document.title = "error " + e; });
</script>"""


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def check_cross_site(driver, kvtierd, work, out_dir):
    """The browser protections against an auth-off kvtierd, in the same Chromium."""
    http_port = free_port()
    pages = os.path.join(work, "attacker")
    os.makedirs(pages)
    with open(os.path.join(pages, "attack.html"), "w") as f:
        f.write(ATTACK_PAGE % http_port)
    attacker = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(QuietHandler, directory=pages))
    threading.Thread(target=attacker.serve_forever, daemon=True).start()
    log = open(os.path.join(out_dir, "kvtierd-auth-off.log"), "w")
    daemon = subprocess.Popen(
        [kvtierd, "--data-dir", os.path.join(work, "data-auth-off"), "--socket", "off",
         "--http-port", str(http_port), "--resp-port", "0"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for("auth-off kvtierd /healthz", lambda: _healthy(http_port))
        assert http_json(http_port, "/v1/policy")["eviction"] == "lru"
        # Another site (localhost is not the same site as 127.0.0.1): the POST is sent (the
        # browser does not stop a no-cors request), kvtierd must refuse it.
        driver.get("http://localhost:%d/attack.html" % attacker.server_address[1])
        wait_for("the attack page's POST", lambda: driver.title != "attack")
        assert driver.title == "sent", driver.title
        assert http_json(http_port, "/v1/policy")["eviction"] == "lru", "a cross-site POST " \
            "switched the policy"
        # DNS rebinding: rebound.test resolves to 127.0.0.1, the page is same-origin with it.
        for path in ("/v1/stats", "/metrics", "/"):
            driver.get("http://rebound.test:%d%s" % (http_port, path))
            text = driver.find_element(By.TAG_NAME, "body").text
            assert "Host header" in text and "tiers" not in text and "kvtier_" not in text, \
                "rebound page read %s: %s" % (path, text[:200])
        # The dashboard itself, from 127.0.0.1: its policy form switches (same origin, JSON).
        driver.get("http://127.0.0.1:%d/" % http_port)
        Select(driver.find_element(By.ID, "policy-eviction")).select_by_visible_text("fifo")
        driver.find_element(By.ID, "policy-submit").click()
        wait_for("the dashboard's own switch",
                 lambda: http_json(http_port, "/v1/policy")["eviction"] == "fifo")
    finally:
        attacker.shutdown()
        stop_daemon(daemon, log)


def _healthy(port):
    try:
        with urllib.request.urlopen("http://127.0.0.1:%d/healthz" % port, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
