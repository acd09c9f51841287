"""A `lily serve` process for the client-side measurements (serve_ttft.py,
serve_agent.py): started on a free loopback port, waited for until /health
answers, stopped at the end; and the streamed events of one request to it."""
import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@contextlib.contextmanager
def lily_serve(lily: str, args: list, timeout_s: float = 300):
    """`lily serve --port P ARGS...` (a bare `--` in ARGS is dropped); yields P once healthy."""
    port = free_port()
    args = [x for x in args if x != "--"]
    proc = subprocess.Popen([lily, "serve", "--port", str(port), *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + timeout_s
        while True:
            if proc.poll() is not None:
                sys.exit(f"lily serve exited: {proc.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                sys.exit(f"lily serve did not become healthy in {timeout_s:.0f} s")
            time.sleep(1)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def stream(port: int, path: str, body: dict, timeout_s: float = 900):
    """POST `body` (a streaming request) to `path`; yields (seconds since the request, event) for
    each server-sent event but the final [DONE]."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            yield time.perf_counter() - t0, json.loads(line[5:])
