"""The collector's hub client certificate from the cert-signer (``--signer``).

The probes go through the proxy-server's client port, which wants a hub client certificate. Given
``--signer``, the collector gets one itself: when ``--cert``/``--key`` hold no valid certificate it
trades a bootstrap token (single use, bound to ``--client-name``: ``cluster-proxy-cert-signer token
create --client health-collector``) for one, then renews it at 80 % of its lifetime and follows the
trust bundle in ``--ca`` (CA rotations), like every other party.

The token is ``--bootstrap-token``, or (Kubernetes) the key ``bootstrap-token`` of the Secret
``--bootstrap-secret NAMESPACE/NAME``, read through the API until the first certificate is held; its
``ca.crt`` (the hub's trust bundle) seeds ``--ca`` when that file does not exist yet. So the Secret may
be created, or replaced after a refusal, while the collector runs: no restart.

Until it holds a certificate the collector runs with probes off and says why (a problem on the page, in
the JSON and in ``cluster-proxy health``): no token, a token the signer refused, a signer that does not
answer yet. INSTALLED and AVAILABLE do not need the certificate.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from clusterproxy_protocol import CertFiles, ConfigError, SignerEndpoint, SignerRequestError, certclient

__all__ = [
    "DEFAULT_CLIENT_NAME",
    "BootstrapSecret",
    "CertificateProblem",
    "ClientCertificate",
    "SecretReader",
]

DEFAULT_CLIENT_NAME = "health-collector"
TOKEN_KEY = "bootstrap-token"
CA_KEY = "ca.crt"


@dataclass(frozen=True)
class CertificateProblem:
    """Why the collector holds no client certificate yet, in words; ``retryable``: try again later."""

    message: str
    retryable: bool


@dataclass(frozen=True)
class BootstrapSecret:
    """What the Secret holds: the token, and the hub's trust bundle when it has one."""

    token: str
    ca_pem: str | None


def _token_hint(name: str) -> str:
    return f"`cluster-proxy-cert-signer token create --client {name}`"


class SecretReader:
    """``--bootstrap-secret NAMESPACE/NAME`` through the Kubernetes API (blocking: run in a thread).
    The collector's RBAC: ``get`` on that one Secret."""

    def __init__(self, configuration: Any, namespace: str, name: str, client_name: str, *, timeout: float):
        from kubernetes import client

        self.namespace = namespace
        self.name = name
        self.client_name = client_name
        self.timeout = timeout
        self.api = client.CoreV1Api(client.ApiClient(configuration))

    @property
    def where(self) -> str:
        return f"the Secret {self.namespace}/{self.name}"

    def read(self) -> BootstrapSecret | CertificateProblem:
        from kubernetes.client.exceptions import ApiException

        try:
            secret = self.api.read_namespaced_secret(self.name, self.namespace, _request_timeout=self.timeout)
        except ApiException as exc:
            if exc.status == 404:
                return CertificateProblem(
                    f"probes are off until {self.where} exists: keys {TOKEN_KEY} (a token made with "
                    f"{_token_hint(self.client_name)}) and {CA_KEY} (the hub's trust bundle: "
                    "cluster-proxy-cert-signer trust-bundle); see docs/health.md, 'In Kubernetes'",
                    retryable=True,
                )
            detail = f"HTTP {exc.status} {exc.reason}"
            if exc.status == 403:
                detail += f"; grant the collector's ServiceAccount 'get' on {self.where}"
            return CertificateProblem(f"probes are off: cannot read {self.where}: {detail}", retryable=True)
        except Exception as exc:  # urllib3's connection errors and the like
            return CertificateProblem(
                f"probes wait for a hub client certificate: cannot read {self.where}: the hub's API "
                f"server did not answer: {exc}",
                retryable=True,
            )
        data = secret.data or {}
        try:
            values = {key: base64.b64decode(value).decode().strip() for key, value in data.items()}
        except (binascii.Error, UnicodeDecodeError, TypeError):
            return CertificateProblem(f"probes are off: {self.where} holds a value that is not text", True)
        if not values.get(TOKEN_KEY):
            return CertificateProblem(
                f"probes are off: {self.where} has no key {TOKEN_KEY} (a token made with "
                f"{_token_hint(self.client_name)})",
                retryable=True,
            )
        ca = values.get(CA_KEY)
        return BootstrapSecret(values[TOKEN_KEY], ca + "\n" if ca else None)


class ClientCertificate:
    def __init__(
        self,
        signer: str,
        files: CertFiles,
        *,
        token: str | None = None,
        secret: Callable[[], BootstrapSecret | CertificateProblem] | None = None,
        name: str = DEFAULT_CLIENT_NAME,
    ) -> None:
        self.signer = signer  # https://HOST:PORT
        self.files = files
        self.token = token
        self.secret = secret
        self.name = name
        self.refused: dict[str, CertificateProblem] = {}  # a token of the Secret the signer refused

    @property
    def endpoint(self) -> SignerEndpoint:
        return SignerEndpoint.parse(self.signer, self.files.ca)

    def held(self) -> bool:
        return certclient.usable_credentials(self.files) is not None

    async def obtain(self, log: Any) -> CertificateProblem | None:
        """Bootstrap when the files hold no valid certificate; None once they do. A problem is
        retryable when trying again can help: a signer that did not answer, or a Secret (which can
        appear or change meanwhile)."""
        if self.held():
            return None
        token = self.token
        if self.secret is not None:
            found = await trio.to_thread.run_sync(self.secret)
            if isinstance(found, CertificateProblem):
                return found
            token = found.token
            if found.ca_pem is not None and not Path(self.files.ca).is_file():
                try:
                    certclient.write_bundle(self.files.ca, found.ca_pem)
                except (ValueError, OSError) as exc:
                    return CertificateProblem(
                        f"probes are off: the Secret's {CA_KEY} is unusable: {exc}", True
                    )
            if token in self.refused:
                return self.refused[token]
        if not Path(self.files.ca).is_file():
            return CertificateProblem(
                f"probes are off: the CA bundle {self.files.ca} (--ca) does not exist; it verifies the "
                f"cert-signer and the proxy-server (the hub's trust bundle: cluster-proxy-cert-signer "
                f"trust-bundle)",
                retryable=self.secret is not None,
            )
        if not token:
            return CertificateProblem(
                f"probes are off: no hub client certificate in {self.files.cert} and no --bootstrap-token "
                f"to get one from the cert-signer; create one with {_token_hint(self.name)} and restart "
                "the collector with it",
                retryable=False,
            )
        try:
            issued = await certclient.bootstrap_files(
                self.endpoint, token, self.files, lambda key: certclient.client_csr(key, self.name)
            )
        except SignerRequestError as exc:
            if exc.retryable:
                return CertificateProblem(
                    f"probes wait for a hub client certificate: the cert-signer at {self.signer} did not "
                    f"answer the bootstrap: {exc}; retrying",
                    retryable=True,
                )
            again = "replace the token in the Secret" if self.secret else "restart the collector with it"
            problem = CertificateProblem(
                f"probes are off: the cert-signer at {self.signer} refused the bootstrap token: {exc}; "
                f"create a new one ({_token_hint(self.name)}) and {again}",
                retryable=self.secret is not None,
            )
            self.refused[token] = problem
            return problem
        except (ConfigError, OSError) as exc:
            return CertificateProblem(f"probes wait for a hub client certificate: {exc}; retrying", True)
        log.info(
            "cert_bootstrapped", name=self.name, serial=issued.serial, not_after=issued.not_after.isoformat()
        )
        return None
