"""A small HTTP/1.1 server for the admin ports (/healthz, /readyz, /metrics, JSON APIs).

Built on h11 so that it is a proper HTTP parser with limits, not string splitting.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import h11
import prometheus_client
import trio

MAX_REQUEST_HEAD = 16 << 10
REQUEST_TIMEOUT = 10.0


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"

    @classmethod
    def json(cls, value: Any, status: int = 200) -> Reply:
        return cls(status, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode(), "application/json")

    @classmethod
    def text(cls, text: str, status: int = 200) -> Reply:
        return cls(status, (text + "\n").encode())

    @classmethod
    def metrics(cls, registry: prometheus_client.CollectorRegistry) -> Reply:
        return cls(200, prometheus_client.generate_latest(registry), prometheus_client.CONTENT_TYPE_LATEST)


Route = Callable[[], Awaitable[Reply] | Reply]


async def serve_admin(
    listeners: list[trio.SocketListener],
    routes: dict[str, Route],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve GET requests for ``routes`` (exact paths) on ``listeners``, one request per connection."""

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            with trio.move_on_after(REQUEST_TIMEOUT):
                await _serve_one(stream, routes)

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handle, listeners)
        task_status.started()


async def _serve_one(stream: trio.SocketStream, routes: dict[str, Route]) -> None:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_HEAD)
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            await _send(
                stream, conn, Reply.text(f"bad request: {exc}", exc.error_status_hint), head_only=False
            )
            return
        if event is h11.NEED_DATA:
            data = await stream.receive_some(4096)
            if not data:
                return
            conn.receive_data(data)
            continue
        if isinstance(event, h11.Request):
            break
        return
    path = event.target.decode("ascii", "replace").split("?", 1)[0]
    method = event.method.decode("ascii", "replace")
    route = routes.get(path)
    if route is None:
        reply = Reply.text(f"not found: {path} (try: {', '.join(sorted(routes))})", 404)
    elif method not in ("GET", "HEAD"):
        reply = Reply.text(f"method {method} not allowed; use GET", 405)
    else:
        result = route()
        reply = await result if isinstance(result, Awaitable) else result
    await _send(stream, conn, reply, head_only=method == "HEAD")


async def _send(stream: trio.SocketStream, conn: h11.Connection, reply: Reply, *, head_only: bool) -> None:
    headers = [
        ("content-type", reply.content_type),
        ("content-length", str(len(reply.body))),
        ("connection", "close"),
    ]
    data = conn.send(h11.Response(status_code=reply.status, headers=headers))
    if not head_only:
        data += conn.send(h11.Data(data=reply.body))
    data += conn.send(h11.EndOfMessage())
    await _send_raw(stream, data)


async def _send_raw(stream: trio.SocketStream, data: bytes) -> None:
    try:
        await stream.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
