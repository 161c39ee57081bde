"""Reconnect backoff and error descriptions of the agent's tunnel loop."""

from __future__ import annotations

import ssl

import pytest
import trio

from clusterproxy_agent.tunnel import Backoff, nothing_listening
from clusterproxy_protocol.errors import describe_exception


def test_backoff_full_jitter_bounds() -> None:
    values = iter([0.0, 0.5, 1.0, 0.25, 1.0, 1.0])
    backoff = Backoff(0.5, 3.0, rng=lambda: next(values))
    assert [backoff.next() for _ in range(6)] == [0.0, 0.5, 2.0, 0.75, 3.0, 3.0]
    backoff.reset()
    assert backoff.ceiling() == 0.5
    with pytest.raises(ValueError):
        Backoff(2.0, 1.0)


def test_describe_exception_unwraps_ssl() -> None:
    try:
        raise trio.BrokenResourceError from ssl.SSLError(1, "[SSL: TLSV1_ALERT_UNKNOWN_CA] alert")
    except trio.BrokenResourceError as exc:
        assert describe_exception(exc).startswith("TLS handshake failed")
    assert describe_exception(ConnectionRefusedError(111, "Connection refused")) == "Connection refused"


def test_backoff_ceiling_doubles_up_to_the_max() -> None:
    backoff = Backoff(0.5, 30.0, rng=lambda: 1.0)
    assert [backoff.next() for _ in range(9)] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    for _ in range(1000):  # no overflow however long it keeps failing
        assert backoff.next() == 30.0


def test_describe_exception_for_certificate_verification() -> None:
    error = ssl.SSLCertVerificationError(1, "certificate verify failed")
    error.verify_message = "unable to get local issuer certificate"
    try:
        raise trio.BrokenResourceError from error
    except trio.BrokenResourceError as exc:
        text = describe_exception(exc)
    assert text == "TLS handshake failed: certificate verify failed: unable to get local issuer certificate"


async def dial_a_closed_port() -> tuple[int, OSError]:
    """The port, and what trio's open_tcp_stream raises when nothing listens there."""
    with trio.socket.socket() as probe:
        await probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(OSError) as info:
        await trio.open_tcp_stream("127.0.0.1", port)
    return port, info.value


async def test_describe_exception_shows_why_every_address_failed() -> None:
    port, refused = await dial_a_closed_port()
    text = describe_exception(refused)
    assert f"127.0.0.1:{port}" in text
    assert "Connection refused" in text


async def test_nothing_listening_is_a_refusal_of_every_address_and_nothing_else() -> None:
    _, refused = await dial_a_closed_port()
    assert nothing_listening(refused)
    half = OSError("all attempts to connect failed")  # one address refused, the other timed out
    half.__cause__ = ExceptionGroup("attempts", [ConnectionRefusedError(111, "refused"), TimeoutError()])
    assert not nothing_listening(half)
    assert not nothing_listening(trio.BrokenResourceError("TLS handshake failed"))
    assert not nothing_listening(TimeoutError("connect timed out"))
