"""An HTTPS target that answers the requests kubectl makes, for tests of kubectl through the proxy
before a real kube-apiserver is in the suite: discovery (``/api``, ``/apis``, ``/api/v1``),
``/version`` and ``/api/v1/namespaces`` (one namespace named after the cluster), with a bearer token.
``/blob/<token>/<size>`` answers ``size`` pattern bytes (tests.support.targets.pattern) for downloads.
HTTP/1.1 with keep-alive (h11); its own CA, so a client must trust it and the hub's CA at once."""

from __future__ import annotations

import json
import ssl
from dataclasses import dataclass, field
from pathlib import Path

import h11
import trio

from clusterproxy_protocol.pki import DevCA
from tests.support.targets import Target, pattern, serve


@dataclass
class KubeTarget:
    target: Target
    ca: Path  # the CA that signed the target's serving certificate
    token: str
    requests: list[tuple[str, str, str]] = field(default_factory=list)  # (method, path, authorization)

    @property
    def url(self) -> str:
        return f"https://{self.target.address}"


def _resource_list() -> dict:
    return {
        "kind": "APIResourceList",
        "groupVersion": "v1",
        "resources": [
            {
                "name": "namespaces",
                "singularName": "namespace",
                "namespaced": False,
                "kind": "Namespace",
                "verbs": ["get", "list"],
                "shortNames": ["ns"],
            }
        ],
    }


def _answers(cluster: str) -> dict[str, dict]:
    return {
        "/version": {
            "major": "1",
            "minor": "32",
            "gitVersion": f"v1.32.0-fake-{cluster}",
            "platform": "linux/amd64",
        },
        "/api": {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []},
        "/apis": {"kind": "APIGroupList", "apiVersion": "v1", "groups": []},
        "/api/v1": _resource_list(),
        "/api/v1/namespaces": {
            "kind": "NamespaceList",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": "1"},
            "items": [
                {
                    "kind": "Namespace",
                    "apiVersion": "v1",
                    "metadata": {"name": f"inside-{cluster}", "uid": "1", "resourceVersion": "1"},
                    "status": {"phase": "Active"},
                }
            ],
        },
    }


async def serve_kube_target(nursery: trio.Nursery, directory: Path, cluster: str, token: str) -> KubeTarget:
    ca = DevCA.create_or_load(directory / f"{cluster}-apiserver-ca", name=f"{cluster}-apiserver-ca")
    pair = ca.issue_server("kube-apiserver", ["127.0.0.1", "localhost"], directory / f"{cluster}-apiserver")
    # Like a kube-apiserver authenticating by token: no client certificate asked for.
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(pair.cert, pair.key)
    context.set_alpn_protocols(["http/1.1"])
    answers = _answers(cluster)
    kube = KubeTarget(target=Target("", 0), ca=ca.ca_path, token=token)

    async def send(stream: trio.SSLStream, conn: h11.Connection, status: int, body: bytes, kind: str) -> None:
        headers = [("content-type", kind), ("content-length", str(len(body)))]
        await stream.send_all(conn.send(h11.Response(status_code=status, headers=headers)))
        await stream.send_all(conn.send(h11.Data(data=body)))
        await stream.send_all(conn.send(h11.EndOfMessage()))

    async def send_blob(stream: trio.SSLStream, conn: h11.Connection, name: str, size: int) -> None:
        headers = [("content-type", "application/octet-stream"), ("content-length", str(size))]
        await stream.send_all(conn.send(h11.Response(status_code=200, headers=headers)))
        for chunk in pattern(name, size):
            await stream.send_all(conn.send(h11.Data(data=chunk)))
        await stream.send_all(conn.send(h11.EndOfMessage()))

    async def answer(stream: trio.SSLStream, conn: h11.Connection, request: h11.Request) -> None:
        path = request.target.decode().split("?", 1)[0]
        authorization = dict((k.decode(), v.decode()) for k, v in request.headers).get("authorization", "")
        kube.requests.append((request.method.decode(), path, authorization))
        if path.startswith("/blob/"):
            _, _, name, size = path.split("/", 3)
            await send_blob(stream, conn, name, int(size))
        elif path != "/version" and authorization != f"Bearer {token}":
            await send(stream, conn, 401, b'{"kind":"Status","code":401}', "application/json")
        elif path in answers:
            await send(stream, conn, 200, json.dumps(answers[path]).encode(), "application/json")
        else:
            await send(stream, conn, 404, b'{"kind":"Status","code":404}', "application/json")

    async def connection(tcp: trio.SocketStream, _: Target) -> None:
        stream = trio.SSLStream(tcp, context, server_side=True, https_compatible=True)
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
                elif isinstance(event, h11.Request):
                    await answer(stream, conn, event)
                elif isinstance(event, h11.EndOfMessage) and conn.our_state is h11.DONE:
                    conn.start_next_cycle()
                elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                    return
        except (h11.ProtocolError, ssl.SSLError):
            return

    kube.target = await serve(nursery, connection)
    return kube
