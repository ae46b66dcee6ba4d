"""The egress module against receivers on loopback addresses of this process: every
refused range by literal address, names that resolve inward (the test resolver hook
and the system's ``localhost``), DNS rebinding at connect time, redirects, the
whole-request deadline against a hanging and a dripping receiver, the size cap, and
the allow-list letting exactly one internal receiver through."""

from __future__ import annotations

import ipaddress
import socket
import time

import pytest
from receivers import Receiver

from lorapool import egress
from lorapool.egress import EgressError, EgressPolicy, EgressRefused, check_url, request

REFUSED = {
    "127.0.0.1": "loopback",
    "127.255.255.254": "loopback",
    "::1": "loopback",
    "0.0.0.0": "unspecified",
    "::": "unspecified",
    "10.0.0.1": "private",
    "172.16.0.1": "private",
    "172.31.255.255": "private",
    "192.168.1.1": "private",
    "169.254.169.254": "link-local",  # AWS, GCP, Azure metadata
    "fe80::1": "link-local",
    "fc00::1": "unique-local",
    "fd00:ec2::254": "unique-local",  # AWS metadata over IPv6
    "100.64.0.1": "shared",
    "100.100.100.200": "shared",  # Alibaba Cloud metadata
    "224.0.0.1": "multicast",
    "239.255.255.250": "multicast",
    "ff02::1": "multicast",
    "240.0.0.1": "reserved",
    "255.255.255.255": "",
    "192.0.2.1": "",  # documentation
    "198.18.0.1": "",  # benchmarking
    "fec0::1": "",  # site-local
    "::ffff:127.0.0.1": "loopback address (embedded",
    "::ffff:169.254.169.254": "link-local",
    "2002:7f00:1::1": "loopback address (embedded",  # 6to4 of 127.0.0.1
    "2002:a9fe:a9fe::1": "link-local",  # 6to4 of 169.254.169.254
    "64:ff9b::a00:1": "private",  # NAT64 of 10.0.0.1
    "2001:0:4136:e378:8000:63bf:80ff:fffe": "loopback",  # Teredo of 127.0.0.1
}
PUBLIC = ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "93.184.216.34"]


def _url(host: str, port: int = 80) -> str:
    return f"http://[{host}]:{port}/x" if ":" in host else f"http://{host}:{port}/x"


@pytest.mark.parametrize("address", sorted(REFUSED))
def test_every_internal_range_is_refused_by_literal_address(address):
    with pytest.raises(EgressRefused, match="refused to call") as caught:
        check_url(_url(address), EgressPolicy())
    assert REFUSED[address] in str(caught.value)
    assert egress.refusal(ipaddress.ip_address(address)) is not None


@pytest.mark.parametrize("address", PUBLIC)
def test_public_addresses_pass_the_check(address):
    target = check_url(_url(address, 8080), EgressPolicy())
    assert [str(a) for a in target.addresses] == [str(ipaddress.ip_address(address))]


@pytest.mark.parametrize(
    "url, reason",
    [
        ("ftp://example.com/", "only http and https"),
        ("file:///etc/passwd", "only http and https"),
        ("gopher://127.0.0.1:6379/_INFO", "only http and https"),
        ("http://user:pw@example.com/", "credentials"),
        ("http://example.com@127.0.0.1/", "credentials"),
        ("http:///path", "no host"),
        ("http://example.com:0/", "port 0"),
        ("http://example.com:99999/", "not a valid URL"),
        ("http://exa mple.com/", "spaces"),
        ("http://example.com/\x00", "control"),
        ("http://" + "a" * 3000 + ".com/", "characters"),
        (None, "characters"),
    ],
)
def test_urls_that_are_not_plain_http_are_refused(url, reason):
    with pytest.raises(EgressRefused, match=reason):
        check_url(url, EgressPolicy(), resolver=lambda host, port: ["8.8.8.8"])


@pytest.mark.parametrize("host", ["2130706433", "0x7f.1", "127.1", "localhost", "LOCALHOST."])
def test_names_and_odd_forms_that_resolve_to_loopback_are_refused(host):
    """The system's resolver turns these into 127.0.0.1; the check is on the address."""
    with pytest.raises(EgressRefused, match="loopback"):
        check_url(f"http://{host}:6379/", EgressPolicy())


def test_the_resolver_hook_makes_a_name_resolve_inward(monkeypatch):
    monkeypatch.setenv(egress.RESOLVE_ENV, "hooks.example=127.0.0.1,meta.example=169.254.169.254")
    with pytest.raises(EgressRefused, match=r"loopback.*hooks\.example resolves to 127\.0\.0\.1"):
        check_url("https://hooks.example/x", EgressPolicy())
    with pytest.raises(EgressRefused, match="link-local"):
        request("POST", "http://meta.example/latest/meta-data/", b"{}")


def test_a_name_with_one_inward_address_among_public_ones_is_refused():
    resolver = lambda host, port: ["8.8.8.8", "10.1.2.3"]  # noqa: E731
    with pytest.raises(EgressRefused, match="private"):
        check_url("http://mixed.example/", EgressPolicy(), resolver)


def test_dns_rebinding_is_checked_again_at_send_time():
    """The name resolves to a public address when checked at submit, to 127.0.0.1 when
    sent: the send resolves again and refuses, and never connects."""
    with Receiver() as receiver:
        answers = iter([["93.184.216.34"], ["127.0.0.1"]])
        resolver = lambda host, port: next(answers)  # noqa: E731
        url = f"http://rebind.example:{receiver.port}/hook"
        check_url(url, EgressPolicy(), resolver)  # at submit: public
        with pytest.raises(EgressRefused, match="loopback"):
            request("POST", url, b"{}", resolver=resolver)
        assert receiver.hits == []


def test_the_address_actually_connected_to_is_checked(monkeypatch):
    """A connection that lands elsewhere than the checked address (a rebinding below the
    resolver) is closed before anything is sent."""
    with Receiver() as receiver:
        real = socket.create_connection
        monkeypatch.setattr(
            egress.socket,
            "create_connection",
            lambda address, timeout: real(("127.0.0.1", receiver.port), timeout),
        )
        with pytest.raises(EgressRefused, match="reached a different address"):
            request("POST", f"http://93.184.216.34:{receiver.port}/hook", b"{}")
        time.sleep(0.2)
        assert receiver.hits == []


def test_redirects_are_answers_never_followed():
    with Receiver() as internal, Receiver(f"redirect:{Receiver().url}") as outer:
        policy = EgressPolicy(allow=("127.0.0.1/32",))
        response = request("POST", outer.url, b"{}", policy=policy)
        assert response.status == 302 and not response.ok
        assert len(outer.hits) == 1 and internal.hits == []


def test_the_allow_list_lets_one_internal_receiver_through():
    with Receiver(host="127.0.0.1") as allowed, Receiver(host="127.0.0.2") as other:
        policy = EgressPolicy(allow=("127.0.0.1/32",))
        assert request("POST", allowed.url, b'{"a": 1}', policy=policy).status == 204
        assert allowed.hits[0].body == b'{"a": 1}'
        with pytest.raises(EgressRefused, match="loopback"):
            request("POST", other.url, b"{}", policy=policy)
        assert other.hits == []


def test_the_allow_list_by_host_name(monkeypatch):
    monkeypatch.setenv(egress.RESOLVE_ENV, "hooks.internal=127.0.0.1,evil.internal=127.0.0.1")
    with Receiver() as receiver:
        policy = EgressPolicy(allow=("*.hooks.internal", "hooks.internal"))
        url = f"http://hooks.internal:{receiver.port}/hook"
        assert request("POST", url, b"{}", policy=policy).status == 204
        assert receiver.hits[0].headers["host"] == f"hooks.internal:{receiver.port}"
        with pytest.raises(EgressRefused):
            request("POST", f"http://evil.internal:{receiver.port}/", b"{}", policy=policy)


@pytest.mark.parametrize("mode", ["hang", "drip"])
def test_the_deadline_bounds_the_whole_request(mode):
    """A receiver that never answers, or answers one byte every 0.3 s, is left at the
    deadline (1 s here), not after a per-read timeout of its own."""
    with Receiver(mode, drip_s=0.3) as receiver:
        policy = EgressPolicy(allow=("127.0.0.1/32",), deadline_s=1.0)
        start = time.monotonic()
        with pytest.raises(EgressError, match="deadline"):
            request("POST", receiver.url, b"{}", policy=policy)
        assert 0.9 < time.monotonic() - start < 1.6


def test_a_large_answer_is_cut_at_the_cap():
    with Receiver("big") as receiver:
        policy = EgressPolicy(allow=("127.0.0.1/32",), max_response_bytes=1000)
        start = time.monotonic()
        response = request("POST", receiver.url, b"{}", policy=policy)
        assert response.status == 200 and len(response.body) == 1000
        assert time.monotonic() - start < 2


def test_nothing_listening_is_an_error_worth_a_retry():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    policy = EgressPolicy(allow=("127.0.0.1/32",))
    with pytest.raises(EgressError, match="could not connect"):
        request("POST", f"http://127.0.0.1:{port}/", b"{}", policy=policy)


def test_a_resolver_that_hangs_is_bounded_by_the_deadline():
    def slow(host, port):
        time.sleep(5)
        return ["8.8.8.8"]

    start = time.monotonic()
    with pytest.raises(EgressError, match="resolving"):
        request(
            "POST",
            "http://slow.example/",
            b"{}",
            policy=EgressPolicy(deadline_s=0.5),
            resolver=slow,
        )
    assert time.monotonic() - start < 1.5


@pytest.mark.parametrize("entry", ["", "not a host!", "10.0.0.0/33", "a..b"])
def test_bad_allow_list_entries_are_refused(entry):
    with pytest.raises(ValueError, match="allow-list entry|network or a host"):
        EgressPolicy(allow=(entry,))
