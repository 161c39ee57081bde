"""Audit records (clusterproxy_protocol.audit) from a real proxy-server in-process, over real sockets:
one line per proxied connection from each frontend (HTTP/1.1 CONNECT, HTTP/2 CONNECT through the SDK,
konnectivity gRPC) with the bytes the client moved, one per refused dial (404, 403, 429) and per
connection refused as a whole (429), and a small rotating file that loses and splits no line."""

from __future__ import annotations

import hashlib
import json
import stat
from pathlib import Path
from typing import Any

import trio

from clusterproxy_protocol.audit import SCHEMA
from clusterproxy_sdk import TooManyRequests, open_tunnel
from clusterproxy_server.app import ProxyServer
from clusterproxy_server.frontends import konnectivity_pb2 as pb
from clusterproxy_server.quotas import QuotaSettings
from tests.support.clients import client_context, h1_connect
from tests.support.inprocess import run_wire_agent, start_server
from tests.support.konnectivity import close, dial, open_konnectivity, send_data
from tests.support.pki import PkiFiles
from tests.support.targets import CHUNK, Target, digest_transfer, pattern, pattern_digest, serve_digest
from tests.support.waiting import wait_until

SERVER_ID = "audit-test-server"
CLIENT = "CN=test-admin"
UP, DOWN = 300_001, 1_234_567  # not multiples of any chunk or frame size


def records(path: Path) -> list[dict[str, Any]]:
    """Every record of ``path`` and its rotated files, oldest first."""
    files = [*sorted(path.parent.glob(path.name + ".*"), key=lambda p: -int(p.suffix[1:])), path]
    lines = [line for f in files if f.exists() for line in f.read_text().splitlines()]
    return [json.loads(line) for line in lines]


async def audited_server(
    nursery: trio.Nursery, pki: PkiFiles, log: Path, spec: str | None = None, **overrides: Any
) -> tuple[ProxyServer, int, Target]:
    """A server writing its audit records to ``log`` (or as ``spec`` says), its agent, a digest target."""
    server, bound = await start_server(
        nursery, pki, server_id=SERVER_ID, audit_log=spec or str(log), **overrides
    )
    target = await serve_digest(nursery)
    nursery.start_soon(run_wire_agent, bound.agent[1], pki, "cluster1", "agent-a")
    await wait_until(lambda: server.registry.tunnels("cluster1"), what="the agent's tunnel")
    return server, bound.client[1], target


async def one_record(log: Path, **match: Any) -> dict[str, Any]:
    """The one record matching ``match``, once written (a relay's record comes when both ends closed)."""

    def found() -> list[dict[str, Any]]:
        return [r for r in records(log) if all(r.get(k) == v for k, v in match.items())]

    await wait_until(found, what=f"an audit record with {match}")
    (record,) = found()
    return record


def check_transfer(record: dict[str, Any], target: Target, frontend: str, up: int) -> None:
    assert record["schema"] == SCHEMA
    assert record["frontend"] == frontend
    assert record["client"] == CLIENT and record["client_kind"] == "certificate"
    assert record["cluster"] == "cluster1" and record["target"] == target.address
    assert record["agent_id"] == "agent-a" and record["server_id"] == SERVER_ID
    assert (record["outcome"], record["status"], record["reason"]) == ("ok", 200, None)
    assert (record["bytes_to_target"], record["bytes_to_client"]) == (up, DOWN)
    assert record["duration_seconds"] >= 0 and record["time"].endswith("Z")


async def test_each_frontend_leaves_one_record_with_the_bytes_the_client_moved(
    nursery: trio.Nursery, pki: PkiFiles, tmp_path: Path
) -> None:
    log = tmp_path / "logs" / "audit.jsonl"
    _server, port, target = await audited_server(nursery, pki, log)
    assert stat.S_IMODE(log.stat().st_mode) == 0o600

    # HTTP/2: the SDK
    async with open_tunnel(f"127.0.0.1:{port}", pki.sdk_files(), server_hostname="localhost") as tunnel:
        await digest_transfer(tunnel, target, "via-h2", UP, DOWN)
    line = len(f"via-h2 {DOWN}\n")
    check_transfer(await one_record(log, frontend="h2"), target, "h2", line + UP)

    # HTTP/1.1 CONNECT: the client's TLS cannot half-close, so it reads everything, then closes
    reply = await h1_connect(
        port,
        client_context(pki, alpn=["http/1.1"]),
        target.address,
        {"cluster-proxy-cluster": "cluster1"},
    )
    assert reply.status == 200 and reply.stream is not None
    stream, upload = reply.stream, f"via-h1 {DOWN}\n".encode() + b"".join(pattern("via-h1-up", UP))
    received = hashlib.sha256()
    count = 0

    async def receive() -> None:
        nonlocal count
        while count < DOWN and (data := await stream.receive_some(CHUNK)):
            received.update(data)
            count += len(data)

    async with trio.open_nursery() as both:
        both.start_soon(stream.send_all, upload)
        both.start_soon(receive)
    await stream.aclose()
    assert count == DOWN and received.hexdigest() == pattern_digest("via-h1", DOWN)
    await wait_until(lambda: "via-h1" in target.received, what="the upload's digest")
    assert target.received["via-h1"] == pattern_digest("via-h1-up", UP)
    check_transfer(await one_record(log, frontend="http1"), target, "http1", len(upload))

    # konnectivity gRPC: DIAL_REQ, DATA both ways, CLOSE_REQ once everything has come back
    async with trio.open_nursery() as grpc:
        client = await open_konnectivity(
            grpc, port, client_context(pki, alpn=["h2"]), [("cluster-proxy-cluster", "cluster1")]
        )
        answer = await dial(client, target.address)
        assert answer.error == "" and answer.connectID
        upload = f"via-grpc {DOWN}\n".encode() + b"".join(pattern("via-grpc-up", UP))
        got = hashlib.sha256()
        count = 0

        async def receive_packets() -> None:
            nonlocal count
            while count < DOWN:
                packet = await client.next_packet()
                if packet.type == pb.DATA:
                    got.update(packet.data.data)
                    count += len(packet.data.data)

        async with trio.open_nursery() as both:
            both.start_soon(send_data, client, answer.connectID, upload)
            both.start_soon(receive_packets)
        await close(client, answer.connectID)
        while (await client.next_packet()).type != pb.CLOSE_RSP:
            pass
        await client.end()
        grpc.cancel_scope.cancel()
    assert count == DOWN and got.hexdigest() == pattern_digest("via-grpc", DOWN)
    check_transfer(await one_record(log, frontend="konnectivity"), target, "konnectivity", len(upload))
    assert target.received["via-grpc"] == pattern_digest("via-grpc-up", UP)
    assert len(records(log)) == 3  # one per connection, nothing else


async def test_refused_dials_leave_a_record_with_the_status_and_the_reason(
    nursery: trio.Nursery, pki: PkiFiles, tmp_path: Path
) -> None:
    policy = tmp_path / "policy.json"
    policy.write_text(
        json.dumps({"rules": [{"subject": "CN=test-admin", "clusters": ["cluster1", "nowhere"]}]})
    )
    log = tmp_path / "audit.jsonl"
    _server, port, _target = await audited_server(nursery, pki, log, client_policy=policy)
    context = client_context(pki, alpn=["http/1.1"])

    unknown = await h1_connect(port, context, "10.0.0.1:443", {"cluster-proxy-cluster": "nowhere"})
    forbidden = await h1_connect(port, context, "10.0.0.2:443", {"cluster-proxy-cluster": "cluster2"})
    assert (unknown.status, forbidden.status) == (404, 403)
    # konnectivity tells a refusal by its text: the record still has the status
    async with trio.open_nursery() as grpc:
        client = await open_konnectivity(
            grpc, port, client_context(pki, alpn=["h2"]), [("cluster-proxy-cluster", "cluster2")]
        )
        answer = await dial(client, "10.0.0.3:443")
        await client.end()
        grpc.cancel_scope.cancel()
    assert "cluster2" in answer.error

    for record, status, frontend, cluster in [
        (await one_record(log, target="10.0.0.1:443"), 404, "http1", "nowhere"),
        (await one_record(log, target="10.0.0.2:443"), 403, "http1", "cluster2"),
        (await one_record(log, target="10.0.0.3:443"), 403, "konnectivity", "cluster2"),
    ]:
        assert record["outcome"] == "refused" and record["status"] == status, record
        assert record["frontend"] == frontend and record["cluster"] == cluster
        assert record["client"] == CLIENT and record["server_id"] == SERVER_ID
        assert record["agent_id"] is None  # refused before any agent was asked
        assert record["bytes_to_target"] == record["bytes_to_client"] == 0
        assert (
            record["reason"] and record["reason"] in (unknown.body + forbidden.body).decode() + answer.error
        )
    assert "nowhere" in unknown.body.decode()


async def test_quota_refusals_of_a_stream_and_of_a_whole_connection_leave_a_record(
    nursery: trio.Nursery, pki: PkiFiles, tmp_path: Path
) -> None:
    log = tmp_path / "audit.jsonl"
    _server, port, target = await audited_server(
        nursery, pki, log, quotas=QuotaSettings(max_connections=1, max_streams=1)
    )
    async with open_tunnel(f"127.0.0.1:{port}", pki.sdk_files(), server_hostname="localhost") as tunnel:
        held = await tunnel.connect("cluster1", target.host, target.port)
        try:
            await tunnel.connect("cluster1", target.host, target.port)
        except TooManyRequests as exc:
            stream_reason = exc.reason
        else:
            raise AssertionError("a second stream over --client-max-concurrent-streams 1 was admitted")
        # a second connection of the same identity: refused as a whole, before any request is read
        refused = await h1_connect(
            port,
            client_context(pki, alpn=["http/1.1"]),
            target.address,
            {"cluster-proxy-cluster": "cluster1"},
        )
        await held.aclose()
    assert refused.status == 429
    stream_record = await one_record(log, outcome="refused", frontend="h2")
    assert stream_record["status"] == 429 and stream_record["reason"] == stream_reason
    assert stream_record["target"] == target.address and stream_record["cluster"] == "cluster1"
    connection_record = await one_record(log, outcome="refused", frontend="http1")
    assert connection_record["status"] == 429 and connection_record["reason"] in refused.body.decode()
    assert connection_record["target"] == "" and connection_record["cluster"] is None
    assert connection_record["client"] == CLIENT and connection_record["server_id"] == SERVER_ID
    # the held stream, closed without a byte either way, is a record too
    held_record = await one_record(log, outcome="ok")
    assert (held_record["bytes_to_target"], held_record["bytes_to_client"]) == (0, 0)


async def test_a_small_file_rotates_without_losing_or_splitting_a_line(
    nursery: trio.Nursery, pki: PkiFiles, tmp_path: Path
) -> None:
    log = tmp_path / "audit.jsonl"
    streams = 40  # ~420 bytes a record: ~17 KB, rotated at 2 KiB: every file kept (keep=20)
    _server, port, target = await audited_server(nursery, pki, log, spec=f"{log}:max=2KiB,keep=20")
    async with open_tunnel(f"127.0.0.1:{port}", pki.sdk_files(), server_hostname="localhost") as tunnel:
        for i in range(streams):
            await digest_transfer(tunnel, target, f"rotate-{i:02d}", 10 * i, i)
    await wait_until(lambda: len(records(log)) == streams, what=f"{streams} records")
    rotated = sorted(tmp_path.glob("audit.jsonl.*"))
    assert len(rotated) >= 5, rotated
    for path in [log, *rotated]:
        content = path.read_bytes()
        assert len(content) <= 2048 and content.endswith(b"\n"), path  # whole lines only
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    got = records(log)  # every line parses (none split), oldest file first: in order
    assert [r["bytes_to_client"] for r in got] == list(range(streams))
    assert [r["bytes_to_target"] for r in got] == [
        len(f"rotate-{i:02d} {i}\n") + 10 * i for i in range(streams)
    ]
