"""A `lily serve` process for the client-side measurements (serve_ttft.py,
serve_agent.py): started on a free loopback port, waited for until /health
answers, stopped at the end."""
import contextlib
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
