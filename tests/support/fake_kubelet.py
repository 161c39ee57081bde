"""A stand-in kubelet for ``exec``: the test API servers have no kubelet, so exec has nothing to reach.

kube-apiserver serves ``pods/NAME/exec`` by dialing the kubelet of the pod's node (the Node's
``status.addresses`` and ``status.daemonEndpoints.kubeletEndpoint.port``) at
``/exec/NAMESPACE/POD/CONTAINER?command=...&input=1&output=1...``. A WebSocket request offering
``v4.channel.k8s.io`` (and not ``v5.channel.k8s.io``, which kube-apiserver v1.30+ translates to SPDY
for the kubelet) is proxied to the kubelet as it came; this server accepts it over TLS (a self-signed
certificate: kube-apiserver started without ``--kubelet-certificate-authority`` does not verify the
kubelet's certificate).

What it does with an exec (v4 framing: the first byte of each binary message is the channel): every
channel-0 (stdin) message is stdin; an empty one (the channel byte alone) ends stdin, since v4 has no
way to close a channel. It then answers on channel 1 (stdout) with one JSON line ``{"sha256": hex of
all stdin bytes, "bytes": count, "command": [the command query parameters], "pod": "NS/POD/CONTAINER"}``,
on channel 3 (the status channel) with ``{"metadata":{},"status":"Success"}``, and closes.

Usage::

    with running_fake_kubelet(directory) as kubelet:
        kubelet.port               # 127.0.0.1:<port>, TLS
        kubelet.execs              # one ExecRecord per exec that completed
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import trio
from trio_websocket import ConnectionClosed, WebSocketRequest, serve_websocket

from clusterproxy_gateway.credentials import make_self_signed

__all__ = ["STATUS_SUCCESS", "SUBPROTOCOL", "ExecRecord", "FakeKubelet", "running_fake_kubelet"]

SUBPROTOCOL = "v4.channel.k8s.io"
STDIN, STDOUT, STATUS = 0, 1, 3
STATUS_SUCCESS = {"metadata": {}, "status": "Success"}
MAX_MESSAGE = 4 << 20
START_TIMEOUT = 10.0


@dataclass
class ExecRecord:
    pod: str  # NAMESPACE/POD/CONTAINER from the path
    command: list[str]
    sha256: str
    received: int


@dataclass
class FakeKubelet:
    port: int = 0
    execs: list[ExecRecord] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # paths or subprotocols it would not serve


def serving_context(directory: Path) -> tuple[ssl.SSLContext, bytes]:
    """A server context for 127.0.0.1 with a fresh certificate (the gateway's own self-signed CA and
    leaf, files in ``directory``), and that CA's PEM for a client to trust."""
    serving = make_self_signed(directory, ["127.0.0.1"])
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(serving.cert), str(serving.key))
    context.set_alpn_protocols(["http/1.1"])
    return context, serving.ca_pem


async def _serve_exec(kubelet: FakeKubelet, request: WebSocketRequest) -> None:
    target = urlsplit(request.path)
    parts = target.path.strip("/").split("/")
    if len(parts) != 4 or parts[0] != "exec" or SUBPROTOCOL not in request.proposed_subprotocols:
        kubelet.refused.append(f"{request.path} {list(request.proposed_subprotocols)}")
        await request.reject(404, body=b"the fake kubelet serves only /exec/NS/POD/CONTAINER over v4\n")
        return
    command = parse_qs(target.query).get("command", [])
    websocket = await request.accept(subprotocol=SUBPROTOCOL)
    digest = hashlib.sha256()
    received = 0
    try:
        while True:
            message = await websocket.get_message()
            if isinstance(message, str):
                message = message.encode()
            if not message or message[0] != STDIN:
                continue
            if len(message) == 1:
                break  # stdin ended
            digest.update(message[1:])
            received += len(message) - 1
        record = ExecRecord("/".join(parts[1:]), command, digest.hexdigest(), received)
        answer = {"sha256": record.sha256, "bytes": received, "command": command, "pod": record.pod}
        await websocket.send_message(bytes([STDOUT]) + json.dumps(answer).encode() + b"\n")
        await websocket.send_message(bytes([STATUS]) + json.dumps(STATUS_SUCCESS).encode())
        kubelet.execs.append(record)
        await websocket.aclose()
    except ConnectionClosed:
        pass  # the client went away before stdin ended: nothing to answer


@contextlib.contextmanager
def running_fake_kubelet(directory: Path) -> Iterator[FakeKubelet]:
    """The fake kubelet on 127.0.0.1 (a port of its own choosing), in a thread with its own trio loop."""
    context, _ = serving_context(directory)
    kubelet = FakeKubelet()
    ready = threading.Event()
    failure: list[BaseException] = []
    control: dict[str, object] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            control["token"] = trio.lowlevel.current_trio_token()
            control["scope"] = nursery.cancel_scope

            async def handler(request: WebSocketRequest) -> None:
                await _serve_exec(kubelet, request)

            server = await nursery.start(
                lambda task_status: serve_websocket(
                    handler,
                    "127.0.0.1",
                    0,
                    ssl_context=context,
                    handler_nursery=nursery,
                    max_message_size=MAX_MESSAGE,
                    task_status=task_status,
                )
            )
            kubelet.port = server.port
            ready.set()

    def run() -> None:
        try:
            trio.run(main)
        except BaseException as exc:  # reported to the test, which would otherwise wait for `ready`
            failure.append(exc)
            ready.set()

    thread = threading.Thread(target=run, name="fake-kubelet", daemon=True)
    thread.start()
    if not ready.wait(START_TIMEOUT) or failure:
        raise RuntimeError(f"the fake kubelet did not start: {failure[0] if failure else 'timeout'}")
    try:
        yield kubelet
    finally:
        scope = control["scope"]
        assert isinstance(scope, trio.CancelScope)
        token = control["token"]
        assert isinstance(token, trio.lowlevel.TrioToken)
        with contextlib.suppress(trio.RunFinishedError):
            trio.from_thread.run_sync(scope.cancel, trio_token=token)
        thread.join(START_TIMEOUT)
        assert not thread.is_alive(), "the fake kubelet's thread did not stop"
