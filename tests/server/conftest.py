"""Client tests of `lily serve --synthetic tiny`.

Each server is started by the tests themselves, on a free loopback port
(`--port 0`; the port taken is read from the server's stderr), and stopped with
SIGTERM at the end, which must exit cleanly. The binary is
`target/release/lily`, or $LILY_BIN.

The tiny synthetic model has random weights, so its text is gibberish. Tests
that need a given output (reasoning, tool calls, stop strings) use the server's
test-only hook: started with the hidden flag `--test-hooks`, it honours the
request field `lily_test_script` (the output is forced to that text, token by
token, then an end-of-sequence token; the model still runs every step) and
`lily_test_delay_ms` (a pause before each step: a slow model).
"""

import http.client
import json
import os
import pathlib
import re
import signal
import subprocess
import threading
import time

import openai
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("LILY_BIN", str(ROOT / "target" / "release" / "lily"))
API_KEY = "sk-lily-test-0123456789"
MODEL = "synthetic-tiny"


class Server:
    """A `lily serve` process on a free loopback port."""

    def __init__(self, *args, api_key=API_KEY, start_timeout=120):
        cmd = [BIN, "serve", "--synthetic", "tiny", "--host", "127.0.0.1", "--port", "0", "--test-hooks", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.api_key = api_key
        self.log = []
        self._ready = threading.Event()
        self.port = None
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()
        deadline = time.time() + start_timeout
        while not self._ready.wait(0.1):
            if self.proc.poll() is not None or time.time() > deadline:
                self.kill()
                raise RuntimeError("lily serve did not start:\n" + "".join(self.log))

    def _read_stderr(self):
        for line in self.proc.stderr:
            self.log.append(line)
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                self._ready.set()

    @property
    def base(self):
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kw):
        kw.setdefault("max_retries", 0)
        kw.setdefault("timeout", 120)
        kw.setdefault("api_key", self.api_key or "none")
        return openai.OpenAI(base_url=self.base + "/v1", **kw)

    def request(self, method, path, body=None, headers=None, auth=True, timeout=120):
        """Raw HTTP: returns (status, headers dict (lower-case names), body bytes)."""
        h = {}
        if auth and self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        if body is not None and not isinstance(body, (bytes, str)):
            body = json.dumps(body)
            h["Content-Type"] = "application/json"
        h.update(headers or {})
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            c.request(method, path, body=body, headers=h)
            r = c.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            c.close()

    def post(self, path, body, **kw):
        return self.request("POST", path, body, **kw)

    def metrics(self):
        """Samples of /metrics: {'name{labels}': value}."""
        status, _, body = self.request("GET", "/metrics", auth=False)
        assert status == 200
        out = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out

    def finished(self):
        """lily_requests_finished_total by finish reason."""
        m = self.metrics()
        return {re.search(r'finish_reason="(\w+)"', k).group(1): v for k, v in m.items() if k.startswith("lily_requests_finished_total{")}

    def wait_idle(self, timeout=60):
        """Until nothing runs or waits in the engine."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            m = self.metrics()
            if m["lily_requests_running"] == 0 and m["lily_queue_depth"] == 0:
                return m
            time.sleep(0.05)
        raise AssertionError(f"server not idle after {timeout}s: {self.metrics()}")

    def wait_for(self, pred, timeout=30, what="condition"):
        deadline = time.time() + timeout
        while time.time() < deadline:
            m = self.metrics()
            if pred(m):
                return m
            time.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what}: {self.metrics()}")

    def rss_mb(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    def stop(self, timeout=30):
        """SIGTERM; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError("lily serve did not exit after SIGTERM:\n" + "".join(self.log))
        self._reader.join(5)
        return self.proc.returncode

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="session")
def server():
    s = Server("--max-seq", "1024")
    yield s
    assert s.stop() == 0, "".join(s.log)
    assert "panicked" not in "".join(s.log), "".join(s.log)


@pytest.fixture(scope="session")
def client(server):
    return server.client()


def sse_events(raw: bytes):
    """Splits an SSE body into events: lists of (field, value) lines."""
    text = raw.decode()
    assert "\r" not in text
    events = []
    for block in text.split("\n\n"):
        if not block:
            continue
        lines = []
        for line in block.split("\n"):
            field, _, value = line.partition(":")
            lines.append((field, value[1:] if value.startswith(" ") else value))
        events.append(lines)
    return events


def error_shape(body: bytes):
    """Asserts OpenAI's error shape; returns the error object."""
    j = json.loads(body)
    assert set(j) == {"error"}, j
    e = j["error"]
    assert set(e) == {"message", "type", "param", "code"}, e
    assert isinstance(e["message"], str) and e["message"]
    assert isinstance(e["type"], str)
    return e
