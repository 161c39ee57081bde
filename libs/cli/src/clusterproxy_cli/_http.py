"""A minimal HTTP/1.1 client on h11, over any trio stream (a TCP socket or a tunnel stream)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass

import h11
import trio

MAX_BODY = 4 << 20


@dataclass(frozen=True)
class HttpResponse:
    status: int
    headers: dict[str, str]
    body: bytes


async def request(
    stream: trio.abc.Stream,
    method: str,
    target: str,
    host: str,
    body: bytes = b"",
    *,
    headers: list[tuple[str, str]] = (),  # type: ignore[assignment]
    max_body: int = MAX_BODY,
) -> HttpResponse:
    """Send one request with ``Connection: close`` and read the whole response."""
    conn = h11.Connection(h11.CLIENT)
    head = [("host", host), ("connection", "close"), *headers]
    if body or method in ("POST", "PUT", "PATCH"):
        head.append(("content-length", str(len(body))))
    data = conn.send(h11.Request(method=method, target=target, headers=head))
    if body:
        data += conn.send(h11.Data(data=body))
    data += conn.send(h11.EndOfMessage())
    await stream.send_all(data)
    response: h11.Response | None = None
    received = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(64 << 10))
            continue
        if isinstance(event, h11.Response):
            response = event
        elif isinstance(event, h11.Data):
            received += event.data
            if len(received) > max_body:
                raise ValueError(f"response body larger than {max_body} bytes")
        elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            break
    if response is None:
        raise h11.RemoteProtocolError("connection closed before a response", error_status_hint=502)
    fields = {bytes(k).decode("latin-1"): bytes(v).decode("latin-1") for k, v in response.headers}
    return HttpResponse(response.status_code, fields, bytes(received))


async def get(
    host: str, port: int, path: str, *, timeout: float = 5.0, tls: ssl.SSLContext | None = None
) -> HttpResponse:
    """``GET http://host:port/path`` over a new TCP connection; ``https://`` with ``tls``."""
    with trio.fail_after(timeout):
        stream: trio.abc.Stream = await trio.open_tcp_stream(host, port)
        if tls is not None:
            stream = trio.SSLStream(stream, tls, server_hostname=host)
        async with stream:
            return await request(stream, "GET", path, f"{host}:{port}")
