"""uvicorn, with a shutdown that ends the job-events streams first, a deadline for a
request's headers, and a cap on one client's connections.

uvicorn has neither of the last two: a connection that sends its headers a byte at a
time (slowloris) is held for as long as it likes, and one address may open every
connection the process can hold. ``GuardedH11Protocol`` (uvicorn's h11 protocol, the
one it runs without httptools) closes a connection whose request headers are not
complete ``header_timeout_s`` after it opened or after its previous answer (a 408
first), and answers a connection past ``max_per_client`` from one address with 429
and closes it. Behind a proxy every connection comes from the proxy: give
``--max-connections-per-client 0`` there, and let the proxy limit its clients.
"""

from __future__ import annotations

import asyncio

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

GRACE_S = 5  # open OpenAI streams get this long to finish after SIGTERM
HEADER_TIMEOUT_S = 10.0
MAX_PER_CLIENT = 256


class GatewayServer(uvicorn.Server):
    """On SIGTERM or SIGINT, first end every job-events stream cleanly (an EventSource
    reconnects, with Last-Event-ID, to another gateway), then uvicorn's own shutdown:
    no new connections, open requests get ``GRACE_S`` seconds."""

    def handle_exit(self, sig, frame) -> None:
        begin = getattr(self.config.app.state, "begin_shutdown", None)
        if begin is not None:
            begin()
        super().handle_exit(sig, frame)


def _raw_answer(status: str, message: str) -> bytes:
    body = b'{"error": {"message": "%s", "type": "%s", "param": null, "code": null}}' % (
        message.encode(),
        b"rate_limit_error" if status.startswith("429") else b"invalid_request_error",
    )
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nConnection: close\r\n"
    head += f"Retry-After: 1\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a per-client connection cap
    (``configured`` makes a subclass with the two settings)."""

    header_timeout_s: float = HEADER_TIMEOUT_S
    max_per_client: int = MAX_PER_CLIENT  # 0: no cap

    @classmethod
    def configured(cls, header_timeout_s: float, max_per_client: int) -> type:
        settings = {"header_timeout_s": header_timeout_s, "max_per_client": max_per_client}
        return type("GuardedH11", (cls,), settings)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._counted = False
        counts = self._counts()
        host = self.client[0] if self.client else None
        if self.max_per_client and host is not None:
            if counts.get(host, 0) >= self.max_per_client:
                message = f"over {self.max_per_client} connections from one client"
                transport.write(_raw_answer("429 Too Many Requests", message))
                transport.close()
                return
            counts[host] = counts.get(host, 0) + 1
            self._counted = True
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        if getattr(self, "_counted", False):
            counts, host = self._counts(), self.client[0]
            counts[host] -= 1
            if counts[host] <= 0:
                del counts[host]
            self._counted = False
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers are in
            self._disarm()

    def on_response_complete(self) -> None:
        self._arm()  # the next request's headers have as long (keep-alive)
        super().on_response_complete()

    def _counts(self) -> dict[str, int]:
        """Connections by client address, shared by the server's protocols."""
        counts = getattr(self.server_state, "lorapool_per_client", None)
        if counts is None:
            counts = self.server_state.lorapool_per_client = {}
        return counts

    def _arm(self) -> None:
        self._disarm()
        if self.header_timeout_s and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _too_slow(self) -> None:
        self._header_timer = None
        busy = self.cycle is not None and not self.cycle.response_complete
        if busy or self.transport.is_closing():
            return
        message = f"the request headers did not arrive within {self.header_timeout_s:g}s"
        self.transport.write(_raw_answer("408 Request Timeout", message))
        self.transport.close()


def run(
    app: FastAPI,
    host: str,
    port: int,
    log_level: str = "info",
    header_timeout_s: float = HEADER_TIMEOUT_S,
    max_per_client: int = MAX_PER_CLIENT,
    trust_proxy: bool = False,
    tls: tuple[str, str] | None = None,
) -> None:
    """Serve ``app``; X-Forwarded-* headers are believed only with ``trust_proxy`` (from
    any address: every connection comes through the proxy), never by default (uvicorn
    would from 127.0.0.1, where anyone on the machine could claim any client address);
    ``tls``: (certificate file, key file)."""
    protocol = GuardedH11Protocol.configured(header_timeout_s, max_per_client)
    certfile, keyfile = tls or (None, None)
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=GRACE_S,
        http=protocol, proxy_headers=trust_proxy, forwarded_allow_ips="*" if trust_proxy else "",
        ssl_certfile=certfile, ssl_keyfile=keyfile,
    )  # fmt: skip
    GatewayServer(config).run()
