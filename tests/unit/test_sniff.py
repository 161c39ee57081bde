"""The client port tells HTTP/2, HTTP/1.1 and neither apart by the first bytes, whatever they arrive in."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from clusterproxy_server.frontends.sniff import FIRST_READ, H2_PREFACE, client_protocol

CASES = [
    (H2_PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00", "h2"),
    (b"CONNECT cluster1:443 HTTP/1.1\r\nHost: cluster1:443\r\n\r\n", "http1"),
    (b"GET http://echo.cluster1:8080/ HTTP/1.1\r\nHost: x\r\n\r\n", "http1"),
    (b"\r\nCONNECT a:1 HTTP/1.0\n\n", "http1"),
    (b"INVALID CONNECTION PREFACE\r\n\r\n", "unknown"),  # h2spec http2/3.5
    (b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n", "unknown"),  # a preface gone wrong after its request line
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", "unknown"),  # TLS inside TLS
    (b"CONNECT cluster1:443\r\n\r\n", "unknown"),  # HTTP/0.9 style: no version
    # Malformed HTTP/1.x requests are HTTP/1.x clients: h11 answers them 400 with the reason.
    (b"CONNECT cluster1\x00:443 HTTP/1.1\r\n\r\n", "http1"),  # a NUL in the target
    (b"CONNECT cluster\x01 1\r:443 HTTP/1.1\r\n\r\n", "http1"),  # a control byte, a space, a bare CR
    (b"CONNECT cluster1:443 HTTP/1.x\r\n\r\n", "http1"),  # an invalid minor version
    (b"CONNECT cluster1:443 HTTP/1.1 x\r\n\r\n", "unknown"),  # the last word is no version
    (b"CONNECT cluster1:443 HTTP/3\r\n\r\n", "unknown"),
    (b"CON\x00NECT cluster1:443 HTTP/1.1\r\n\r\n", "unknown"),  # no method token: not HTTP
]


async def _sniff(data: bytes, piece: int) -> tuple[str, bytes]:
    send, receive = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:

        async def feed() -> None:
            for offset in range(0, len(data), piece):
                await send.send_all(data[offset : offset + piece])
                await trio.testing.wait_all_tasks_blocked()

        nursery.start_soon(feed)
        with trio.fail_after(5):
            result = await client_protocol(receive)
        nursery.cancel_scope.cancel()
    return result


@pytest.mark.parametrize("piece", [1, 3, 4096])
@pytest.mark.parametrize(("data", "expected"), CASES)
async def test_first_bytes_decide_the_protocol(data: bytes, expected: str, piece: int) -> None:
    protocol, received = await _sniff(data, piece)
    assert protocol == expected
    assert data.startswith(received) and received  # nothing invented, nothing lost


async def test_a_client_closing_before_its_first_line_is_left_to_http1() -> None:
    send, receive = trio.testing.memory_stream_pair()
    await send.send_all(b"CONNE")
    await send.aclose()
    assert await client_protocol(receive) == ("http1", b"CONNE")


async def test_a_request_line_still_growing_at_the_read_limit_is_http1() -> None:
    """Its end never came: h11's head limit answers it (431), in the protocol it speaks."""
    protocol, _ = await _sniff(b"CONNECT " + b"a" * FIRST_READ, 4096)
    assert protocol == "http1"
    protocol, _ = await _sniff(b"\x16" * FIRST_READ, 4096)  # no request line can start so
    assert protocol == "unknown"
