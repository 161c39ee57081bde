"""A real cert-signer process, and a proxy-server and agents that get their certificates from it.

Extends :mod:`tests.support.procs`: :class:`SignedHub` is a :class:`~tests.support.procs.Hub` whose
server and agents run with ``--signer`` and bootstrap from tokens. Tokens are created straight in the
signer's store (as ``cluster-proxy certs token create`` does). The hub client lives in the test
process: :class:`ClientParty` bootstraps it and runs its renewer.
"""

from __future__ import annotations

import datetime as dt
import ssl
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from clusterproxy_castore.filestore import FileStore
from clusterproxy_castore.models import Binding
from clusterproxy_castore.tokens import create_token
from clusterproxy_cli.commands import SIGNER, SignerFlags, executable, signer_serve_argv
from clusterproxy_protocol import certclient
from clusterproxy_protocol.certclient import CertFiles, SignerEndpoint
from clusterproxy_protocol.pki import PemPair
from clusterproxy_protocol.reloader import ReloadingContext
from clusterproxy_protocol.renewer import CertRenewer, RenewalPolicy
from tests.support.procs import Hub, Process, client_tls

if TYPE_CHECKING:
    from clusterproxy_castore.kubestore import KubernetesSecretStore
    from tests.support.kubeapi import KubeCluster

SERVER_HOSTS = ("localhost", "127.0.0.1")

HUB_CLIENT = "test-admin"  # the hub client certificate the tests read the admin API with


class SignerProcess:
    """``cluster-proxy-cert-signer serve`` on a free loopback port, with a files store. ``store_poll``
    None runs the signer with its default."""

    def __init__(self, directory: Path, log_dir: Path, *extra: str, store_poll: str | None = "1s") -> None:
        self.directory = directory
        self.store_dir = directory / "store"
        self.log_dir = log_dir
        self.extra = extra
        self.store_poll = store_poll
        self.process: Process | None = None
        self.port = 0

    async def start(self) -> SignerProcess:
        argv = signer_serve_argv(
            self.store_dir,
            listen="127.0.0.1:0",
            tls_hosts=SERVER_HOSTS,
            store_poll=self.store_poll,
            options=self.extra,
        )
        self.process = Process("cert-signer", argv, self.log_dir)
        started = await self.process.wait_event("signer_started")
        self.port = int(str(started["listen"]).rsplit(":", 1)[1])
        return self

    @property
    def store(self) -> FileStore:
        return FileStore(self.store_dir)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def endpoint(self, ca: Path) -> SignerEndpoint:
        return SignerEndpoint("127.0.0.1", self.port, ca, "localhost", timeout=10.0)

    def bundle_pem(self) -> str:
        return self.store.read_authorities().bundle_pem()

    def token(self, binding: Binding, ttl: dt.timedelta = dt.timedelta(minutes=10)) -> str:
        return create_token(self.store, binding, ttl, description="test").token

    def agent_token(self, cluster: str, agent_id: str | None = None, **kw: Any) -> str:
        return self.token(Binding(kind="agent", cluster=cluster, agent_id=agent_id), **kw)

    def server_token(self) -> str:
        return self.token(Binding(kind="server", name="proxy-server", hosts=SERVER_HOSTS))

    def client_token(self, name: str, organization: str | None = None) -> str:
        return self.token(Binding(kind="client", name=name, organization=organization))

    def party(self, directory: Path) -> CertFiles:
        """Files for a new party: a folder with the current trust bundle (how it verifies the signer)."""
        directory.mkdir(parents=True, exist_ok=True)
        files = CertFiles(directory / "tls.crt", directory / "tls.key", directory / "ca.crt")
        certclient.write_bundle(files.ca, self.bundle_pem())
        return files

    def issued(self) -> Counter[str]:
        """``cert_issued`` events of the signer's log by ``via`` (bootstrap, renew, self)."""
        assert self.process is not None
        return Counter(str(e.get("via")) for e in self.process.events() if e.get("event") == "cert_issued")

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


class KubeSigner(SignerProcess):
    """``cluster-proxy-cert-signer serve`` on a hub's Secrets store (``kubernetes:NAMESPACE/PREFIX``), as
    the addon-manager deploys it (the store the manager mints its tokens in), with the hub admin's
    kubeconfig."""

    def __init__(
        self, hub: KubeCluster, namespace: str, log_dir: Path, prefix: str = "cluster-proxy-ca"
    ) -> None:
        super().__init__(log_dir / "signer", log_dir)
        self.hub = hub
        self.namespace = namespace
        self.prefix = prefix

    async def start(self) -> KubeSigner:
        argv = [
            executable(SIGNER),
            "serve",
            "--store",
            f"kubernetes:{self.namespace}/{self.prefix}",
            "--kubeconfig",
            str(self.hub.kubeconfig),
            "--listen",
            "127.0.0.1:0",
            *[arg for host in SERVER_HOSTS for arg in ("--tls-host", host)],
            "--store-poll",
            "1s",
            "--log-format",
            "json",
        ]
        self.process = Process("cert-signer", argv, self.log_dir)
        started = await self.process.wait_event("signer_started")
        self.port = int(str(started["listen"]).rsplit(":", 1)[1])
        return self

    @property
    def store(self) -> KubernetesSecretStore:  # type: ignore[override]
        from clusterproxy_castore.kubestore import KubernetesSecretStore

        return KubernetesSecretStore(
            namespace=self.namespace, prefix=self.prefix, kubeconfig=self.hub.kubeconfig
        )


@dataclass
class SignedHub(Hub):
    """A :class:`Hub` whose server and agents bootstrap from ``signer`` and renew their certificates.
    ``trust_refresh`` None runs them with the services' default (no ``--trust-refresh``)."""

    signer: SignerProcess | None = None
    files: dict[str, CertFiles] = field(default_factory=dict)

    def _signer(self) -> SignerProcess:
        assert self.signer is not None
        return self.signer

    async def start_server(self, *extra: str, trust_refresh: str | None = None) -> None:  # type: ignore[override]
        signer = self._signer()
        files = self.files["proxy-server"] = signer.party(self.log_dir / "proxy-server")
        flags = SignerFlags(signer.url, trust_refresh, signer.server_token())
        await self.launch_server(self.server_argv(files, signer=flags, tls_hosts=SERVER_HOSTS, options=extra))
        if HUB_CLIENT not in self.files:  # what reads the admin port's agents and clusters
            client = self.files[HUB_CLIENT] = signer.party(self.log_dir / HUB_CLIENT)
            token = signer.client_token(HUB_CLIENT)
            await certclient.bootstrap_files(
                signer.endpoint(client.ca), token, client, lambda key: certclient.client_csr(key, HUB_CLIENT)
            )

    def api_tls(self) -> ssl.SSLContext:
        files = self.files[HUB_CLIENT]
        return client_tls(PemPair(files.cert, files.key), files.ca)

    def start_agent(  # type: ignore[override]
        self,
        cluster: str,
        agent_id: str,
        *extra: str,
        token: str | None = "new",
        files: CertFiles | None = None,
        name: str | None = None,
        trust_refresh: str | None = None,
    ) -> Process:
        """An agent with ``--signer``; ``token="new"`` creates one bound to ``cluster``, None passes
        none (the files must hold a certificate), any other string is passed as is."""
        signer = self._signer()
        name = name or f"agent-{cluster}-{agent_id}"
        files = files or self.files.get(name) or signer.party(self.log_dir / name)
        self.files[name] = files
        if token == "new":
            token = signer.agent_token(cluster)
        flags = SignerFlags(signer.url, trust_refresh, token)
        argv = self.agent_argv(files, cluster, agent_id, signer=flags, allow=["127.0.0.0/8"], options=extra)
        return self.launch_agent(name, argv)

    def stop(self) -> None:
        super().stop()
        if self.signer is not None:
            self.signer.stop()


class ClientParty:
    """A hub client in the test process: bootstrapped from a token, renewed by a CertRenewer, with a
    reloading context per ALPN (read ``.context`` at each new connection). ``trust_refresh`` None is
    :class:`RenewalPolicy`'s default."""

    def __init__(self, files: CertFiles, endpoint: SignerEndpoint, trust_refresh: float | None) -> None:
        self.files = files
        self.endpoint = endpoint
        self.h2 = ReloadingContext.client(files.cert, files.key, files.ca, alpn=["h2"])
        self.h1 = ReloadingContext.client(files.cert, files.key, files.ca, alpn=["http/1.1"])
        self.probe = ReloadingContext.client(files.cert, files.key, files.ca, alpn=["h2"])
        policy = RenewalPolicy() if trust_refresh is None else RenewalPolicy(trust_refresh=trust_refresh)
        self.renewer = CertRenewer(endpoint, files, [self.h2, self.h1, self.probe], policy)

    @classmethod
    async def bootstrap(
        cls, signer: SignerProcess, directory: Path, name: str, *, trust_refresh: float | None = None
    ) -> ClientParty:
        files = signer.party(directory)
        endpoint = signer.endpoint(files.ca)
        await certclient.bootstrap_files(
            endpoint, signer.client_token(name), files, lambda key: certclient.client_csr(key, name)
        )
        return cls(files, endpoint, trust_refresh)

    async def start_renewer(self, nursery: trio.Nursery) -> None:
        await nursery.start(self.renewer.run)


def count_events(process: Process, event: str, **match: Any) -> int:
    return sum(
        1
        for e in process.events()
        if e.get("event") == event and all(e.get(k) == v for k, v in match.items())
    )


def curl_proxy_argv(hub: SignedHub, files: CertFiles, cluster: str, url: str) -> list[str]:
    """curl fetching ``url`` inside ``cluster`` through the hub's client port with ``files``."""
    return [
        "curl", "--silent", "--show-error", "--max-time", "20", "--proxytunnel",
        "--proxy", f"https://{cluster}@127.0.0.1:{hub.client_port}",
        "--proxy-cacert", str(files.ca), "--proxy-cert", str(files.cert), "--proxy-key", str(files.key),
        url,
    ]  # fmt: skip
