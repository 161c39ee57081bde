"""The manager's own hub client certificate, for the proxy-servers' admin API.

The availability poll reads ``/api/v1/clusters``, which lists clusters and agents: the admin port
serves it over mutual TLS only, to a hub client certificate (docs/architecture.md, "The admin port").
The manager gets one as every party does (docs/addon-manager.md, "Identities"): the cert-signer issues
it for a single-use bootstrap token, and the manager renews it at 80 % of its lifetime and follows the
trust bundle through CA rotations (:class:`~clusterproxy_protocol.renewer.CertRenewer`, as the other
parties). Only the signer signs: the manager holds the store, but it mints a token there (bound to a
client certificate with CN ``addon-manager``, as it does for the health-collector's and the gateway's
Secrets) and trades it at the signer over HTTPS, never touching the CA's key. The token goes from the
store to the signer directly: no Secret holds it.

- The token is minted only once the signer answers (its trust bundle, verified with the store's CA
  bundle): a manager whose signer is not up yet leaves no unused tokens behind. An unused token is
  reused for the next attempt while it is valid; one the signer refused is forgotten.
- Files: ``--credentials-dir``/<namespace>/ ``tls.crt``, ``tls.key`` (0600), ``ca.crt``; in Kubernetes a
  memory-backed emptyDir, so a restarted container keeps its certificate (no new token) and a new pod
  bootstraps again.
- One certificate per proxy-server namespace (``spec.proxyServer.namespace``): each namespace has its
  store, CA and signer. When the configuration moves the hub side, the manager starts over there.
- A certificate that expired anyway (renewals failing for its whole lifetime) is replaced by a new
  bootstrap: unlike other parties, the manager can mint its own token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from clusterproxy_castore.store import StoreError
from clusterproxy_protocol import (
    ALPN_HTTP1,
    CertFiles,
    CertRenewer,
    ConfigError,
    SignerEndpoint,
    SignerRequestError,
    certclient,
    client_context,
    describe_exception,
)

from .availability import AdminTarget, AdminTLS
from .identity import Credentials, client_binding
from .metrics import ManagerMetrics

__all__ = ["CLIENT_NAME", "TOKEN_GROUP", "HubClientCertificate"]

#: the CN of the manager's certificate: what the proxy-servers' logs and a client policy see
CLIENT_NAME = "addon-manager"
#: the group of its tokens (their description: ``addon-manager hub-client addon-manager``)
TOKEN_GROUP = f"hub-client {CLIENT_NAME}"
SIGNER_TIMEOUT = 10.0  # seconds for one request to the signer
RETRY_MAX = 30.0  # seconds between attempts to get a first certificate, at most
EXPIRY_CHECK = 60.0  # seconds between checks that the renewed certificate is still valid


@dataclass(frozen=True)
class _Signer:
    namespace: str
    url: str


class HubClientCertificate:
    """Gets and keeps the certificate (:meth:`follow`, a trio task); :meth:`tls` is what the poll
    dials the admin ports with."""

    def __init__(
        self,
        credentials: Credentials,
        directory: Path,
        *,
        metrics: ManagerMetrics,
        log: Any,
        signer_url: str | None = None,
    ) -> None:
        self.credentials = credentials
        self.directory = directory
        self.metrics = metrics
        self.log = log
        self.signer_url = signer_url  # --signer; None: the namespace's Service (AdminTarget.signer_url)
        self.held: str | None = None  # the namespace whose certificate the files hold and the renewer keeps
        self.problem = "getting one from the cert-signer"
        self.token: str | None = None  # minted, not used yet

    def files(self, namespace: str) -> CertFiles:
        folder = self.directory / namespace
        return CertFiles(folder / "tls.crt", folder / "tls.key", folder / "ca.crt")

    def tls(self, namespace: str) -> AdminTLS | str:
        """The TLS for ``namespace``'s proxy-servers (the certificate as renewed so far), or why there
        is none yet. The server name is the caller's to set."""
        if self.held != namespace:
            return self.problem
        files = self.files(namespace)
        try:
            return AdminTLS(client_context(files.cert, files.key, files.ca, alpn=[ALPN_HTTP1]))
        except ConfigError as exc:
            return f"its certificate in {files.cert} is unusable: {exc}"

    def token_ids(self) -> set[str]:
        """The id of the token minted and not used yet (the manager's token pruning keeps it)."""
        return {self.token.split(".", 1)[0]} if self.token else set()

    def _signer(self, target: AdminTarget) -> _Signer:
        return _Signer(target.namespace, self.signer_url or target.signer_url)

    async def follow(self, target: Callable[[], AdminTarget], period: float) -> None:
        """Keep the certificate of the namespace ``target()`` names, checked every ``period`` seconds:
        a new namespace (or signer) cancels the old one's renewals and starts over there."""
        while True:
            signer = self._signer(target())
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._keep, signer)
                while self._signer(target()) == signer:
                    await trio.sleep(period)
                nursery.cancel_scope.cancel()
            self.held, self.token = None, None
            self.problem = f"the proxy-servers left namespace {signer.namespace}: getting a certificate anew"

    async def _keep(self, signer: _Signer) -> None:
        files = self.files(signer.namespace)
        endpoint = SignerEndpoint.parse(signer.url, files.ca, timeout=SIGNER_TIMEOUT)
        while True:
            delay, said = 1.0, ""
            while (problem := await self._obtain(signer.namespace, endpoint, files)) is not None:
                self.problem = f"{problem} (retrying)"
                if problem != said:
                    self.log.warning("client_certificate_missing", signer=endpoint.url, error=problem)
                    said = problem
                await trio.sleep(delay)
                delay = min(2 * delay, RETRY_MAX)
            self.held = signer.namespace
            renewer = CertRenewer(endpoint, files, log=self.log)
            async with trio.open_nursery() as nursery:
                await nursery.start(renewer.run)
                while certclient.usable_credentials(files) is not None:
                    await trio.sleep(EXPIRY_CHECK)
                nursery.cancel_scope.cancel()
            self.held, self.problem = None, f"its certificate in {files.cert} expired: bootstrapping again"
            self.log.warning(
                "client_certificate_expired", cert=str(files.cert), last_error=renewer.last_error
            )

    async def _obtain(self, namespace: str, endpoint: SignerEndpoint, files: CertFiles) -> str | None:
        """A first certificate into ``files`` unless they hold a valid one: None when they do, else
        why not (every failure is retried)."""
        if certclient.usable_credentials(files) is not None:
            return None
        try:
            bundle = await trio.to_thread.run_sync(self._bundle, namespace)
        except StoreError as exc:
            return f"cannot read the trust bundle from the cert-signer's store: {exc}"
        if not bundle:
            return f"the cert-signer's store in namespace {namespace} has no CA yet"
        try:
            files.cert.parent.mkdir(parents=True, exist_ok=True)
            certclient.write_bundle(files.ca, bundle)
        except (OSError, ValueError) as exc:
            return f"cannot write the trust bundle to {files.ca}: {describe_exception(exc)}"
        try:
            await certclient.fetch_trust_bundle(endpoint)
        except SignerRequestError as exc:
            return f"the cert-signer at {endpoint.url} does not answer: {exc}"
        except ConfigError as exc:
            return f"the cert-signer at {endpoint.url}: {exc}"
        try:
            minted = await trio.to_thread.run_sync(
                self.credentials.ensure_token, namespace, TOKEN_GROUP, client_binding(CLIENT_NAME), self.token
            )
        except StoreError as exc:
            return f"cannot mint a bootstrap token in the cert-signer's store: {exc}"
        self.token = minted.token
        if minted.minted:
            self.metrics.tokens_minted.labels("hub-client").inc()
            self.log.info("token_minted", group=TOKEN_GROUP, reason=minted.reason)
        try:
            issued = await certclient.bootstrap_files(
                endpoint, minted.token, files, lambda key: certclient.client_csr(key, CLIENT_NAME)
            )
        except SignerRequestError as exc:
            if not exc.retryable:
                self.token = None  # used, expired or refused: the next attempt mints another
            return f"the cert-signer at {endpoint.url} did not issue the certificate: {exc}"
        except (ConfigError, OSError) as exc:
            return f"the cert-signer at {endpoint.url}: {describe_exception(exc)}"
        self.token = None
        self.log.info(
            "cert_bootstrapped",
            name=CLIENT_NAME,
            serial=issued.serial,
            not_after=issued.not_after.isoformat(),
        )
        return None

    def _bundle(self, namespace: str) -> str:
        """The CA bundle of the store (blocking): what verifies the signer before the first certificate;
        the renewer follows the signer's own afterwards. Never creates a CA: the hub's reconcile or the
        signer's first start does."""
        return self.credentials.store(namespace).read_authorities().bundle_pem()
