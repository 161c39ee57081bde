"""http1client over in-memory streams: what it sends, the framings it reads (Content-Length, chunked,
close-delimited), the body limit, the error wording, and a server that closes early."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import h11
import pytest
import trio
import trio.testing

from clusterproxy_protocol import http1client
from clusterproxy_protocol.http1client import (
    HTTPStatusError,
    MalformedResponse,
    NoResponse,
    Response,
    ResponseTooLarge,
)

Server = Callable[[trio.abc.Stream, bytes], Awaitable[None]]


async def _read_request(stream: trio.abc.Stream) -> bytes:
    """The request's bytes up to the end of its head, and its body when it declares one."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            while len(rest) < int(value):
                rest += await stream.receive_some(65536)
    return data


def _answering(answer: bytes, *, close: bool = True) -> Server:
    async def server(stream: trio.abc.Stream, _: bytes) -> None:
        await stream.send_all(answer)
        if close:
            await stream.aclose()

    return server


async def _exchange(
    server: Server, method: str = "GET", body: bytes = b"", **options: object
) -> tuple[Response, bytes]:
    client, remote = trio.testing.memory_stream_pair()
    seen: list[bytes] = []

    async def serve() -> None:
        request = await _read_request(remote)
        seen.append(request)
        await server(remote, request)

    outcome: list[Response | Exception] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        with trio.fail_after(5):
            try:
                outcome.append(
                    await http1client.request(client, method, "/p?q=1", "example:80", body, **options)
                )  # type: ignore[arg-type]
            except Exception as exc:  # raised below, outside the nursery's exception group
                outcome.append(exc)
                nursery.cancel_scope.cancel()
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    response = outcome[0]
    return response, seen[0]


async def test_content_length_answer_and_what_is_sent() -> None:
    response, sent = await _exchange(
        _answering(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Thing: a\r\n\r\nhello", close=False),
        "POST",
        b"payload",
        headers=[("content-type", "text/plain")],
    )
    assert (response.status, response.body, response.header("X-Thing")) == (200, b"hello", "a")
    assert response.words == "200 OK"
    head = sent.split(b"\r\n\r\n")[0].lower()
    assert sent.startswith(b"POST /p?q=1 HTTP/1.1\r\n")
    for line in (
        b"host: example:80",
        b"connection: close",
        b"content-type: text/plain",
        b"content-length: 7",
    ):
        assert line in head


async def test_a_get_declares_no_body() -> None:
    _, sent = await _exchange(_answering(b"HTTP/1.1 204 No Content\r\n\r\n", close=False))
    assert b"content-length" not in sent.lower()


async def test_chunked_answer() -> None:
    answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n4\r\ndefg\r\n0\r\n\r\n"
    response, _ = await _exchange(_answering(answer, close=False))
    assert response.body == b"abcdefg"


async def test_close_delimited_answer() -> None:
    response, _ = await _exchange(_answering(b"HTTP/1.1 200 OK\r\n\r\nuntil the end"))
    assert response.body == b"until the end"


async def test_body_limit() -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n0123456789X"
    response, _ = await _exchange(_answering(answer), max_body=11)
    assert response.body == b"0123456789X"
    with pytest.raises(ResponseTooLarge, match="larger than 10 bytes") as caught:
        await _exchange(_answering(answer), max_body=10)
    assert caught.value.status == 200


async def test_body_limit_truncating_reads_to_the_end() -> None:
    answer = b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n6\r\nabcdef\r\n6\r\nghijkl\r\n0\r\n\r\n"
    response, _ = await _exchange(_answering(answer, close=False), max_body=4, truncate=True)
    assert (response.status, response.body) == (503, b"abcd")


async def test_error_wording() -> None:
    answer = b"HTTP/1.1 403 Nope\r\nContent-Length: 29\r\n\r\n\n  not   allowed here\nsecond\n"
    response, _ = await _exchange(_answering(answer))
    with pytest.raises(HTTPStatusError) as caught:
        response.raise_for_status()
    assert str(caught.value) == "403 Forbidden: not allowed here"
    assert caught.value.status == 403
    assert caught.value.response is response


async def test_error_wording_without_a_body_or_a_known_status() -> None:
    response, _ = await _exchange(_answering(b"HTTP/1.1 599 Odd Thing\r\nContent-Length: 0\r\n\r\n"))
    with pytest.raises(HTTPStatusError, match=r"^599 Odd Thing$"):
        response.raise_for_status()
    ok, _ = await _exchange(_answering(b"HTTP/1.1 302 Found\r\nContent-Length: 0\r\n\r\n"))
    assert ok.raise_for_status() is ok


async def test_error_line_is_cut() -> None:
    body = b"x" * 500
    answer = b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 500\r\n\r\n" + body
    response, _ = await _exchange(_answering(answer))
    message = str(HTTPStatusError(response))
    assert message.startswith("500 Internal Server Error: xxx") and message.endswith("...")
    assert len(message) < 260


async def test_server_closing_before_answering() -> None:
    with pytest.raises(NoResponse, match="closed before a response"):
        await _exchange(_answering(b""))


async def test_server_closing_in_the_head() -> None:
    with pytest.raises(NoResponse, match="middle of the response head"):
        await _exchange(_answering(b"HTTP/1.1 200 OK\r\nContent-Le"))


async def test_server_closing_in_the_body() -> None:
    with pytest.raises(MalformedResponse, match=r"200 OK.*cut short"):
        await _exchange(_answering(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"))
    with pytest.raises(MalformedResponse, match="cut short"):
        await _exchange(_answering(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab"))


async def test_not_http() -> None:
    with pytest.raises(MalformedResponse, match=r"not an HTTP/1\.1 answer"):
        await _exchange(_answering(b"SSH-2.0-OpenSSH_9.6\r\n\r\n"))


async def test_interim_answer_is_skipped() -> None:
    answer = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok"
    response, _ = await _exchange(_answering(answer, close=False), "POST")
    assert (response.status, response.body) == (201, b"ok")


async def test_read_response_after_raw_bytes() -> None:
    client, remote = trio.testing.memory_stream_pair()
    await client.send_all(b"BROKEN\r\n\r\n")
    await remote.send_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 4\r\n\r\nbad\n")
    await remote.aclose()
    response = await http1client.read_response(client)
    assert (response.status, response.body) == (400, b"bad\n")


async def test_errors_are_one_family() -> None:
    for error in (ResponseTooLarge, NoResponse, MalformedResponse, HTTPStatusError):
        assert issubclass(error, http1client.HTTPClientError)
    assert not issubclass(http1client.HTTPClientError, h11.ProtocolError)


async def test_get_over_tcp() -> None:
    async def handler(stream: trio.SocketStream) -> None:
        request = await _read_request(stream)
        assert request.startswith(b"GET /x HTTP/1.1\r\n") and b"host: 127.0.0.1:" in request
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi")
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, handler, 0)
        port = listeners[0].socket.getsockname()[1]
        response = await http1client.get("127.0.0.1", port, "/x", timeout=5)
        assert response.body == b"hi"
        nursery.cancel_scope.cancel()
