"""Five minutes of continuous traffic while every certificate (server, agent, client) lives about a
minute and renews several times: zero failed streams, zero tunnel reconnects, and every renewed
server certificate is the one the next fresh handshake sees.

``CLUSTER_PROXY_SOAK_SECONDS`` (default 300) and ``CLUSTER_PROXY_SOAK_CERT_TTL`` (default 60s) change
the run for a quick local look; the counts are printed (``pytest -s``) as a table and as JSON.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from clusterproxy_protocol.config import parse_duration
from tests.support.soak import print_report, traffic_run

SOAK_SECONDS = float(os.environ.get("CLUSTER_PROXY_SOAK_SECONDS", "300"))
CERT_TTL = os.environ.get("CLUSTER_PROXY_SOAK_CERT_TTL", "60s")
# A certificate renews at 75-80% of its lifetime, which the signer back-dates by a tenth for skew.
EXPECTED_RENEWALS = int(SOAK_SECONDS // (parse_duration(CERT_TTL) * 1.1 * 0.8)) - 1

pytestmark = [pytest.mark.slow, pytest.mark.clock_bound, pytest.mark.timeout(SOAK_SECONDS + 180)]


async def test_renewals_under_continuous_traffic_drop_nothing(tmp_path: Path, nursery: trio.Nursery) -> None:
    async with traffic_run(tmp_path, nursery, cert_ttl=CERT_TTL) as run:
        # The run lasts SOAK_SECONDS, or ends at the first failure (then the counts say what failed).
        with trio.move_on_after(SOAK_SECONDS):
            await run.traffic.failure_seen.wait()
    report = run.final
    assert report is not None
    print_report(f"certificate renewal under traffic ({SOAK_SECONDS:g}s, leaf TTL {CERT_TTL})", report)

    assert report["failures"] == []
    assert report["duration_s"] >= SOAK_SECONDS - 1
    # several renewals each, none failed
    for party, count in report["renewals"].items():
        assert count >= max(2, EXPECTED_RENEWALS), f"{party} renewed {count} times only"
    assert report["renewals_by_metrics"] == {
        "proxy-server": report["renewals"]["proxy-server"],
        "proxy-agent": report["renewals"]["proxy-agent"],
    }
    assert set(report["renewal_failures"].values()) == {0}
    # zero failed streams, anywhere
    assert set(report["failed_streams"].values()) == {0}, report["failed_streams"]
    assert report["transfers_ok"]["h2"] > 50 and report["transfers_ok"]["http1"] > 50
    assert report["long_lived_closed_cleanly"] == 2
    assert min(report["long_lived_exchanges"].values()) > SOAK_SECONDS  # about 4 per second each
    # zero reconnects: one tunnel for the whole run
    assert report["reconnects"] == {
        "agent_tunnel_connected": 1,
        "agent_tunnel_disconnected": 0,
        "agent_tunnel_reconnects_metric": 0.0,
        "server_agent_connected": 1,
        "server_agent_disconnected": 0,
    }
    # hot reload: fresh handshakes saw each server certificate in turn, the latest one last
    assert run.new_handshakes_followed_renewals(), (run.watch.seen, run.serials_issued_to_server())
    assert report["handshake_probe_errors"] == 0
