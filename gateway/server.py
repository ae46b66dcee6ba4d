"""uvicorn, with a shutdown that ends the job-events streams first, deadlines for a
request's headers and its body, and caps on one client's connections and on all.

uvicorn has none of those: a connection that sends its headers or its body a byte at
a time (slowloris; issue 51 row 7: 800 bodies sent a byte every 2 s all still open
after 40 s) is held for as long as it likes, and one address may open every
connection the process can hold. ``GuardedH11Protocol`` (uvicorn's h11 protocol; the
gateway always passes it as ``http=``, whatever else is installed, so these hold
however ``lorapool serve`` is started: compose.yaml and deploy/ run it so):

- closes a connection whose request headers are not complete ``header_timeout_s``
  after it opened or after its previous answer (a 408 first);
- closes a connection whose request body is not complete ``body_timeout_s`` after its
  headers, extended by a second for every ``body_min_rate`` bytes received (Apache
  mod_reqtimeout's ``body=20,MinRate=500`` shape and defaults: a large body sent at a
  fair rate is never cut; a drip is, within ``body_timeout_s``), 408 first when no
  answer has begun;
- answers a connection past ``max_per_client`` from one address with 429, and one
  past ``max_connections`` in all with 503, and closes it.

Behind a proxy every connection comes from the proxy: give
``--max-connections-per-client 0`` there, and let the proxy limit its clients.
"""

from __future__ import annotations

import asyncio

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from lorapool import heap

GRACE_S = 5  # open OpenAI streams get this long to finish after SIGTERM
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 20.0  # Apache mod_reqtimeout's default body=20,MinRate=500
BODY_MIN_RATE = 500  # bytes a second
MAX_PER_CLIENT = 256
MAX_CONNECTIONS = 4096


class GatewayServer(uvicorn.Server):
    """On SIGTERM or SIGINT, first end every job-events stream cleanly (an EventSource
    reconnects, with Last-Event-ID, to another gateway), then uvicorn's own shutdown:
    no new connections, open requests get ``GRACE_S`` seconds."""

    async def startup(self, sockets=None) -> None:
        """uvicorn's startup (the app's lifespan, the sockets), then what is alive frozen
        out of the collector's full collections (``lorapool/heap.py``)."""
        await super().startup(sockets=sockets)
        if self.started:
            self._collector = heap.quiet()

    async def shutdown(self, sockets=None) -> None:
        await super().shutdown(sockets=sockets)
        saved = getattr(self, "_collector", None)
        if saved is not None:
            self._collector = None
            heap.restore(saved)

    def handle_exit(self, sig, frame) -> None:
        begin = getattr(self.config.app.state, "begin_shutdown", None)
        if begin is not None:
            begin()
        super().handle_exit(sig, frame)


_TYPES = {"429": b"rate_limit_error", "503": b"service_unavailable"}


def _raw_answer(status: str, message: str) -> bytes:
    body = b'{"error": {"message": "%s", "type": "%s", "param": null, "code": null}}' % (
        message.encode(),
        _TYPES.get(status[:3], b"invalid_request_error"),
    )
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nConnection: close\r\n"
    head += f"Retry-After: 1\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with header and body deadlines and connection caps
    (``configured`` makes a subclass with the settings)."""

    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S  # 0: no deadline
    body_min_rate: int = BODY_MIN_RATE
    max_per_client: int = MAX_PER_CLIENT  # 0: no cap
    max_connections: int = MAX_CONNECTIONS  # 0: no cap

    @classmethod
    def configured(cls, **settings) -> type:
        """A subclass with ``settings`` (any of the class attributes above)."""
        unknown = set(settings) - set(vars(GuardedH11Protocol))
        if unknown:
            raise TypeError(f"unknown settings {sorted(unknown)}")
        return type("GuardedH11", (cls,), settings)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_bytes, self._counted = 0, False
        if self._refused(transport):
            return
        self._arm()

    def _refused(self, transport) -> bool:
        """Whether the connection is over a cap (then answered and closed)."""
        counts, total = self._counts(), self.server_state.connections
        if self.max_connections and len(total) > self.max_connections:
            message = f"over {self.max_connections} connections to this gateway"
            transport.write(_raw_answer("503 Service Unavailable", message))
            transport.close()
            return True
        host = self.client[0] if self.client else None
        if self.max_per_client and host is not None:
            if counts.get(host, 0) >= self.max_per_client:
                message = f"over {self.max_per_client} connections from one client"
                transport.write(_raw_answer("429 Too Many Requests", message))
                transport.close()
                return True
            counts[host] = counts.get(host, 0) + 1
            self._counted = True
        return False

    def connection_lost(self, exc) -> None:
        self._disarm()
        self._body_done()
        if getattr(self, "_counted", False):
            counts, host = self._counts(), self.client[0]
            counts[host] -= 1
            if counts[host] <= 0:
                del counts[host]
            self._counted = False
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._body_timer is not None:
            self._body_bytes += len(data)
        super().data_received(data)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers are in
            self._disarm()
            if self.body_timeout_s and self.conn.their_state is h11.SEND_BODY:
                self._body_started = self.loop.time()
                self._body_bytes = 0
                self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_due)
        if self.conn.their_state is not h11.SEND_BODY:
            self._body_done()

    def _body_done(self) -> None:
        timer = getattr(self, "_body_timer", None)
        if timer is not None:
            timer.cancel()
            self._body_timer = None

    def _body_due(self) -> None:
        """The body's deadline: later by the bytes received since, else the cut."""
        self._body_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        due = self._body_started + self.body_timeout_s + self._body_bytes / self.body_min_rate
        if due > self.loop.time():
            self._body_timer = self.loop.call_at(due, self._body_due)
            return
        if self.cycle is not None and not self.cycle.response_started:
            message = (
                f"the request body did not arrive within {self.body_timeout_s:g}s "
                f"(and a second for every {self.body_min_rate} bytes received)"
            )
            self.transport.write(_raw_answer("408 Request Timeout", message))
        if self.cycle is not None:
            self.cycle.disconnected = True  # the app's receive() says so at once
            self.cycle.message_event.set()
        self.transport.close()

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
    guards: dict | None = None,
    trust_proxy: bool = False,
    tls: tuple[str, str] | None = None,
) -> None:
    """Serve ``app``; ``guards``: ``GuardedH11Protocol``'s settings (its defaults for
    those not given). X-Forwarded-* headers are believed only with ``trust_proxy`` (from
    any address: every connection comes through the proxy), never by default (uvicorn
    would from 127.0.0.1, where anyone on the machine could claim any client address);
    ``tls``: (certificate file, key file)."""
    protocol = GuardedH11Protocol.configured(**(guards or {}))
    certfile, keyfile = tls or (None, None)
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=GRACE_S,
        http=protocol, proxy_headers=trust_proxy, forwarded_allow_ips="*" if trust_proxy else "",
        ssl_certfile=certfile, ssl_keyfile=keyfile,
    )  # fmt: skip
    GatewayServer(config).run()
