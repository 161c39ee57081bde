"""A ``cluster-proxy port-forward`` process outlives its 60 s client certificates.

``cluster-proxy local up --cert-ttl 60s`` runs the hub (its own process tree; local up itself renews
the local admin files the port-forward uses, with its cert-signer); ``cluster-proxy port-forward
--state-dir`` runs as a process too, reaching the proxy-server through a TCP relay in this test so
that the test can cut its tunnel. For five minutes a new TCP connection goes through the port-forward
about every second, each POSTing 64 KiB of random bytes to cluster1's echo service and checking the
sha256 of what comes back. Each time the certificate the current tunnel presented has expired, the
relay cuts the tunnel between two connections: the next connection must make the port-forward dial
again, presenting the renewed certificate (a new serial, issued by the signer to local-admin, not yet
expired), which the proxy-server must accept.

``CLUSTER_PROXY_PF_SOAK_SECONDS`` (default 300) shortens the run for a quick look; ``pytest -s``
prints the counts as a table and as JSON.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio
from cryptography import x509

from clusterproxy_cli.state import proxy_settings
from clusterproxy_protocol import http1client
from tests.support.localup import LocalUp
from tests.support.procs import BIN, json_records
from tests.support.soak import print_report
from tests.support.waiting import wait_at_most

SOAK_SECONDS = float(os.environ.get("CLUSTER_PROXY_PF_SOAK_SECONDS", "300"))
CERT_TTL_SECONDS = 60
INTERVAL = 1.0  # a new connection through the port-forward this often
BODY_SIZE = 64 << 10
CONNECTION_DEADLINE = 20.0
# Cut the tunnel this long after the certificate it presented expired (the file timestamps and the
# test's clock are the same machine's: a second is plenty).
EXPIRY_MARGIN = 1.0

pytestmark = [pytest.mark.slow, pytest.mark.clock_bound, pytest.mark.timeout(SOAK_SECONDS + 240)]


# --- the processes -----------------------------------------------------------------------------------


async def start_port_forward(
    state: Path, target: str, relay_port: int, log: Path
) -> tuple[trio.Process, int]:
    with log.open("wb") as err:
        process = await trio.lowlevel.open_process(
            [
                str(BIN / "cluster-proxy"),
                "port-forward",
                "cluster1",
                target,
                "--listen",
                "127.0.0.1:0",
                "--state-dir",
                str(state),
                "--proxy",
                f"127.0.0.1:{relay_port}",
            ],
            stdout=subprocess.PIPE,
            stderr=err,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    assert process.stdout is not None
    line = b""
    with trio.fail_after(20):
        while not line.endswith(b"\n"):
            chunk = await process.stdout.receive_some(1)
            assert chunk, f"port-forward exited before its Forwarding line: {log.read_text()}"
            line += chunk
    # "Forwarding from 127.0.0.1:PORT -> cluster1/HOST:PORT"
    return process, int(line.decode().split()[2].rsplit(":", 1)[1])


async def stop(process: trio.Process, signum: int) -> int:
    if process.returncode is None:
        process.send_signal(signum)
    with trio.fail_after(30):
        return await process.wait()


# --- the relay ---------------------------------------------------------------------------------------


@dataclass
class CuttableRelay:
    """A TCP relay in front of the proxy-server's client port. :meth:`cut` closes every relayed
    connection at once, as a network failure or a restarted server would."""

    target: tuple[str, int]
    port: int = 0
    connections: int = 0
    cuts: int = 0
    _scopes: set[trio.CancelScope] = field(default_factory=set)

    async def run(self, *, task_status: trio.TaskStatus[int]) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._relay, listeners)

    async def _relay(self, client: trio.SocketStream) -> None:
        self.connections += 1
        server = await trio.open_tcp_stream(*self.target)
        with trio.CancelScope() as scope:
            self._scopes.add(scope)
            try:
                async with trio.open_nursery() as nursery:

                    async def pump(source: trio.SocketStream, sink: trio.SocketStream) -> None:
                        try:
                            while data := await source.receive_some(1 << 16):
                                await sink.send_all(data)
                        except (trio.BrokenResourceError, trio.ClosedResourceError):
                            pass
                        nursery.cancel_scope.cancel()  # one side gone: the relayed connection is over

                    nursery.start_soon(pump, client, server)
                    nursery.start_soon(pump, server, client)
            finally:
                self._scopes.discard(scope)
        await trio.aclose_forcefully(client)
        await trio.aclose_forcefully(server)

    def cut(self) -> int:
        """Close every relayed connection; returns how many there were."""
        scopes = list(self._scopes)
        for scope in scopes:
            scope.cancel()
        self.cuts += 1
        return len(scopes)


# --- traffic -----------------------------------------------------------------------------------------


async def post_through(port: int, target: str, number: int) -> tuple[str | None, int]:
    """POST random bytes to the echo service through the port-forward; (error or None, bytes checked)."""
    body = os.urandom(BODY_SIZE)
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        response = await http1client.request(
            stream,
            "POST",
            f"/port-forward/{number}",
            target,
            body,
            headers=[("content-type", "application/octet-stream")],
            max_body=2 * BODY_SIZE,
        )
    status, received = response.status, response.body
    if status != 200:
        return f"connection {number}: HTTP {status}", 0
    if hashlib.sha256(received).digest() != hashlib.sha256(body).digest():
        return f"connection {number}: {len(received)} bytes back, sha256 differs from the {len(body)} sent", 0
    return None, len(body) * 2


def serial_of(path: Path) -> str:
    return format(x509.load_pem_x509_certificate(path.read_bytes()).serial_number, "x")


@dataclass
class Cut:
    at: float  # seconds into the run
    expired_serial: str
    expired_at: str
    tunnels_cut: int


# --- the test ----------------------------------------------------------------------------------------


async def test_port_forward_keeps_forwarding_past_its_certificates_lifetime(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    state = tmp_path / "state"
    local = await LocalUp.start(state, tmp_path / "local-up.out", "--cert-ttl", f"{CERT_TTL_SECONDS}s")
    port_forward: trio.Process | None = None
    try:
        doc = local.description()
        proxy = proxy_settings(doc)
        target = doc["clusters"]["cluster1"]["targets"][0]["address"]
        relay = CuttableRelay((proxy.host, proxy.port))
        relay_port = await nursery.start(relay.run)
        pf_log = tmp_path / "port-forward.log"
        port_forward, local_port = await start_port_forward(state, target, relay_port, pf_log)

        made = failed = checked_bytes = 0
        failures: list[str] = []
        latencies: list[float] = []
        cuts: list[Cut] = []
        admin_serials_seen = [serial_of(proxy.cert)]
        started = time.monotonic()
        number = 0
        while (elapsed := time.monotonic() - started) < SOAK_SECONDS:
            await trio.sleep(max(0.0, started + number * INTERVAL - time.monotonic()))  # pacing
            number += 1
            tunnels = json_records(pf_log, "tunnel_connected")
            assert tunnels, pf_log.read_text()
            presented_until = dt.datetime.fromisoformat(tunnels[-1]["client_cert_not_after"])
            if dt.datetime.now(dt.UTC) > presented_until + dt.timedelta(seconds=EXPIRY_MARGIN):
                # Between two connections, so that no stream of this test is cut with the tunnel.
                cuts.append(
                    Cut(
                        round(elapsed, 1),
                        tunnels[-1]["client_cert_serial"],
                        tunnels[-1]["client_cert_not_after"],
                        relay.cut(),
                    )
                )
            begin = time.monotonic()
            try:
                with trio.fail_after(CONNECTION_DEADLINE):
                    error, nbytes = await post_through(local_port, target, number)
            except (OSError, trio.BrokenResourceError, trio.TooSlowError, http1client.HTTPClientError) as exc:
                error, nbytes = f"connection {number}: {type(exc).__name__}: {exc}", 0
            latencies.append(time.monotonic() - begin)
            made += 1
            checked_bytes += nbytes
            if error is not None:
                failed += 1
                failures.append(f"{elapsed:.1f}s {error}")
            current = serial_of(proxy.cert)
            if current != admin_serials_seen[-1]:
                admin_serials_seen.append(current)
        duration = time.monotonic() - started
        # The port-forward logs a connection once both directions ended, which can be just after the
        # client read its answer.
        await wait_at_most(
            lambda: len(json_records(pf_log, "connection_closed")) >= made, timeout=10, interval=0.05
        )

        tunnels = json_records(pf_log, "tunnel_connected")
        presented = [t["client_cert_serial"] for t in tunnels]
        issued = {
            e["serial"]: e
            for e in local.events("cert-signer", "cert_issued")
            if e.get("identity") == "client:local-admin"
        }
        local_up_renewals = [
            e for e in json_records(local.output, "cert_renewed") if e.get("subject") == "CN=local-admin"
        ]
        server_log = state / "logs" / "proxy-server.log"
        client_handshake_failures = [
            e for e in json_records(server_log, "tls_handshake_failed") if e.get("port") == "client"
        ]
        closed = json_records(pf_log, "connection_closed")
        latencies.sort()
        report = {
            "duration_s": round(duration, 1),
            "connections_made": made,
            "connections_failed": failed,
            "bytes_checked": checked_bytes,
            "connection_latency_p50_ms": round(latencies[len(latencies) // 2] * 1000, 1),
            "connection_latency_max_ms": round(latencies[-1] * 1000, 1),
            "local_admin_renewals_logged_by_local_up": len(local_up_renewals),
            "local_admin_serials_seen_on_disk": len(admin_serials_seen),
            "tunnel_cuts": [c.__dict__ for c in cuts],
            "tunnels_dialed": len(tunnels),
            "relay_connections": relay.connections,
            "serials_presented": presented,
            "port_forward_reloads": len(json_records(pf_log, "client_tls_reloaded")),
            "port_forward_reload_failures": len(json_records(pf_log, "client_tls_reload_failed")),
            "port_forward_tunnel_unavailable": len(json_records(pf_log, "tunnel_unavailable")),
            "port_forward_connect_refused": len(json_records(pf_log, "connect_refused")),
            "port_forward_connections_closed_with_error": sum(1 for e in closed if e.get("error")),
            "server_client_handshake_failures": len(client_handshake_failures),
            "server_stream_failed": len(json_records(server_log, "stream_failed")),
            "failures": failures[:20],
        }
        print_report(f"port-forward with {CERT_TTL_SECONDS}s client certificates ({SOAK_SECONDS:g}s)", report)

        assert failed == 0, failures[:20]
        assert made >= 0.9 * SOAK_SECONDS / INTERVAL
        assert len(closed) == made and report["port_forward_connections_closed_with_error"] == 0
        assert report["port_forward_tunnel_unavailable"] == 0 and report["port_forward_connect_refused"] == 0
        assert report["server_client_handshake_failures"] == 0, client_handshake_failures
        assert report["server_stream_failed"] == 0
        # The certificate of local-admin was renewed by local up while the port-forward ran.
        assert len(local_up_renewals) >= int(SOAK_SECONDS // CERT_TTL_SECONDS)
        assert len(admin_serials_seen) >= len(local_up_renewals)
        # Every tunnel was dialed at start or after a cut (nothing else reconnected), and each cut
        # came after the certificate of the cut tunnel had expired.
        assert len(cuts) >= max(1, int(SOAK_SECONDS // (CERT_TTL_SECONDS * 1.1)) - 1)
        assert relay.connections == len(tunnels) == len(cuts) + 1
        assert [c.expired_serial for c in cuts] == presented[:-1]
        # Each re-dial presented a different certificate, one the signer issued to local-admin, still
        # valid when it was presented; the server accepted every one of them.
        assert len(set(presented)) == len(presented), presented
        assert set(presented) <= set(issued), (presented, sorted(issued))
        for tunnel in tunnels:
            dialed = dt.datetime.fromisoformat(tunnel["timestamp"])
            assert dialed < dt.datetime.fromisoformat(tunnel["client_cert_not_after"]), tunnel
        for cut, tunnel in zip(cuts, tunnels[1:], strict=True):
            assert dt.datetime.fromisoformat(cut.expired_at) < dt.datetime.fromisoformat(tunnel["timestamp"])
    finally:
        if port_forward is not None:
            code = await stop(port_forward, signal.SIGTERM)
            assert code == 0, (tmp_path / "port-forward.log").read_text()[-3000:]
        await local.stop()
