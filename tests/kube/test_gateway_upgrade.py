"""Upgraded connections through the cluster-gateway: a real ``exec`` through the hub's aggregated API.

The path: the ``kubernetes`` Python client's ``stream()`` (WebSocket, ``v4.channel.k8s.io``) with a
kubeconfig from ``cluster-proxy kubeconfig`` -> the hub kube-apiserver's aggregator -> the gateway ->
the tunnel -> cluster1's kube-apiserver -> the kubelet of the pod's node. There is no kubelet in the
test clusters: tests/support/fake_kubelet.py stands in for one, and a Node in cluster1 points at it
(``status.addresses`` InternalIP 127.0.0.1, ``status.daemonEndpoints.kubeletEndpoint.port``). The test
API servers run without ``--kubelet-certificate-authority`` (tests/support/kubeapi.py), so cluster1
does not verify the fake kubelet's self-signed certificate, and without ``--kubelet-client-certificate``,
so it presents none.

The client offers ``v4.channel.k8s.io`` alone: offered ``v5.channel.k8s.io`` (the client's default,
and kubectl 1.30+'s), kube-apiserver translates the WebSocket into SPDY toward the kubelet, which a
WebSocket fake kubelet cannot serve.

The gateway's ServiceAccount in cluster1 may ``get``/``create`` ``pods/exec`` in the test's namespace
(v1.32 asks for both for a WebSocket exec); the hub admin calls the hub.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import os
import secrets
import ssl
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h11
import pytest
import trio
import trio.testing
from kubernetes import client, config

from clusterproxy_gateway.http import HTTPConnection
from clusterproxy_gateway.inventory import ClusterToken
from clusterproxy_gateway.proxy import ClusterProxy
from clusterproxy_gateway.server import GatewayServer
from clusterproxy_protocol.relay import relay_streams
from tests.support.fake_kubelet import running_fake_kubelet, serving_context
from tests.support.gateway_rig import (
    CHUNK,
    SA_NAME,
    SA_NAMESPACE,
    ExecRig,
    _cluster_kubeconfig,
    _exec,
    _hub_user,
    ignore_conflict,
    running_gateway,
)
from tests.support.kubeapi import KubeClusters
from tests.support.waiting import poll_until

STDIN_BYTES = 1 << 20


@pytest.fixture(scope="module")
def rig(kube_clusters: KubeClusters, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ExecRig]:
    directory = tmp_path_factory.mktemp("upgrade")
    with (
        running_gateway(kube_clusters, directory, ("cluster1",)) as gateway,
        running_fake_kubelet(directory / "kubelet") as kubelet,
    ):
        tag = gateway.stack.tag
        node, namespace, pod, container = f"fake-node-{tag}", f"exec-{tag}", "target", "main"
        with gateway.clusters["cluster1"].api.api_client() as admin:
            core = client.CoreV1Api(admin)
            core.create_node({"metadata": {"name": node}})
            core.patch_node_status(
                node,
                {
                    "status": {
                        "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
                        "daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet.port}},
                    }
                },
            )
            core.create_namespace({"metadata": {"name": namespace}})
            # the ServiceAccount admission wants the namespace's default ServiceAccount (no controller makes it)
            core.create_namespaced_service_account(namespace, {"metadata": {"name": "default"}})
            core.create_namespaced_pod(
                namespace,
                {
                    "metadata": {"name": pod},
                    "spec": {
                        "nodeName": node,
                        "automountServiceAccountToken": False,
                        "containers": [{"name": container, "image": "never-pulled"}],
                    },
                },
            )
            rbac = client.RbacAuthorizationV1Api(admin)
            role = "gateway-exec"
            ignore_conflict(
                lambda: rbac.create_namespaced_role(
                    namespace,
                    {
                        "metadata": {"name": role},
                        "rules": [
                            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
                            {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["get", "create"]},
                        ],
                    },
                )
            )
            ignore_conflict(
                lambda: rbac.create_namespaced_role_binding(
                    namespace,
                    {
                        "metadata": {"name": role},
                        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
                        "subjects": [{"kind": "ServiceAccount", "name": SA_NAME, "namespace": SA_NAMESPACE}],
                    },
                )
            )
        try:
            yield ExecRig(
                gateway,
                kubelet,
                gateway.clusters["cluster1"].name,
                namespace,
                pod,
                container,
                directory,
            )
        finally:
            with gateway.clusters["cluster1"].api.api_client() as admin:
                core = client.CoreV1Api(admin)
                core.delete_node(node)
                core.delete_namespace(namespace)


def _core(kubeconfig: Path) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))


def _refused(call: Any) -> tuple[int, str, dict[str, Any]]:
    """The status, Content-Type and JSON body of a WebSocket handshake answered without 101 (the client
    raises ApiException(status=0) carrying websocket-client's 'Handshake status N REASON -+-+- HEADERS
    -+-+- BODY')."""
    with pytest.raises(client.exceptions.ApiException) as raised:
        call()
    reason = str(raised.value.reason)
    assert reason.startswith("Handshake status "), reason
    head, headers, body = reason.split(" -+-+- ", 2)
    return (
        int(head.split()[2]),
        ast.literal_eval(headers).get("content-type", ""),
        json.loads(body),
    )


def _digest_exec(core: client.CoreV1Api, rig: ExecRig, stdin: bytes) -> float:
    """An exec of the fake kubelet's digest with ``stdin``, checked; the seconds it took."""
    command = ["digest", f"--marker={secrets.token_hex(4)}"]
    before = len(rig.kubelet.execs)
    started = time.monotonic()
    session = _exec(core, rig, command, stdin)
    seconds = time.monotonic() - started
    answer = json.loads(session.read_stdout())
    assert answer == {
        "sha256": hashlib.sha256(stdin).hexdigest(),
        "bytes": len(stdin),
        "command": command,
        "pod": f"{rig.namespace}/{rig.pod}/{rig.container}",
    }
    assert session.returncode == 0  # the channel-3 status Success, relayed
    assert [e.command for e in rig.kubelet.execs[before:]] == [command]
    assert not rig.kubelet.refused
    return seconds


@pytest.mark.slow
def test_exec_through_the_hub_carries_a_mebibyte_of_stdin_and_the_answer(rig: ExecRig) -> None:
    gateway = rig.gateway
    stdin = os.urandom(STDIN_BYTES)
    # the route to the fake kubelet itself, straight to cluster1 as its admin
    straight = _digest_exec(_core(gateway.clusters["cluster1"].api.kubeconfig), rig, stdin)
    through = _digest_exec(_core(_cluster_kubeconfig(gateway, rig.cluster)), rig, stdin)
    print(
        f"\nexec with 1 MiB of stdin: {through:.2f}s through the hub and the gateway, {straight:.2f}s straight"
    )

    def exec_request_done() -> bool:
        # logged once forward() returned: the relay over, both of its streams closed
        return any(
            r.get("event") == "request"
            and r.get("status") == 101
            and r.get("path", "").endswith(f"/pods/{rig.pod}/exec")
            for r in gateway.process.events()
        )

    poll_until(exec_request_done, timeout=10, what="the gateway's request record of the exec, status 101")
    upgraded = [r for r in gateway.process.events() if r.get("event") == "proxy_upgraded"]
    assert [(r.get("cluster"), r.get("protocol")) for r in upgraded] == [(rig.cluster, "websocket")]


@pytest.mark.slow
def test_exec_of_a_missing_pod_is_cluster1s_404_unchanged(rig: ExecRig) -> None:
    gateway = rig.gateway
    missing = f"missing-{secrets.token_hex(3)}"
    through = _refused(
        lambda: _exec(_core(_cluster_kubeconfig(gateway, rig.cluster)), rig, ["x"], b"", pod=missing)
    )
    straight = _refused(
        lambda: _exec(_core(gateway.clusters["cluster1"].api.kubeconfig), rig, ["x"], b"", pod=missing)
    )
    assert through[:2] == (404, "application/json"), through
    assert through[2]["message"] == f'pods "{missing}" not found', through
    assert through == straight


@pytest.mark.slow
def test_exec_by_a_hub_user_without_rbac_on_the_proxy_is_the_hubs_403(rig: ExecRig) -> None:
    gateway = rig.gateway
    user = f"no-proxy-{gateway.stack.tag}"
    kubeconfig = _cluster_kubeconfig(gateway, rig.cluster, _hub_user(gateway, user))
    before = len(rig.kubelet.execs)
    status, _, body = _refused(lambda: _exec(_core(kubeconfig), rig, ["x"], b"never"))
    assert status == 403, body
    assert body["reason"] == "Forbidden"
    assert f'User "{user}" cannot' in body["message"] and "clustergateways/proxy" in body["message"], body
    assert len(rig.kubelet.execs) == before


# --- the relay alone, on TLS and on half-closeable streams (fast) -----------------------------------------


@dataclass
class Relayed:
    caller: trio.abc.Stream  # the aggregator's end
    cluster: trio.abc.Stream  # the managed kube-apiserver's end
    done: trio.Event  # set when relay_streams() returned


async def _tls_pair(directory: Path) -> tuple[trio.SSLStream[Any], trio.SSLStream[Any]]:
    """Two ends of a TLS connection over an in-memory byte pipe (client, server)."""
    server_context, ca_pem = serving_context(directory)
    client_context = ssl.create_default_context(cadata=ca_pem.decode())
    client_raw, server_raw = trio.testing.memory_stream_pair()
    client_end = trio.SSLStream(client_raw, client_context, server_hostname="127.0.0.1")
    server_end = trio.SSLStream(server_raw, server_context, server_side=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client_end.do_handshake)
        nursery.start_soon(server_end.do_handshake)
    return client_end, server_end


@contextlib.asynccontextmanager
async def _relayed(tmp_path: Path, tls: bool) -> AsyncIterator[Relayed]:
    """relay_streams() running between a caller and a cluster, as the gateway runs it: over TLS on both sides
    (what the gateway has) or over half-closeable streams."""
    if tls:
        caller, gateway_down = await _tls_pair(tmp_path / "down")
        gateway_up, cluster = await _tls_pair(tmp_path / "up")
    else:
        caller, gateway_down = trio.testing.memory_stream_pair()
        gateway_up, cluster = trio.testing.memory_stream_pair()
    done = trio.Event()

    async def run() -> None:
        await relay_streams(gateway_down, gateway_up)
        done.set()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            yield Relayed(caller, cluster, done)
            await done.wait()  # the relay must end by itself once the test is over


async def _read_all(stream: trio.abc.Stream) -> bytes:
    """Everything until a clean end (b"")."""
    received = bytearray()
    while data := await stream.receive_some(CHUNK):
        received += data
    return bytes(received)


async def test_relay_over_tls_delivers_all_of_the_callers_bytes_then_its_close(tmp_path: Path) -> None:
    answer, upload = os.urandom(300_000), os.urandom(STDIN_BYTES)
    async with _relayed(tmp_path, tls=True) as relayed:
        await relayed.cluster.send_all(answer)  # the cluster speaks first (a kubelet's first frames)
        got = bytearray()
        while len(got) < len(answer):
            got += await relayed.caller.receive_some(CHUNK)
        assert bytes(got) == answer
        await relayed.caller.send_all(upload)
        await relayed.caller.aclose()
        assert await _read_all(relayed.cluster) == upload  # every byte, then a clean close_notify
        await relayed.done.wait()
        with pytest.raises((trio.BrokenResourceError, trio.ClosedResourceError)):
            for _ in range(100):  # the gateway closed: what the cluster still sends goes nowhere
                await relayed.cluster.send_all(b"late")
                await trio.sleep(0)
        await relayed.cluster.aclose()


async def test_relay_over_tls_delivers_all_of_the_clusters_bytes_then_its_close(tmp_path: Path) -> None:
    download = os.urandom(STDIN_BYTES)
    async with _relayed(tmp_path, tls=True) as relayed:
        await relayed.cluster.send_all(download)
        await relayed.cluster.aclose()
        assert await _read_all(relayed.caller) == download
        await relayed.caller.aclose()


async def test_relay_passes_a_half_close_on_and_keeps_the_other_direction(tmp_path: Path) -> None:
    question, answer = os.urandom(200_000), os.urandom(STDIN_BYTES)
    async with _relayed(tmp_path, tls=False) as relayed:
        assert isinstance(relayed.caller, trio.abc.HalfCloseableStream)
        assert isinstance(relayed.cluster, trio.abc.HalfCloseableStream)
        await relayed.caller.send_all(question)
        await relayed.caller.send_eof()
        assert await _read_all(relayed.cluster) == question
        assert not relayed.done.is_set()
        await relayed.cluster.send_all(answer)  # after the caller's end: still carried
        await relayed.cluster.send_eof()
        assert await _read_all(relayed.caller) == answer
        await relayed.done.wait()
        await relayed.caller.aclose()
        await relayed.cluster.aclose()


async def test_relay_ends_both_sides_when_one_breaks(tmp_path: Path) -> None:
    async with _relayed(tmp_path, tls=True) as relayed:
        await relayed.caller.send_all(b"partial")
        assert await relayed.cluster.receive_some(CHUNK) == b"partial"
        cluster = relayed.cluster
        assert isinstance(cluster, trio.SSLStream)
        await trio.aclose_forcefully(cluster.transport_stream)  # gone without close_notify: truncated
        await relayed.done.wait()
        with pytest.raises(trio.BrokenResourceError):  # a break, not a clean end the caller could trust
            await _read_all(relayed.caller)
        await relayed.caller.aclose()


# --- the upgrade exchange with scripted peers: the bytes behind each head (fast) ---------------------------
# The real exec cannot make a kube-apiserver send its first frames in the same read as its 101, nor the
# aggregator send frames behind its request: these peers do, byte for byte.

UPGRADE_REQUEST = (
    b"GET /api/v1/namespaces/ns/pods/p/exec?command=x HTTP/1.1\r\nHost: hub\r\nConnection: Upgrade\r\n"
    b"Upgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
    b"Sec-WebSocket-Protocol: v4.channel.k8s.io\r\nX-Remote-User: alice\r\n\r\n"
)
SWITCHED = (
    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\nSec-WebSocket-Protocol: v4.channel.k8s.io\r\n\r\n"
)
FORBIDDEN_BODY = b'{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"Forbidden","code":403}'


async def _until(stream: trio.abc.Stream, buffer: bytearray, marker: bytes) -> bytes:
    """Read into ``buffer`` until it holds ``marker``; what came up to and with it (taken out)."""
    while marker not in buffer:
        data = await stream.receive_some(CHUNK)
        assert data, f"the stream ended before {marker!r}; got {bytes(buffer)!r}"
        buffer += data
    end = buffer.index(marker) + len(marker)
    taken = bytes(buffer[:end])
    del buffer[:end]
    return taken


@contextlib.asynccontextmanager
async def _exchange(
    first_from_caller: bytes,
) -> AsyncIterator[tuple[trio.abc.Stream, trio.abc.Stream, list[int]]]:
    """ClusterProxy._exchange between a scripted caller (which has sent ``first_from_caller``) and a
    scripted cluster kube-apiserver; yields (caller, cluster, [the status it returns, once it did])."""
    caller, gateway_down = trio.testing.memory_stream_pair()
    gateway_up, cluster = trio.testing.memory_stream_pair()
    await caller.send_all(first_from_caller)
    http = HTTPConnection(gateway_down, h11.SERVER)
    event = await http.next_event()
    assert isinstance(event, h11.Request)
    request = GatewayServer._request(event)
    request.body = await http.read_body(1 << 20)
    proxy = ClusterProxy(None, None, proxy_server="unused")  # type: ignore[arg-type]
    token = ClusterToken("cluster1-token", b"", "kube.cluster1")
    returned: list[int] = []

    async def fail(code: int, message: str) -> int:
        raise AssertionError(f"the gateway failed the request: {code} {message}")

    async def run() -> None:
        returned.append(
            await proxy._exchange(http, request, "cluster1", request.path, token, gateway_up, fail, [])
        )

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            yield caller, cluster, returned


async def test_the_101_and_the_bytes_behind_each_head_reach_the_other_side() -> None:
    async with _exchange(UPGRADE_REQUEST + b"EARLY-FROM-CALLER") as (caller, cluster, returned):
        at_cluster = bytearray()
        head = (await _until(cluster, at_cluster, b"\r\n\r\n")).decode()
        assert head.startswith("GET /api/v1/namespaces/ns/pods/p/exec?command=x HTTP/1.1\r\n"), head
        lines = set(head.lower().split("\r\n"))
        assert {
            "authorization: bearer cluster1-token",
            "connection: upgrade",
            "upgrade: websocket",
            "sec-websocket-key: dghlihnhbxbszsbub25jzq==",
            "sec-websocket-protocol: v4.channel.k8s.io",
            "host: kube.cluster1",
        } <= lines, head
        assert "x-remote-user" not in head.lower()
        await cluster.send_all(SWITCHED + b"EARLY-FROM-CLUSTER")  # one write: the head and the first frame

        at_caller = bytearray()
        answer = (await _until(caller, at_caller, b"\r\n\r\n")).decode()
        assert answer.startswith("HTTP/1.1 101 "), answer
        assert {
            "upgrade: websocket",
            "connection: upgrade",
            "sec-websocket-accept: s3pplmbitxaq9kygzzhzrbk+xoo=",
            "sec-websocket-protocol: v4.channel.k8s.io",
        } <= set(answer.lower().split("\r\n")), answer
        assert await _until(caller, at_caller, b"EARLY-FROM-CLUSTER") == b"EARLY-FROM-CLUSTER"
        assert await _until(cluster, at_cluster, b"EARLY-FROM-CALLER") == b"EARLY-FROM-CALLER"

        await caller.send_all(b"later")
        assert await _until(cluster, at_cluster, b"later") == b"later"
        await cluster.send_all(b"last words")
        assert isinstance(cluster, trio.abc.HalfCloseableStream)
        await cluster.send_eof()
        assert await _read_all(caller) == b"last words"
        assert not returned  # the caller's direction is still open
        assert isinstance(caller, trio.abc.HalfCloseableStream)
        await caller.send_eof()
        assert await _read_all(cluster) == b""
    assert returned == [101]


async def test_a_refused_upgrade_is_passed_through_as_an_ordinary_answer() -> None:
    async with _exchange(UPGRADE_REQUEST) as (caller, cluster, returned):
        at_cluster = bytearray()
        await _until(cluster, at_cluster, b"\r\n\r\n")
        await cluster.send_all(
            b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/json\r\nAudit-Id: 42\r\n"
            + f"Content-Length: {len(FORBIDDEN_BODY)}\r\n\r\n".encode()
            + FORBIDDEN_BODY
        )
        at_caller = bytearray()
        answer = (await _until(caller, at_caller, b"\r\n\r\n")).decode()
        assert answer.startswith("HTTP/1.1 403 Forbidden\r\n"), answer
        assert {"content-type: application/json", "audit-id: 42"} <= set(answer.lower().split("\r\n")), answer
        assert "upgrade" not in answer.lower()
        while len(at_caller) < len(FORBIDDEN_BODY):
            at_caller += await caller.receive_some(CHUNK)
        assert bytes(at_caller) == FORBIDDEN_BODY
    assert returned == [403]
