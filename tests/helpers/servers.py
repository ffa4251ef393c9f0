"""Real servers on loopback for the remote-shard tests: an HTTP server honouring single byte ranges
(with injected latency, failing and denied requests), and moto's S3 server."""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

from tokenbal.index import RemoteOptions

# Retries without the production back-off, so the injected failures cost milliseconds.
FAST = RemoteOptions(backoff_s=0.01)

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


class RangeHandler(SimpleHTTPRequestHandler):
    """Static files with single byte-range support (RFC 9110 206 / 416) and a request log, plus a
    delay per request and a list of request numbers answered 503 (``fail_at``) or, for reads of
    paths ending in one of ``deny``, 403 (both set on the server by ``serve``)."""

    def log_message(self, *args):   # keep the test output quiet
        pass

    def do_HEAD(self):
        if self._injected(self._count()):
            return
        super().do_HEAD()

    def do_GET(self):
        if self._injected(self._count()):
            return
        self.server.requests.append((self.path, self.headers.get("Range")))
        path = self.translate_path(self.path)
        if not os.path.isfile(path):
            self.send_error(404, "not found")
            return
        size = os.path.getsize(path)
        rng = self.headers.get("Range")
        m = _RANGE.match(rng) if rng and self.server.honour_range else None
        with open(path, "rb") as f:
            if m is None:
                self.send_response(200)
                start, end = 0, size
            else:
                start = int(m.group(1))
                end = min(size, int(m.group(2)) + 1) if m.group(2) else size
                if start >= size:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
            f.seek(start)
            body = f.read(end - start)
        self.send_header("Content-Type", "application/x-tar")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        self.wfile.write(body)

    def _count(self) -> int:
        with self.server.lock:
            self.server.n += 1
            n = self.server.n
        if self.server.latency:
            time.sleep(self.server.latency)
        return n

    def _injected(self, n: int) -> bool:
        fail_if = self.server.fail_if
        if n in self.server.fail_at or (fail_if is not None and self.command == "GET"
                                        and fail_if(self.path, self.headers.get("Range"))):
            self.server.failed += 1
            self.send_error(503, "injected failure")
            return True
        # Denied for reads only (HEAD answers): the scan, not the source listing, meets it.
        if self.command == "GET" and any(self.path.endswith(d) for d in self.server.deny):
            self.send_error(403, "denied")
            return True
        return False


@contextmanager
def serve(root: str, *, latency: float = 0.0, fail_at=(), deny=(), honour_range: bool = True,
          handler: type[RangeHandler] = RangeHandler,
          fail_if=None) -> Iterator[tuple[str, ThreadingHTTPServer]]:
    """An HTTP server for ``root`` on 127.0.0.1 (a free port), in a thread; yields its base URL and
    the server (``requests``: the GETs' paths and Range headers, ``n``: requests counted,
    ``failed``: injected 503s). ``fail_if(path, range_header)``: GETs it is true for are answered
    503 (settable later as ``server.fail_if``; None: none)."""
    make = lambda *a, **kw: handler(*a, directory=root, **kw)  # noqa: E731
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), make)
    httpd.daemon_threads = True
    httpd.requests, httpd.honour_range = [], honour_range
    httpd.lock, httpd.n, httpd.failed = threading.Lock(), 0, 0
    httpd.latency, httpd.fail_at, httpd.deny = latency, set(fail_at), tuple(deny)
    httpd.fail_if = fail_if
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", httpd
    finally:
        httpd.shutdown()
        httpd.server_close()
        t.join(10)


@contextmanager
def moto_s3(monkeypatch, bucket: str = "corpus"):
    """moto's S3 server on a free loopback port with one empty ``bucket``; yields (endpoint, client).
    Skips when s3fs or moto's server is not installed."""
    import pytest

    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    import boto3
    from moto.server import ThreadedMotoServer

    from tokenbal.launch import free_port

    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1", "AWS_SESSION_TOKEN": "testing"}.items():
        monkeypatch.setenv(k, v)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        client.create_bucket(Bucket=bucket)
        yield endpoint, client
    finally:
        server.stop()


@contextmanager
def stalled_server(answer_head: bool = False) -> Iterator[tuple[str, threading.Event]]:
    """A loopback TCP server that accepts every connection and never answers (a store that hangs);
    with ``answer_head``, HEAD requests are answered (a 4 MiB object) and only GETs hang. Yields its
    base URL and an event that releases the hung connections (set on exit)."""
    import socket

    release = threading.Event()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    conns: list = []

    def handle(conn) -> None:
        with conn:
            conn.settimeout(30)
            try:
                head = conn.recv(65536)
            except OSError:
                return
            if answer_head and head.startswith(b"HEAD "):
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 4194304\r\nAccept-Ranges: bytes\r\n"
                             b"Content-Type: application/x-tar\r\nConnection: close\r\n\r\n")
                return
            release.wait()

    sock.settimeout(0.1)   # accept() wakes up to see the release (closing a socket does not wake it)

    def accept() -> None:
        while not release.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conns.append(conn)
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", release
    finally:
        release.set()
        t.join(10)
        sock.close()
