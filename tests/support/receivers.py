"""Webhook receivers for tests: HTTP servers on a loopback address and an ephemeral
port, in a thread of the test process, each recording what reached it.

``Receiver(mode)``: ``ok`` answers 204; ``status:<code>`` answers that code; ``hang``
reads the request and never answers; ``drip`` answers one header byte every
``drip_s``; ``redirect:<url>`` answers 302 to that URL; ``big`` answers 200 with a
10 MB body; ``fail:<n>`` answers 500 to the first n requests, then 204.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Hit:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float  # time.time() when the body was read


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self._handle()

    def do_GET(self) -> None:  # noqa: N802
        self._handle()

    def _handle(self) -> None:
        receiver: Receiver = self.server.receiver  # type: ignore[attr-defined]
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        hit = Hit(self.path, {k.lower(): v for k, v in self.headers.items()}, body, time.time())
        with receiver.lock:
            receiver.hits.append(hit)
            count = len(receiver.hits)
        mode, _, arg = receiver.mode.partition(":")
        if mode == "hang":
            receiver.release.wait(600)
            return
        if mode == "drip":
            for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"x" * 1000:
                if receiver.release.wait(receiver.drip_s):
                    return
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
            return
        if mode == "fail" and count <= int(arg):
            return self._answer(500)
        if mode == "status":
            return self._answer(int(arg))
        if mode == "redirect":
            return self._answer(302, {"Location": arg})
        if mode == "big":
            return self._answer(200, body=b"x" * (10 << 20))
        self._answer(204)

    def _answer(self, code: int, headers: dict | None = None, body: bytes = b"") -> None:
        self.send_response(code)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(OSError):  # the client stopped reading (a size cap)
            self.wfile.write(body)


class Receiver:
    """One receiver; ``url`` to send to, ``hits`` what arrived; ``close()`` ends it."""

    def __init__(self, mode: str = "ok", host: str = "127.0.0.1", drip_s: float = 0.3):
        self.mode, self.drip_s = mode, drip_s
        self.hits: list[Hit] = []
        self.lock = threading.Lock()
        self.release = threading.Event()
        self.server = ThreadingHTTPServer((host, 0), _Handler)
        self.server.daemon_threads = True
        self.server.receiver = self  # type: ignore[attr-defined]
        self.host, self.port = host, self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/hook"

    def wait_for(self, count: int, timeout: float) -> list[Hit]:
        deadline = time.monotonic() + timeout
        while len(self.hits) < count and time.monotonic() < deadline:
            time.sleep(0.02)
        return list(self.hits)

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
