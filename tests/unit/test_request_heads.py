"""request_heads.next_event: h11's parse, and what RFC 9110/9112 refuse but h11 lets through (a control
byte in a field value, obs-fold) refused the same way, byte-exact on the head h11 consumed."""

from __future__ import annotations

import h11
import pytest

from clusterproxy_protocol.request_heads import malformed_reason, next_event


def _server(data: bytes) -> h11.Connection:
    connection = h11.Connection(h11.SERVER)
    connection.receive_data(data)
    return connection


@pytest.mark.parametrize(
    "head",
    [
        b"GET / HTTP/1.1\r\nHost: a\r\nX-A: tab\tand obs-text \x80\xff\r\n\r\n",
        b"GET / HTTP/1.1\nHost: a\nX-A: b\n\n",  # LF alone for line ends
        b"GET / HTTP/1.1\r\nHost: a\r\nX-A:\r\n\r\n",  # an empty value
    ],
)
def test_valid_heads_pass(head: bytes) -> None:
    assert isinstance(next_event(_server(head)), h11.Request)


@pytest.mark.parametrize(
    ("head", "reason"),
    [
        (b"GET / HTTP/1.1\r\nHost: a\r\nX-A: b\x01c\r\n\r\n", "control byte 0x01 in header 'X-A'"),
        (b"GET / HTTP/1.1\r\nHost: a\r\nX-A: b\x1b[31m\r\n\r\n", "control byte 0x1b"),
        (b"GET / HTTP/1.1\nHost: a\nX-A: b\n\tc\n\n", "obsolete line folding"),
        (b"GET /\x00 HTTP/1.1\r\nHost: a\r\n\r\n", "illegal request line"),  # h11's own
    ],
)
def test_malformed_heads_are_refused_with_a_reason(head: bytes, reason: str) -> None:
    with pytest.raises(h11.RemoteProtocolError) as info:
        next_event(_server(head))
    assert info.value.error_status_hint == 400
    assert reason in malformed_reason(info.value)


def test_only_the_head_is_checked_and_each_head_of_a_connection() -> None:
    """A body may hold any byte; the next request on a kept-alive connection is checked again."""
    first = b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\n\x01\x02\r"
    connection = _server(first + b"GET / HTTP/1.1\r\nHost: a\r\nX-A: b\r\n c\r\n\r\n")
    assert isinstance(next_event(connection), h11.Request)
    assert next_event(connection) == h11.Data(data=b"\x01\x02\r")
    assert isinstance(next_event(connection), h11.EndOfMessage)
    connection.send(h11.Response(status_code=200, headers=[("content-length", "0")]))
    connection.send(h11.EndOfMessage())
    connection.start_next_cycle()
    with pytest.raises(h11.RemoteProtocolError, match="folding"):
        next_event(connection)


def test_the_reason_is_one_bounded_line() -> None:
    with pytest.raises(h11.RemoteProtocolError) as info:
        next_event(_server(b"GET /\x00" + b"a" * 4000 + b" HTTP/1.1\r\n\r\n"))
    reason = malformed_reason(info.value)
    assert len(reason) <= 300 and reason.isascii() and "\n" not in reason
