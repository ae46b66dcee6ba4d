"""Every URL the pool calls goes through here (webhooks, and anything later).

A URL is called only if it is ``http`` or ``https``, names no credentials, and every
address its host resolves to is public: loopback, link-local (where cloud metadata
services answer: 169.254.169.254, fd00:ec2::254), private, shared (100.64/10),
unique-local, multicast, unspecified, reserved and documentation addresses are refused,
and so are IPv6 addresses that embed such an IPv4 address (mapped, 6to4, Teredo,
NAT64). An operator lets internal receivers through with an allow-list of networks
and host names (``--webhook-allow 10.1.2.0/24 --webhook-allow hooks.internal``).

The host is resolved once; the request connects to an address that was checked, and
the address the socket is connected to is checked again (a name that resolves to a
public address for the check and to 127.0.0.1 for the connection, DNS rebinding, never
reaches 127.0.0.1). Redirects are never followed: a 3xx is the answer. The whole
request (resolution, connect, TLS, send, read) ends within ``deadline_s`` and reads
at most ``max_response_bytes`` of the body.

A test resolver hook: ``LORAPOOL_EGRESS_RESOLVE="name=address,..."`` makes ``name``
resolve to ``address`` in this process (as curl's ``--resolve``); the checks apply to
the address as to any other. May import: the standard library and h11.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import h11

RESOLVE_ENV = "LORAPOOL_EGRESS_RESOLVE"
DEFAULT_DEADLINE_S = 10.0
DEFAULT_MAX_RESPONSE_BYTES = 64 << 10
MAX_URL = 2048
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], list[str]]
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_SHARED = ipaddress.ip_network("100.64.0.0/10")


class EgressRefused(ValueError):
    """A URL the policy refuses to call (the message says why); never worth a retry."""


class EgressError(OSError):
    """A call that could not complete: no connection, the deadline passed, a broken
    answer. Worth a retry."""


@dataclass(frozen=True)
class EgressPolicy:
    """allow: networks (``10.0.0.0/8``, ``::1``) and host names (``hooks.internal``,
    ``*.internal``) let through although internal. deadline_s: the whole request's
    bound. max_response_bytes: the most of a response body read."""

    allow: tuple[str, ...] = ()
    deadline_s: float = DEFAULT_DEADLINE_S
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    networks: tuple = field(init=False, repr=False, compare=False)
    hosts: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if not (isinstance(self.deadline_s, int | float) and 0 < self.deadline_s <= 3600):
            raise ValueError(f"deadline_s must be in (0, 3600], got {self.deadline_s!r}")
        if not (isinstance(self.max_response_bytes, int) and self.max_response_bytes >= 0):
            raise ValueError(f"max_response_bytes must be >= 0, got {self.max_response_bytes!r}")
        networks, hosts = [], []
        for entry in self.allow:
            kind, value = parse_allow(entry)
            (networks if kind == "network" else hosts).append(value)
        object.__setattr__(self, "networks", tuple(networks))
        object.__setattr__(self, "hosts", tuple(hosts))

    def host_allowed(self, host: str) -> bool:
        return any(host == h or (h.startswith("*.") and host.endswith(h[1:])) for h in self.hosts)

    def refusal(self, address: Address) -> str | None:
        """Why ``address`` may not be called (None: it may)."""
        if any(address in network for network in self.networks):
            return None
        return refusal(address)


def parse_allow(entry: str) -> tuple[str, object]:
    """("network", ip_network) or ("host", name) of one allow-list entry."""
    if not isinstance(entry, str) or not entry.strip():
        raise ValueError(f"an allow-list entry must be a network or a host name, got {entry!r}")
    entry = entry.strip()
    try:
        return "network", ipaddress.ip_network(entry, strict=False)
    except ValueError:
        pass
    name = entry.lower().rstrip(".")
    bare = name[2:] if name.startswith("*.") else name
    labels = bare.split(".")
    if not all(0 < len(x) <= 63 and x.replace("-", "").isalnum() for x in labels):
        raise ValueError(f"allow-list entry {entry!r} is neither a network nor a host name")
    return "host", name


def refusal(address: Address) -> str | None:
    """Why ``address`` is internal (None: a public address)."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = _embedded_v4(address)
        if embedded is not None:
            reason = refusal(embedded)
            return None if reason is None else f"{reason} (embedded in {address})"
    checks = (
        ("unspecified", address.is_unspecified),
        ("loopback", address.is_loopback),
        ("link-local (cloud metadata lives here)", address.is_link_local),
        ("multicast", address.is_multicast),
        ("unique-local", address.version == 6 and address in ipaddress.ip_network("fc00::/7")),
        ("reserved", address.is_reserved),
        ("private", address.is_private),
        ("shared (carrier-grade NAT)", address.version == 4 and address in _SHARED),
        ("site-local", address.version == 6 and address.is_site_local),
        ("not a global address", not address.is_global),
    )
    return next((f"a {name} address" for name, hit in checks if hit), None)


def _embedded_v4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def system_resolver(host: str, port: int) -> list[str]:
    """The addresses of ``host`` (``LORAPOOL_EGRESS_RESOLVE`` first, then the system's)."""
    for item in os.environ.get(RESOLVE_ENV, "").split(","):
        name, _, address = item.strip().partition("=")
        if name and address and name.lower() == host:
            return [address]
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


@dataclass(frozen=True)
class Target:
    """A checked URL: where to connect and what to ask for."""

    scheme: str
    host: str  # lower case, IDNA, no brackets
    port: int
    path: str  # path and query
    addresses: tuple[Address, ...]

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


def split_url(url: object) -> tuple[str, str, int, str]:
    """(scheme, host, port, path) of an http(s) URL; EgressRefused naming what is wrong."""
    if not isinstance(url, str) or not url or len(url) > MAX_URL:
        raise EgressRefused(f"a URL must be a string of 1 to {MAX_URL} characters")
    if any(ord(c) < 33 or ord(c) == 127 for c in url):
        raise EgressRefused("a URL may not hold spaces or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise EgressRefused(f"not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise EgressRefused(f"only http and https URLs are called, not {parts.scheme!r}")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise EgressRefused("a URL may not carry credentials (user@host)")
    host = (parts.hostname or "").rstrip(".")
    if not host:
        raise EgressRefused("the URL names no host")
    try:
        host = host.encode("idna").decode("ascii") if not _is_ip(host) else host
    except UnicodeError:
        raise EgressRefused(f"the host {host!r} is not a valid name") from None
    if port == 0:
        raise EgressRefused("port 0 is not a port")
    port = port or (443 if parts.scheme == "https" else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return parts.scheme, host.lower(), port, path


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def check_url(
    url: object, policy: EgressPolicy, resolver: Resolver = system_resolver, timeout: float = 5.0
) -> Target:
    """The checked ``Target`` of ``url``: its host resolved (within ``timeout``), every
    address allowed; EgressRefused naming the reason, EgressError if it does not resolve."""
    scheme, host, port, path = split_url(url)
    if _is_ip(host):
        addresses = [ipaddress.ip_address(host)]
    else:
        addresses = [
            ipaddress.ip_address(a.split("%")[0]) for a in _resolve(resolver, host, port, timeout)
        ]
        if not addresses:
            raise EgressError(f"{host} resolves to no address")
    if not (not _is_ip(host) and policy.host_allowed(host)):
        for address in addresses:
            reason = policy.refusal(address)
            if reason is not None:
                named = "" if str(address) == host else f" ({host} resolves to {address})"
                raise EgressRefused(f"refused to call {reason}{named}")
    return Target(scheme, host, port, path, tuple(addresses))


def _resolve(resolver: Resolver, host: str, port: int, timeout: float) -> list[str]:
    """``resolver(host, port)`` within ``timeout`` (a resolver that hangs is left
    behind on its daemon thread)."""
    result: list = []

    def run() -> None:
        try:
            result.append(resolver(host, port))
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True, name=f"resolve {host}")
    thread.start()
    thread.join(max(0.0, timeout))
    if not result:
        raise EgressError(f"resolving {host} took over {timeout:.1f}s")
    if isinstance(result[0], Exception):
        raise EgressError(f"{host} does not resolve: {result[0]}")
    return list(result[0])


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]
    body: bytes  # at most max_response_bytes
    address: str  # the address the request was sent to

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


def request(
    method: str,
    url: str,
    body: bytes = b"",
    headers: Iterable[tuple[str, str]] = (),
    policy: EgressPolicy | None = None,
    resolver: Resolver = system_resolver,
) -> Response:
    """Send one HTTP/1.1 request to ``url`` under ``policy`` (default: public addresses
    only, 10 s); the answer, whatever its status (a 3xx is not followed). EgressRefused
    for a URL the policy refuses, EgressError when there is no complete answer in time."""
    policy = policy or EgressPolicy()
    deadline = time.monotonic() + policy.deadline_s
    target = check_url(url, policy, resolver, timeout=policy.deadline_s)
    sock = _connect(target, policy, deadline)
    try:
        return _exchange(sock, target, method, body, list(headers), policy, deadline)
    except TimeoutError:
        raise EgressError(f"no answer within the deadline ({policy.deadline_s:g}s)") from None
    except (OSError, h11.ProtocolError) as exc:
        if isinstance(exc, EgressError):
            raise
        raise EgressError(f"{target.host_header}: {type(exc).__name__}: {exc}") from None
    finally:
        sock.close()


def _left(deadline: float, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise EgressError(f"no answer within the deadline ({what})")
    return left


def _connect(target: Target, policy: EgressPolicy, deadline: float) -> socket.socket:
    """A socket connected to one of the target's checked addresses (TLS for https)."""
    errors = []
    for address in target.addresses:
        try:
            sock = socket.create_connection(
                (str(address), target.port), timeout=_left(deadline, "connect")
            )
        except OSError as exc:
            errors.append(f"{address}: {exc}")
            continue
        peer = ipaddress.ip_address(sock.getpeername()[0].split("%")[0])
        reason = None if peer == address else f"a different address ({peer})"
        if reason is None and not policy.host_allowed(target.host):
            reason = policy.refusal(peer)
        if reason is not None:
            sock.close()
            raise EgressRefused(f"refused: the connection reached {reason}")
        if target.scheme == "https":
            sock.settimeout(_left(deadline, "TLS handshake"))
            context = ssl.create_default_context()
            try:
                sock = context.wrap_socket(sock, server_hostname=target.host)
            except (OSError, ssl.SSLError) as exc:
                sock.close()
                raise EgressError(f"TLS with {target.host}: {exc}") from None
        return sock
    raise EgressError(f"could not connect to {target.host_header}: {'; '.join(errors)}")


def _exchange(
    sock: socket.socket,
    target: Target,
    method: str,
    body: bytes,
    headers: list[tuple[str, str]],
    policy: EgressPolicy,
    deadline: float,
) -> Response:
    conn = h11.Connection(our_role=h11.CLIENT)
    head = [("Host", target.host_header), ("Content-Length", str(len(body)))]
    head += [("Connection", "close"), *headers]
    wire = conn.send(h11.Request(method=method, target=target.path, headers=head))
    wire += conn.send(h11.Data(data=body)) if body else b""
    wire += conn.send(h11.EndOfMessage())
    sock.settimeout(_left(deadline, "send"))
    sock.sendall(wire)
    response = _next(conn, sock, deadline, (h11.Response,))
    answer = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in response.headers}
    peer = sock.getpeername()[0]
    content = _body(conn, sock, deadline, policy.max_response_bytes)
    return Response(response.status_code, answer, content, peer)


def _next(conn: h11.Connection, sock: socket.socket, deadline: float, kinds: tuple):
    """The next event of one of ``kinds`` (1xx answers skipped), reading within the deadline."""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            sock.settimeout(_left(deadline, "read"))
            conn.receive_data(sock.recv(65536))
        elif isinstance(event, kinds + (h11.EndOfMessage, h11.ConnectionClosed)):
            if not isinstance(event, kinds):
                raise EgressError("the connection closed before an answer")
            return event


def _body(conn: h11.Connection, sock: socket.socket, deadline: float, cap: int) -> bytes:
    """Up to ``cap`` bytes of the body; a body still coming at the deadline or past the
    cap is cut (the status has been read: the answer stands)."""
    content = bytearray()
    try:
        while len(content) <= cap:
            event = _next(conn, sock, deadline, (h11.Data, h11.EndOfMessage))
            if isinstance(event, h11.EndOfMessage):
                break
            content += event.data
    except (OSError, h11.ProtocolError):
        pass
    return bytes(content[:cap])
