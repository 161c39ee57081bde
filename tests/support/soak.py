"""A hub whose every party renews its certificate from a real signer, under continuous checked traffic,
and the counts that prove nothing was dropped (see tests/e2e/test_certs_renewal.py and
test_certs_rotation.py).

:func:`traffic_run` starts a signer process, a proxy-server and an agent (processes, bootstrapped
from tokens), a hub client in the test process (bootstrapped too, renewed by its own CertRenewer),
the targets, and the traffic: transfers on fresh connections alternating both frontends, one
long-lived stream per frontend, and a watch of the server certificate fresh handshakes see. The
caller's block runs while it flows; on exit the traffic stops (the long-lived streams end with a
clean close) and :meth:`Run.report` counts renewals, failures and reconnects from the processes' logs
and metrics and from the client.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from tests.support.certs import HUB_CLIENT, ClientParty, SignedHub, SignerProcess, count_events
from tests.support.procs import Process, http_get
from tests.support.traffic import SerialWatch, Traffic, serve_bye_echo, serve_sized
from tests.support.waiting import wait_at_most

CLUSTER, AGENT_ID = "cluster1", "agent-a"


def scrape(port: int) -> dict[str, float]:
    """A Prometheus text page as ``{"name{labels}": value}``."""
    status, body = http_get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200, body
    samples = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


@dataclass
class Run:
    signer: SignerProcess
    hub: SignedHub
    agent: Process
    client: ClientParty
    traffic: Traffic
    watch: SerialWatch
    started: float = 0.0
    stopped: float = 0.0
    final: dict[str, Any] | None = None  # report() taken after the traffic stopped, before the processes
    issued_before_last_probe: list[int] | None = None

    @property
    def server(self) -> Process:
        assert self.hub.server is not None
        return self.hub.server

    def serials_issued_to_server(self) -> list[int]:
        """The server's certificates in order: the bootstrapped one, then each renewal's."""
        return [
            int(str(e["serial"]), 16)
            for e in self.server.events()
            if e.get("event") in ("cert_bootstrapped", "cert_renewed")
        ]

    def new_handshakes_followed_renewals(self) -> bool:
        """Fresh handshakes saw each server certificate in turn, up to the one current at the last
        probe (a renewal logged after that probe is the only one it may have missed)."""
        seen = [int(s, 16) for s in self.watch.seen]
        before = self.issued_before_last_probe or []
        after = self.serials_issued_to_server()
        return seen[: len(before)] == before and seen == after[: len(seen)]

    def report(self) -> dict[str, Any]:
        server, agent = self.server, self.agent
        agent_admin = int(
            str(next(e for e in agent.events() if e.get("event") == "agent_started")["admin_port"]).rsplit(
                ":", 1
            )[1]
        )
        # The processes still run and renew: the metrics and the logs are read as one snapshot, again
        # if a renewal was logged meanwhile (a renewal between the two reads made them disagree).
        while True:
            logged = count_events(server, "cert_renewed"), count_events(agent, "cert_renewed")
            server_metrics, agent_metrics = scrape(self.hub.admin_port), scrape(agent_admin)
            if (count_events(server, "cert_renewed"), count_events(agent, "cert_renewed")) == logged:
                break
        stream_errors = sum(
            1 for e in server.events() if e.get("event") == "stream_closed" and e.get("error") is not None
        )
        return {
            "duration_s": round(self.stopped - self.started, 1),
            "renewals": {
                "proxy-server": logged[0],
                "proxy-agent": logged[1],
                "client": self.client.renewer.renewals,
            },
            "renewal_failures": {
                "proxy-server": count_events(server, "cert_renewal_failed"),
                "proxy-agent": count_events(agent, "cert_renewal_failed"),
                "client": self.client.renewer.failures,
            },
            "renewals_by_metrics": {
                "proxy-server": server_metrics.get("cluster_proxy_server_cert_renewals_total"),
                "proxy-agent": agent_metrics.get("cluster_proxy_agent_cert_renewals_total"),
            },
            "trust_bundle_updates": {
                "proxy-server": count_events(server, "trust_bundle_updated"),
                "proxy-agent": count_events(agent, "trust_bundle_updated"),
                "client": self.client.renewer.trust_updates,
            },
            "signer_issued": dict(self.signer.issued()),
            "transfers_ok": dict(self.traffic.ok),
            "bytes_checked": self.traffic.bytes_moved,
            "long_lived_exchanges": dict(self.traffic.long_exchanges),
            "long_lived_closed_cleanly": self.traffic.long_streams_closed_cleanly,
            "failed_streams": {
                "client": self.traffic.failed,
                "server_stream_failed": count_events(server, "stream_failed"),
                "server_stream_closed_with_error": stream_errors,
                "server_stream_refused": count_events(server, "stream_refused"),
                "agent_stream_refused": count_events(agent, "stream_refused"),
            },
            "reconnects": {
                "agent_tunnel_connected": count_events(agent, "tunnel_connected"),
                "agent_tunnel_disconnected": count_events(agent, "tunnel_disconnected"),
                "agent_tunnel_reconnects_metric": agent_metrics.get(
                    "cluster_proxy_agent_tunnel_reconnects_total"
                ),
                "server_agent_connected": count_events(server, "agent_connected"),
                "server_agent_disconnected": count_events(server, "agent_disconnected"),
            },
            "server_certificates_seen_by_new_handshakes": len(self.watch.seen),
            "handshake_probe_errors": len(self.watch.errors),
            "failures": self.traffic.failures[:20],
        }


def print_report(title: str, report: dict[str, Any]) -> None:
    print(f"\n=== {title} ===")
    for key, value in report.items():
        print(f"  {key:<45} {json.dumps(value)}")
    print(f"=== {title} (JSON) ===\n{json.dumps(report, sort_keys=True)}")


@asynccontextmanager
async def traffic_run(
    directory: Path,
    nursery: trio.Nursery,
    *,
    cert_ttl: str,
    trust_refresh: str | None = None,
    client_trust_refresh: float | None = None,
    signer_store_poll: str | None = "1s",
) -> AsyncIterator[Run]:
    """``trust_refresh`` (server and agent), ``client_trust_refresh`` and ``signer_store_poll`` None
    leave each at its default."""
    signer = await SignerProcess(
        directory / "signer", directory, "--cert-ttl", cert_ttl, store_poll=signer_store_poll
    ).start()
    hub = SignedHub(None, directory, signer=signer)  # type: ignore[arg-type]
    try:
        client = await ClientParty.bootstrap(
            signer, directory / "client", "soak-client", trust_refresh=client_trust_refresh
        )
        await client.start_renewer(nursery)
        # The hub reads its admin API with this renewing client: a certificate of its own that never
        # followed the trust bundle would hold every CA rotation at "not every party trusts it".
        hub.files[HUB_CLIENT] = client.files
        await hub.start_server(trust_refresh=trust_refresh)
        agent = hub.start_agent(CLUSTER, AGENT_ID, trust_refresh=trust_refresh)
        await hub.wait_agent(CLUSTER, AGENT_ID)
        traffic = Traffic(
            hub.client_port,
            CLUSTER,
            await serve_sized(nursery),
            await serve_bye_echo(nursery),
            client.h2,
            client.h1,
        )
        watch = SerialWatch(hub.client_port, client.probe, interval=1.0)
        run = Run(signer, hub, agent, client, traffic, watch)
        stop = trio.Event()
        async with trio.open_nursery() as flows:
            await flows.start(traffic.long_stream, "h2", stop)
            await flows.start(traffic.long_stream, "http1", stop)
            flows.start_soon(traffic.loop, stop)
            flows.start_soon(watch.run, stop)
            run.started = trio.current_time()
            try:
                yield run
            finally:
                run.stopped = trio.current_time()
                stop.set()
        # a last fresh handshake, and the server's log of every stream the client saw end
        run.issued_before_last_probe = run.serials_issued_to_server()
        await watch.probe_once()
        streams = sum(traffic.ok.values()) + traffic.long_streams_closed_cleanly
        await wait_at_most(
            lambda: count_events(run.server, "stream_closed") >= streams, timeout=10, interval=0.1
        )
        run.final = run.report()
    finally:
        hub.stop()
