"""The Go ``konnget`` peer (tests/go-konnectivity/konnget, upstream's ``konnectivity-client`` unchanged) as
the tests and the soak drive it: :func:`run_konnget` runs it against a hub's client port with the
client certificate and returns its JSON summary; :func:`answer_http` is the HTTP target it fetches
from inside the cluster (``GET /bytes/N`` with N pattern bytes, ``POST`` answered with the sha256 of
the body, ``GET /endless`` with a body that never ends, for a reader that stops reading).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import h11
import trio

from tests.support.procs import Hub
from tests.support.targets import Target, pattern


async def answer_http(stream: trio.SocketStream, _target: Target) -> None:
    """One HTTP/1.1 request on ``stream``: ``GET /bytes/N``, ``POST`` (any path), ``GET /endless``, else 404."""
    conn = h11.Connection(h11.SERVER)
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
            continue
        if isinstance(event, h11.ConnectionClosed | h11.EndOfMessage):
            return
        if not isinstance(event, h11.Request):
            return
        path = event.target.decode()
        if event.method == b"POST":
            digest = hashlib.sha256()
            while not isinstance(part := conn.next_event(), h11.EndOfMessage):
                if part is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
                elif isinstance(part, h11.Data):
                    digest.update(part.data)
            body = digest.hexdigest().encode()
            await stream.send_all(
                conn.send(h11.Response(status_code=200, headers=[("content-length", str(len(body)))]))
            )
            await stream.send_all(conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
            return
        if path.startswith("/bytes/"):
            size = int(path.removeprefix("/bytes/"))
            await stream.send_all(
                conn.send(h11.Response(status_code=200, headers=[("content-length", str(size))]))
            )
            for chunk in pattern(path, size):
                await stream.send_all(conn.send(h11.Data(data=chunk)))
            await stream.send_all(conn.send(h11.EndOfMessage()))
            return
        if path == "/endless":
            await stream.send_all(
                conn.send(h11.Response(status_code=200, headers=[("transfer-encoding", "chunked")]))
            )
            chunk = b"x" * 65536
            while True:
                await stream.send_all(conn.send(h11.Data(data=chunk)))
        await stream.send_all(conn.send(h11.Response(status_code=404, headers=[("content-length", "0")])))
        return


async def run_konnget(binary: Path, hub: Hub, *args: str, timeout: float = 120) -> dict[str, Any]:
    pki = hub.pki
    argv = [
        str(binary),
        "-proxy",
        f"127.0.0.1:{hub.client_port}",
        "-ca",
        str(pki.ca),
        "-cert",
        str(pki.client.cert),
        "-key",
        str(pki.client.key),
        *args,
    ]
    with trio.fail_after(timeout):
        done = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    assert done.returncode == 0, f"konnget {args} failed ({done.returncode}):\n{done.stderr.decode()}"
    return json.loads(done.stdout)
