"""Real forward proxies for tests: tinyproxy and squid from Debian's packages, each its own process on a
loopback port with a config file the test writes.

Readiness is a TCP connect that succeeds (polled with a deadline, never a sleep); logs are kept in the
test's log folder; :meth:`ForwardProxyProcess.stop` ends the process and waits for it. What the proxy
saw is read from its own log: :meth:`ForwardProxyProcess.requests` is every request line it logged.

- tinyproxy logs each request when it arrives (``Request (file descriptor N): CONNECT host:port
  HTTP/1.1``); ``BasicAuth`` answers 407 without credentials and 401 (tinyproxy's choice) for wrong
  ones; ``ConnectPort`` makes it answer 403 to a CONNECT to any other port.
- squid logs a request when it ends (for a CONNECT: when the tunnel closes) in the format below; it
  serves TLS to its clients (``https_port``, an HTTPS proxy) and basic auth through its NCSA helper,
  answering 407 to missing and to wrong credentials. Run as root, squid drops to the ``proxy`` user, so
  its files live in a folder of their own that the user owns (the test's tmp folders are 0700 root);
  the logs are copied to the test's log folder when it stops.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import trio

from clusterproxy_cli.local_plan import free_ports
from tests.support.procs import POLL, Process
from tests.support.waiting import wait_until

EXTRA_PATH = ("/usr/sbin", "/sbin", "/usr/bin")
DEBIAN_PACKAGE = {"tinyproxy": "tinyproxy", "squid": "squid"}
STARTUP_TIMEOUT = 20.0
# time, client, method, URI, status, bytes from the client, bytes to the client (a tunnel's included)
SQUID_LOG_FORMAT = "%ts.%03tu %>a %rm %ru %>Hs %>st %<st"
TINYPROXY_PROBE_LINE = "closed socket before read"
_TINYPROXY_REQUEST = re.compile(r"Request \(file descriptor \d+\): (\S+) (\S+)")
_SQUID_REQUEST = re.compile(r"^\S+ \S+ (\S+) (\S+) (\d+) (\d+) (\d+)$")


def binary(name: str) -> str | None:
    """The program ``name`` on PATH or in the sbin folders (a non-root PATH may lack them)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), *EXTRA_PATH])
    return shutil.which(name, path=path)


def missing(name: str) -> str:
    """The prerequisite text for :func:`tests.support.require`."""
    return f"{name} (Debian package {DEBIAN_PACKAGE[name]}; scripts/bootstrap.sh installs it)"


def free_port() -> int:
    """A loopback port nobody listens on (bound then released), below the kernel's ephemeral range:
    on a busy machine an outgoing connection can take an ephemeral port between our release and the
    process's bind (a replica once failed to start with EADDRINUSE that way)."""
    return free_ports(1)[0]


def accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


@dataclass(frozen=True)
class Request:
    """A request line a proxy logged; ``status`` and the byte counts only where the proxy logs them
    (squid, when the request ended)."""

    method: str
    target: str
    status: int | None = None
    bytes_from_client: int | None = None
    bytes_to_client: int | None = None


@dataclass
class ForwardProxyProcess:
    kind: str  # "tinyproxy" or "squid"
    scheme: str  # "http" or "https"
    port: int
    process: Process
    log_dir: Path
    private_dir: Path | None = None  # squid's own folder (owned by its user), removed at stop
    log_sources: dict[str, Path] = field(default_factory=dict)  # squid: name -> live log path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def url(self, user: str | None = None, password: str | None = None) -> str:
        userinfo = ""
        if user is not None:
            userinfo = user + (f":{password}" if password is not None else "") + "@"
        return f"{self.scheme}://{userinfo}{self.address}"

    def log_text(self) -> str:
        if self.kind == "squid":
            path = self.log_sources["access"]
            return path.read_text(errors="replace") if path.exists() else ""
        return self.process.log_path.read_text(errors="replace")

    def requests(self) -> list[Request]:
        """Every request the proxy logged, in order."""
        found = []
        for line in self.log_text().splitlines():
            if self.kind == "tinyproxy":
                match = _TINYPROXY_REQUEST.search(line)
                if match:
                    found.append(Request(match[1], match[2]))
            else:
                match = _SQUID_REQUEST.match(line.strip())
                if match and match[1] != "-":  # "-": a connection that sent no request (a probe)
                    found.append(Request(match[1], match[2], int(match[3]), int(match[4]), int(match[5])))
        return found

    def connections(self) -> int:
        """Client connections tinyproxy logged, the one readiness probe included."""
        assert self.kind == "tinyproxy"
        return self.log_text().count("Connect (file descriptor")

    async def wait_requests(self, count: int, timeout: float = 20.0) -> list[Request]:
        """At least ``count`` logged requests; AssertionError with the log after ``timeout``."""
        return await wait_until(
            lambda: found if len(found := self.requests()) >= count else None,
            timeout=timeout,
            interval=POLL,
            message=lambda: (
                f"{self.kind}: fewer than {count} requests logged after {timeout}s:\n{self.tail()}"
            ),
        )

    def tail(self, lines: int = 30) -> str:
        text = self.process.tail(lines)
        if self.kind == "squid":
            text += "\n--- access log\n" + "\n".join(self.log_text().splitlines()[-lines:])
        return text

    async def wait_ready(self, timeout: float = STARTUP_TIMEOUT) -> None:

        async def listening() -> bool:
            if await trio.to_thread.run_sync(accepts, self.port):
                return True
            if self.process.popen.poll() is not None:
                raise AssertionError(
                    f"{self.kind} exited ({self.process.popen.returncode}) before listening on "
                    f"{self.address}:\n{self.tail()}"
                )
            return False

        await wait_until(
            listening,
            timeout=timeout,
            interval=POLL,
            message=lambda: f"{self.kind} not listening on {self.address} after {timeout}s:\n{self.tail()}",
        )

    def stop(self) -> None:
        """SIGTERM, wait (SIGKILL after 10 s), keep the logs."""
        self.process.stop()
        if self.private_dir is not None:
            for name, path in self.log_sources.items():
                if path.exists():
                    shutil.copyfile(path, self.log_dir / f"{self.process.name}.{name}.log")
            shutil.rmtree(self.private_dir, ignore_errors=True)
            self.private_dir = None
            self.log_sources = {
                name: self.log_dir / f"{self.process.name}.{name}.log" for name in self.log_sources
            }


async def start_tinyproxy(
    log_dir: Path,
    name: str = "tinyproxy",
    *,
    port: int | None = None,
    basic_auth: tuple[str, str] | None = None,
    connect_ports: tuple[int, ...] = (),
) -> ForwardProxyProcess:
    """tinyproxy on ``127.0.0.1:port`` (a free one by default). ``basic_auth``: the one user and
    password it accepts; ``connect_ports``: the only ports it lets CONNECT reach (403 for others)."""
    tinyproxy = binary("tinyproxy")
    assert tinyproxy, missing("tinyproxy")
    port = port or free_port()
    lines = [
        f"Port {port}",
        "Listen 127.0.0.1",
        "Timeout 600",
        "LogLevel Info",
        "MaxClients 200",
        "DisableViaHeader Yes",
    ]
    if basic_auth is not None:
        lines.append(f"BasicAuth {basic_auth[0]} {basic_auth[1]}")
    lines += [f"ConnectPort {p}" for p in connect_ports]
    config = log_dir / f"{name}.conf"
    config.write_text("\n".join(lines) + "\n")
    # -d: stay in the foreground and log to stderr (captured in NAME.log)
    proxy = ForwardProxyProcess(
        "tinyproxy", "http", port, Process(name, [tinyproxy, "-d", "-c", str(config)], log_dir), log_dir
    )
    try:
        await proxy.wait_ready()
        # the readiness probe is logged as a connection without a request: wait for that line, so that
        # connections() counts exactly one probe from here on
        await wait_until(
            lambda: TINYPROXY_PROBE_LINE in proxy.log_text(),
            timeout=STARTUP_TIMEOUT,
            what="tinyproxy to log its readiness probe",
            interval=POLL,
        )
    except BaseException:
        proxy.stop()
        raise
    return proxy


def _apr1_hash(password: str) -> str:
    """An Apache MD5 hash for squid's NCSA helper (``openssl passwd -apr1``)."""
    result = subprocess.run(
        ["openssl", "passwd", "-apr1", "-stdin"], input=password, capture_output=True, text=True, check=True
    )
    return result.stdout.strip()


def _squid_dir() -> Path:
    """A folder outside the test's 0700 tmp tree (squid's user could not reach into it)."""
    directory = Path(tempfile.mkdtemp(prefix="cluster-proxy-squid-"))
    directory.chmod(0o755)
    return directory


def _hand_over(directory: Path) -> None:
    """Make ``directory`` and its files squid's: run as root, squid works as the ``proxy`` user."""
    for path in directory.iterdir():
        path.chmod(0o600)
    if os.geteuid() != 0:
        return
    user = pwd.getpwnam("proxy")
    for path in [directory, *directory.iterdir()]:
        os.chown(path, user.pw_uid, user.pw_gid)


async def start_squid(
    log_dir: Path,
    name: str = "squid",
    *,
    port: int | None = None,
    tls: tuple[Path, Path] | None = None,
    basic_auth: tuple[str, str] | None = None,
) -> ForwardProxyProcess:
    """squid on ``127.0.0.1:port``: an HTTP proxy, or an HTTPS proxy with ``tls`` (certificate, key);
    ``basic_auth``: the one user and password it accepts (407 otherwise)."""
    squid = binary("squid")
    assert squid, missing("squid")
    port = port or free_port()
    private = _squid_dir()
    listen = f"http_port 127.0.0.1:{port}"
    if tls is not None:
        cert, key = private / "proxy.crt", private / "proxy.key"
        shutil.copyfile(tls[0], cert)
        shutil.copyfile(tls[1], key)
        listen = f"https_port 127.0.0.1:{port} tls-cert={cert} tls-key={key}"
    access = [
        "http_access deny !localhost",
        "http_access allow localhost",
    ]
    auth: list[str] = []
    if basic_auth is not None:
        passwords = private / "passwd"
        passwords.write_text(f"{basic_auth[0]}:{_apr1_hash(basic_auth[1])}\n")
        helper = "/usr/lib/squid/basic_ncsa_auth"
        auth = [
            f"auth_param basic program {helper} {passwords}",
            "auth_param basic children 2 startup=1 idle=1",
            "auth_param basic realm cluster-proxy-test",
            "acl authenticated proxy_auth REQUIRED",
        ]
        access = [
            "http_access deny !localhost",
            "http_access deny !authenticated",
            "http_access allow localhost",
        ]
    logs = {"access": private / "access.log", "cache": private / "cache.log"}
    config_lines = [
        listen,
        *auth,
        *access,
        "http_access deny all",
        f"logformat cpx {SQUID_LOG_FORMAT}",
        f"access_log stdio:{logs['access']} cpx",
        f"cache_log {logs['cache']}",
        "pid_filename none",
        "cache deny all",
        "cache_mem 8 MB",
        f"coredump_dir {private}",
        "pinger_enable off",
        "shutdown_lifetime 0 seconds",
        "visible_hostname cluster-proxy-test",
        "dns_nameservers 127.0.0.1",  # nothing is resolved: every destination is an IP address
    ]
    config = private / "squid.conf"
    config.write_text("\n".join(config_lines) + "\n")
    _hand_over(private)
    shutil.copyfile(config, log_dir / f"{name}.conf")
    process = Process(name, [squid, "-N", "-f", str(config)], log_dir)
    proxy = ForwardProxyProcess("squid", "https" if tls else "http", port, process, log_dir, private, logs)
    try:
        await proxy.wait_ready()
    except BaseException:
        proxy.stop()
        raise
    return proxy
