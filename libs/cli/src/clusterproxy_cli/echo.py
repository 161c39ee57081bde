"""A small HTTP/1.1 echo service: the target service of local mode's simulated clusters.

``python -m clusterproxy_cli.echo --listen 127.0.0.1:9000 --name cluster1-echo --cluster cluster1``

- ``GET``/``HEAD`` any path: a JSON body naming the service, its cluster, the method and the path
  (``{"service": "cluster1-echo", "cluster": "cluster1", "method": "GET", "path": "/x", ...}``).
- ``POST``/``PUT``/``PATCH``: the request body is sent back as is (same content type, with its
  length) once it has arrived; it is spooled to a temporary file beyond 1 MiB, so memory stays
  bounded (at most 1 GiB per request, else 413).
- Anything else: 405.

Built on h11 (a real HTTP/1.1 parser with size limits), keep-alive, one trio task per connection.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
from collections.abc import Sequence

import h11
import trio

from clusterproxy_protocol import add_flag, parse_args_or_exit, parse_hostport

MAX_HEAD = 16 << 10
IDLE_TIMEOUT = 60.0
READ_SIZE = 64 << 10
SPOOL_IN_MEMORY = 1 << 20  # larger echo bodies are spooled to a temporary file
MAX_ECHO_BODY = 1 << 30
ECHO_METHODS = {b"POST", b"PUT", b"PATCH"}
INFO_METHODS = {b"GET", b"HEAD"}


class _Closed(Exception):
    pass


class EchoService:
    def __init__(self, name: str, cluster: str) -> None:
        self.name = name
        self.cluster = cluster
        self.requests = 0

    async def handle(self, stream: trio.abc.Stream) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        try:
            while True:
                event = await self._next(conn, stream)
                if not isinstance(event, h11.Request):
                    return
                self.requests += 1
                await self._answer(conn, stream, event)
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    return
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except h11.RemoteProtocolError as exc:
            if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                await self._simple(conn, stream, exc.error_status_hint, f"bad request: {exc}\n")
        except (_Closed, trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError):
            pass
        finally:
            await trio.aclose_forcefully(stream)

    async def _next(self, conn: h11.Connection, stream: trio.abc.Stream) -> h11.Event | type[h11.PAUSED]:
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event  # type: ignore[return-value]  # h11's sentinels are classes: `is not` does not narrow them
            with trio.fail_after(IDLE_TIMEOUT):
                data = await stream.receive_some(READ_SIZE)
            conn.receive_data(data)  # type: ignore[arg-type]  # b"" marks EOF; h11 declares bytes, appends to a bytearray

    async def _send(self, conn: h11.Connection, stream: trio.abc.Stream, event: h11.Event) -> None:
        data = conn.send(event)
        if data:
            await stream.send_all(data)

    async def _simple(self, conn: h11.Connection, stream: trio.abc.Stream, status: int, text: str) -> None:
        body = text.encode()
        headers = [("content-type", "text/plain; charset=utf-8"), ("content-length", str(len(body)))]
        headers.append(("connection", "close"))
        try:
            await self._send(conn, stream, h11.Response(status_code=status, headers=headers))
            await self._send(conn, stream, h11.Data(data=body))
            await self._send(conn, stream, h11.EndOfMessage())
        except (h11.LocalProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async def _answer(self, conn: h11.Connection, stream: trio.abc.Stream, request: h11.Request) -> None:
        method = bytes(request.method).upper()
        if method in ECHO_METHODS:
            await self._echo(conn, stream, request)
            return
        # Read (and drop) any body first, so that keep-alive stays in sync.
        while True:
            event = await self._next(conn, stream)
            if isinstance(event, h11.EndOfMessage):
                break
            if not isinstance(event, h11.Data):
                raise _Closed
        if method not in INFO_METHODS:
            text = f"method {method.decode('ascii', 'replace')} not allowed: use GET, HEAD or POST\n"
            body = text.encode()
            headers = [("content-type", "text/plain; charset=utf-8"), ("content-length", str(len(body)))]
            await self._send(
                conn,
                stream,
                h11.Response(status_code=405, headers=[*headers, ("allow", "GET, HEAD, POST, PUT, PATCH")]),
            )
            await self._send(conn, stream, h11.Data(data=body))
            await self._send(conn, stream, h11.EndOfMessage())
            return
        info = {
            "service": self.name,
            "cluster": self.cluster,
            "method": method.decode("ascii", "replace"),
            "path": bytes(request.target).decode("utf-8", "replace"),
            "host": _header(request, b"host"),
            "message": f"hello from {self.name} in cluster {self.cluster}",
        }
        body = (json.dumps(info) + "\n").encode()
        headers = [("content-type", "application/json"), ("content-length", str(len(body)))]
        await self._send(conn, stream, h11.Response(status_code=200, headers=headers))
        if method != b"HEAD":
            await self._send(conn, stream, h11.Data(data=body))
        await self._send(conn, stream, h11.EndOfMessage())

    async def _echo(self, conn: h11.Connection, stream: trio.abc.Stream, request: h11.Request) -> None:
        """Read the whole body, then send it back with its length.

        The body is spooled (memory up to SPOOL_IN_MEMORY, then a temporary file), so memory stays
        bounded and clients that send the whole body before reading the answer (most do) work too.
        """
        if conn.client_is_waiting_for_100_continue:
            await self._send(conn, stream, h11.InformationalResponse(status_code=100, headers=[]))
        with tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY) as raw:
            spool = trio.wrap_file(raw)
            size = 0
            while True:
                event = await self._next(conn, stream)
                if isinstance(event, h11.Data):
                    size += len(event.data)
                    if size > MAX_ECHO_BODY:
                        await self._simple(conn, stream, 413, f"body larger than {MAX_ECHO_BODY} bytes\n")
                        raise _Closed
                    await spool.write(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    break
                else:
                    raise _Closed
            headers = [
                ("content-type", _header(request, b"content-type") or "application/octet-stream"),
                ("content-length", str(size)),
                ("x-echo-service", self.name),
                ("x-echo-cluster", self.cluster),
            ]
            await self._send(conn, stream, h11.Response(status_code=200, headers=headers))
            await spool.seek(0)
            while chunk := await spool.read(READ_SIZE):  # type: ignore[misc,var-annotated]  # typeshed's SpooledTemporaryFile.read takes no None, which trio's wrap_file protocol asks for
                await self._send(conn, stream, h11.Data(data=chunk))
            await self._send(conn, stream, h11.EndOfMessage())


def _header(request: h11.Request, name: bytes) -> str | None:
    for key, value in request.headers:
        if key == name:
            return bytes(value).decode("latin-1")
    return None


async def serve(
    host: str,
    port: int,
    name: str,
    cluster: str,
    *,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled; ``task_status.started`` gets the bound address."""
    service = EchoService(name, cluster)
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()[:2]
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, service.handle, listeners)
        task_status.started((bound[0], bound[1]))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m clusterproxy_cli.echo",
        description="HTTP/1.1 echo service: GET answers with JSON naming the service, cluster and path; "
        "POST/PUT/PATCH echo the body.",
    )
    add_flag(parser, "--listen", env="CLUSTER_PROXY_ECHO_LISTEN", type=parse_hostport, default="127.0.0.1:8080",
             help="address to listen on (port 0: any free port)")  # fmt: skip
    add_flag(
        parser, "--name", env="CLUSTER_PROXY_ECHO_NAME", default="echo", help="service name shown in answers"
    )
    add_flag(
        parser,
        "--cluster",
        env="CLUSTER_PROXY_ECHO_CLUSTER",
        default="",
        help="cluster name shown in answers",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args_or_exit(build_parser(), argv)
    host, port = args.listen
    cluster = args.cluster or args.name.rsplit("-", 1)[0]

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(serve, host, port, args.name, cluster)
            print(
                f"echo service {args.name} (cluster {cluster}) listening on {bound[0]}:{bound[1]}", flush=True
            )
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    return

    try:
        trio.run(run)
    except OSError as exc:
        print(f"echo: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
