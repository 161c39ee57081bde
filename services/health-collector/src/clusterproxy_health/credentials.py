"""The collector's hub client certificate from the cert-signer (``--signer``).

The probes go through the proxy-server's client port, which wants a hub client certificate. Given
``--signer``, the collector gets one itself: when ``--cert``/``--key`` hold no valid certificate it
trades ``--bootstrap-token`` (a single-use token bound to ``--client-name``, made with
``cluster-proxy-cert-signer token create --client health-collector``) for one, then renews it at 80 %
of its lifetime and follows the trust bundle in ``--ca`` (CA rotations), like every other party.

Until it holds one the collector runs with probes off and says why (a problem on the page, in the
JSON and in ``cluster-proxy health``): no token, a token the signer refused, a signer that does not
answer yet (retried with a growing delay). INSTALLED and AVAILABLE do not need the certificate.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clusterproxy_protocol import certclient
from clusterproxy_protocol.certclient import CertFiles, SignerEndpoint, SignerRequestError
from clusterproxy_protocol.config import ConfigError

__all__ = ["DEFAULT_CLIENT_NAME", "CertificateProblem", "ClientCertificate"]

DEFAULT_CLIENT_NAME = "health-collector"


@dataclass(frozen=True)
class CertificateProblem:
    """Why the collector holds no client certificate yet, in words; ``retryable``: try again later."""

    message: str
    retryable: bool


@dataclass(frozen=True)
class ClientCertificate:
    signer: str  # https://HOST:PORT
    files: CertFiles
    token: str | None
    name: str = DEFAULT_CLIENT_NAME

    @property
    def endpoint(self) -> SignerEndpoint:
        return SignerEndpoint.parse(self.signer, self.files.ca)

    def held(self) -> bool:
        return certclient.usable_credentials(self.files) is not None

    async def obtain(self, log: Any) -> CertificateProblem | None:
        """Bootstrap when the files hold no valid certificate; None once they do."""
        if self.held():
            return None
        if not Path(self.files.ca).is_file():
            return CertificateProblem(
                f"probes are off: the CA bundle {self.files.ca} (--ca) does not exist; it verifies the "
                f"cert-signer and the proxy-server (the trust bundle: cluster-proxy-cert-signer "
                f"trust-bundle)",
                retryable=False,
            )
        if not self.token:
            return CertificateProblem(
                f"probes are off: no hub client certificate in {self.files.cert} and no --bootstrap-token "
                f"to get one from the cert-signer; create one with `cluster-proxy-cert-signer token create "
                f"--client {self.name}` and restart the collector with it",
                retryable=False,
            )
        try:
            issued = await certclient.bootstrap_files(
                self.endpoint, self.token, self.files, lambda key: certclient.client_csr(key, self.name)
            )
        except SignerRequestError as exc:
            if exc.retryable:
                return CertificateProblem(
                    f"probes wait for a hub client certificate: the cert-signer at {self.signer} did not "
                    f"answer the bootstrap: {exc}; retrying",
                    retryable=True,
                )
            return CertificateProblem(
                f"probes are off: the cert-signer at {self.signer} refused the bootstrap token: {exc}; "
                f"create a new one (`cluster-proxy-cert-signer token create --client {self.name}`) and "
                "restart the collector with it",
                retryable=False,
            )
        except (ConfigError, OSError) as exc:
            return CertificateProblem(
                f"probes wait for a hub client certificate: {exc}; retrying", retryable=True
            )
        log.info(
            "cert_bootstrapped", name=self.name, serial=issued.serial, not_after=issued.not_after.isoformat()
        )
        return None
