"""The proxy-server's settings (``main.py`` fills them from flags and their environment twins)."""

from __future__ import annotations

import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from clusterproxy_protocol import TunnelSettings
from clusterproxy_server.control import DEFAULT_CONTROL_CLIENTS
from clusterproxy_server.ejection import EjectionPolicy
from clusterproxy_server.quotas import QuotaSettings

# The HTTP/2 abuse limits' defaults (main.py's flags say the same). A client connection gets a few
# hundred streams and is closed when idle; an agent opens no streams, so a reset budget costs it
# nothing, and its tunnel is kept up by PINGs, not by streams.
# Stream windows start at 64 KiB and grow for streams that keep up (clusterproxy_server.quotas): a
# client that reads nothing pins 64 KiB per stream and direction, not the whole window.
FIRST_WINDOW = 64 << 10
CLIENT_TUNNEL = TunnelSettings(
    initial_stream_window=FIRST_WINDOW,
    max_concurrent_streams=256,
    reset_budget=500,
    stall_timeout=60.0,
    idle_timeout=300.0,
)
AGENT_TUNNEL = TunnelSettings(initial_stream_window=FIRST_WINDOW, reset_budget=500, stall_timeout=60.0)


@dataclass
class ServerConfig:
    ca: Path
    cert: Path
    key: Path
    agent_listen: tuple[str, int] = ("0.0.0.0", 8091)
    agent_websocket_listen: tuple[str, int] | None = None  # agent tunnels in WebSockets (behind an ingress)
    client_listen: tuple[str, int] = ("0.0.0.0", 8090)
    admin_listen: tuple[str, int] = ("0.0.0.0", 8092)
    server_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}")
    server_count: int = 1
    worker: tuple[int, int] | None = None  # (index, workers) of one of several workers, told to agents
    known_clusters: set[str] = field(default_factory=set)
    dial_timeout: float = 30.0  # the client's wait for its stream to open, a retry included
    agent_answer_timeout: float = 12.0  # one agent's answer to a CONNECT (agents' dial timeout + margin)
    ejection: EjectionPolicy = field(default_factory=EjectionPolicy)
    max_pending_dials_per_connection: int = 128
    max_pending_dials_per_client: int = 512
    quotas: QuotaSettings = field(default_factory=QuotaSettings)  # per client identity (quotas.py)
    handshake_timeout: float = 10.0
    # 30 s, not 10: a PING round trip costs the server ~0.3-0.4 ms of CPU, so 10,000 idle tunnels at 10 s
    # took 38 % of a core (docs/benchmarks.md, "10,000 clusters"); upstream PINGs once an hour.
    keepalive_interval: float = 30.0
    keepalive_timeout: float = 20.0
    drain_timeout: float = 30.0
    # On SIGTERM, /readyz fails at once but the ports keep serving this long before the drain begins:
    # the time a Service's endpoints take to drop the pod (kube-apiserver's --shutdown-delay-duration).
    shutdown_delay: float = 0.0
    # A replica younger than this holds a request for a cluster it has no agent of yet (its agents
    # are still dialing it) instead of answering 404/503 at once; main.py's default: 10 s with
    # --server-count above 1, else 0.
    startup_grace: float = 0.0
    tunnel: TunnelSettings = AGENT_TUNNEL  # agent tunnels
    client_tunnel: TunnelSettings = CLIENT_TUNNEL  # HTTP/2 connections on the client port
    # cert-signer: bootstrap (``main.serve``) and renewal; None keeps the files as they are
    signer: str | None = None
    bootstrap_token: str | None = None
    tls_hosts: tuple[str, ...] = ()
    trust_refresh: float = 60.0  # while a CA rotation is under way the signer asks for sooner
    # which clients reach which clusters (authz.py); None: every client reaches every cluster
    client_policy: Path | None = None
    # common names of the hub clients that may reach the agents' control endpoint (control.py)
    control_clients: tuple[str, ...] = DEFAULT_CONTROL_CLIENTS
    # where audit records go (clusterproxy_protocol.audit.open_sink): "off", "-" or a file that rotates
    audit_log: str = "off"
