"""Command lines of the services, as an operator would type them.

``cluster-proxy local up`` builds every child's argv here, and so do the tests' process harnesses:
one list of flags per service. The services are found as installed console scripts, never imported.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from clusterproxy_protocol import CertFiles, ConfigError

SERVER = "cluster-proxy-server"
AGENT = "cluster-proxy-agent"
SIGNER = "cluster-proxy-cert-signer"
CLI_EXTRA = "cluster-proxy-cli[local]"  # installs every service local up runs


def executable(name: str) -> str:
    """A console script of this installation (next to the running Python), else from PATH.

    Each service's script has the name of the package that installs it."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise ConfigError(
            f"{name} not found next to {sys.executable} or on PATH: install the {name} package "
            f"(pip install '{CLI_EXTRA}' installs every service)"
        )
    return found


def _flag(name: str, value: str | None) -> list[str]:
    return [] if value is None else [name, value]


def repeat_flag(name: str, values: Sequence[str]) -> list[str]:
    """``name`` once per value: ``--tls-host a --tls-host b``."""
    return [arg for value in values for arg in (name, value)]


@dataclass(frozen=True)
class SignerFlags:
    """How a party reaches the cert-signer: its URL, how often the party fetches the trust bundle
    (None: the service's default), and a bootstrap token when it holds no usable certificate."""

    url: str
    trust_refresh: str | None = None
    bootstrap_token: str | None = None

    def argv(self) -> list[str]:
        return [
            "--signer",
            self.url,
            *_flag("--trust-refresh", self.trust_refresh),
            *_flag("--bootstrap-token", self.bootstrap_token),
        ]


def _party_flags(files: CertFiles, signer: SignerFlags | None) -> list[str]:
    """A party's certificate files, and how it gets them from the signer."""
    flags = ["--ca", str(files.ca), "--cert", str(files.cert), "--key", str(files.key)]
    return flags + (signer.argv() if signer is not None else [])


def _last_flags(drain_timeout: str | None, log_level: str | None, options: Sequence[str]) -> list[str]:
    """Drain and logging flags of the server and the agent (JSON logs), then ``options``."""
    return [
        *_flag("--drain-timeout", drain_timeout),
        *_flag("--log-level", log_level),
        "--log-format",
        "json",
        *options,
    ]


def server_argv(
    files: CertFiles,
    *,
    agent_listen: str,
    client_listen: str,
    admin_listen: str,
    signer: SignerFlags | None = None,
    tls_hosts: Sequence[str] = (),
    known_clusters: Sequence[str] = (),
    drain_timeout: str | None = None,
    log_level: str | None = None,
    workers: int | None = 1,
    options: Sequence[str] = (),
) -> list[str]:
    """``cluster-proxy-server`` logging JSON; ``options`` go last (any other flag). One worker process
    unless ``workers`` says otherwise (None: the server's default, one per core): ``local up`` and the
    tests count one process per replica."""
    return [
        executable(SERVER),
        "--agent-listen",
        agent_listen,
        "--client-listen",
        client_listen,
        "--admin-listen",
        admin_listen,
        *_party_flags(files, signer),
        *repeat_flag("--tls-host", tls_hosts),
        *_flag("--known-clusters", ",".join(known_clusters) or None),
        *_flag("--workers", None if workers is None else str(workers)),
        *_last_flags(drain_timeout, log_level, options),
    ]


def agent_argv(
    files: CertFiles,
    *,
    cluster: str,
    agent_id: str,
    server: str,
    admin_listen: str,
    server_name: str = "localhost",
    signer: SignerFlags | None = None,
    allow: Sequence[str] = (),
    kube_apiserver: str | None = None,
    backoff_initial: str | None = None,
    backoff_max: str | None = None,
    drain_timeout: str | None = None,
    log_level: str | None = None,
    options: Sequence[str] = (),
) -> list[str]:
    """``cluster-proxy-agent`` of ``cluster`` dialing ``server``, logging JSON; ``options`` go last."""
    return [
        executable(AGENT),
        "--server",
        server,
        "--server-name",
        server_name,
        "--cluster",
        cluster,
        "--agent-id",
        agent_id,
        *_party_flags(files, signer),
        "--admin-listen",
        admin_listen,
        *repeat_flag("--allow", allow),
        *_flag("--kube-apiserver", kube_apiserver),
        *_flag("--backoff-initial", backoff_initial),
        *_flag("--backoff-max", backoff_max),
        *_last_flags(drain_timeout, log_level, options),
    ]


def signer_serve_argv(
    store: Path,
    *,
    listen: str,
    tls_hosts: Sequence[str],
    cert_ttl: str | None = None,
    store_poll: str | None = None,
    options: Sequence[str] = (),
) -> list[str]:
    """``cluster-proxy-cert-signer serve`` with a files store, logging JSON; ``options`` go last."""
    return [
        executable(SIGNER),
        "serve",
        "--store",
        str(store),
        "--listen",
        listen,
        *repeat_flag("--tls-host", tls_hosts),
        *_flag("--cert-ttl", cert_ttl),
        *_flag("--store-poll", store_poll),
        "--log-format",
        "json",
        *options,
    ]


def signer_command_argv(command: Sequence[str], store: Path | None = None) -> list[str]:
    """``cluster-proxy-cert-signer COMMAND... [--store STORE]``: an administration command
    (``status``, ``rotate-ca``, ``token create``, ``trust-bundle``, ...)."""
    return [executable(SIGNER), *command, *_flag("--store", None if store is None else str(store))]
