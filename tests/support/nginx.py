"""A real nginx (Debian's package) as a TLS-terminating L7 ingress in front of the proxy-server's agent
WebSocket port, the way an ingress controller sets it up: TLS with the ingress's own certificate (from a
CA that is not the hub's), the WebSocket upgrade forwarded to ``http://127.0.0.1:<upstream>`` over
HTTP/1.1 with ``Upgrade``/``Connection`` passed on and ``X-Forwarded-For`` set; every other path is
answered 404 by nginx itself.

One process (``master_process off``), its files in the test's log folder; readiness is a TCP connect
that succeeds (polled with a deadline). What it saw is its access log, one line per request when the
request ends (for a WebSocket: when the connection closes): :meth:`Ingress.requests`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from clusterproxy_protocol.pki import DevCA, PemPair
from clusterproxy_protocol.wire import WEBSOCKET_PATH
from tests.support.procs import Process
from tests.support.proxies import STARTUP_TIMEOUT, accepts, binary, free_port
from tests.support.waiting import wait_until

LOG_FORMAT = "$remote_addr $request_method $request_uri $status $upstream_addr"


@dataclass(frozen=True)
class IngressRequest:
    method: str
    path: str
    status: int
    upstream: str  # "-" when nginx answered itself


@dataclass
class Ingress:
    process: Process
    port: int
    ca: Path  # the CA of the ingress's certificate (agents verify it with --websocket-ca-file)
    directory: Path

    def url(self, path: str = WEBSOCKET_PATH) -> str:
        return f"wss://localhost:{self.port}{path}"

    def requests(self) -> list[IngressRequest]:
        path = self.directory / "access.log"
        found = []
        for line in (path.read_text(errors="replace") if path.exists() else "").splitlines():
            _addr, method, uri, status, upstream = line.split(" ", 4)
            found.append(IngressRequest(method, uri, int(status), upstream))
        return found

    def stop(self) -> None:
        self.process.stop()


def missing() -> str:
    return "nginx (Debian package nginx; scripts/bootstrap.sh installs it)"


def ingress_certificate(directory: Path) -> tuple[Path, PemPair]:
    """A CA of the ingress's own (not the hub's) and its server certificate for localhost."""
    ca = DevCA.create_or_load(directory / "ingress-ca", name="ingress-ca")
    return ca.ca_path, ca.issue_server("ingress", ["localhost", "127.0.0.1"], directory / "ingress-leaf")


async def start_ingress(log_dir: Path, upstream_port: int, name: str = "nginx") -> Ingress:
    """nginx on a free loopback port, terminating TLS and forwarding WebSocket upgrades at
    :data:`WEBSOCKET_PATH` to ``127.0.0.1:upstream_port``."""
    program = binary("nginx")
    assert program is not None, missing()
    directory = log_dir / name
    directory.mkdir(parents=True, exist_ok=True)
    ca, leaf = ingress_certificate(directory)
    port = free_port()
    temp = {kind: directory / f"{kind}-temp" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")}
    for path in temp.values():
        path.mkdir(exist_ok=True)
    temp_paths = "\n".join(f"    {kind}_temp_path {path};" for kind, path in temp.items())
    (directory / "nginx.conf").write_text(
        f"""daemon off;
master_process off;
worker_processes 1;
pid {directory}/nginx.pid;
error_log {directory}/error.log info;
events {{ worker_connections 256; }}
http {{
    log_format ingress '{LOG_FORMAT}';
    access_log {directory}/access.log ingress;
{temp_paths}
    map $http_upgrade $connection_upgrade {{ default upgrade; '' close; }}
    server {{
        listen 127.0.0.1:{port} ssl;
        ssl_certificate {leaf.cert};
        ssl_certificate_key {leaf.key};
        location = {WEBSOCKET_PATH} {{
            proxy_pass http://127.0.0.1:{upstream_port};
            proxy_http_version 1.1;
            proxy_set_header Upgrade $http_upgrade;
            proxy_set_header Connection $connection_upgrade;
            proxy_set_header Host $host;
            proxy_set_header X-Forwarded-For $remote_addr;
            proxy_read_timeout 1h;
            proxy_send_timeout 1h;
            proxy_buffering off;
        }}
        location / {{ return 404 "no route here\\n"; }}
    }}
}}
"""
    )
    argv = [
        program,
        "-p",
        str(directory),
        "-c",
        str(directory / "nginx.conf"),
        "-e",
        str(directory / "error.log"),
    ]
    process = Process(name, argv, log_dir)

    def listening() -> bool:
        assert process.popen.poll() is None, f"nginx exited:\n{(directory / 'error.log').read_text()}"
        return accepts(port)

    await wait_until(listening, timeout=STARTUP_TIMEOUT, what=f"nginx listening on 127.0.0.1:{port}")
    return Ingress(process, port, ca, directory)
