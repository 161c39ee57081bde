"""Prometheus view of a certificate renewer (:class:`~clusterproxy_protocol.renewer.CertRenewer`),
the same families for every service, under the service's prefix."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from cryptography import x509
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class RenewerCounters(Protocol):
    renewals: int
    early_renewals: int
    failures: int
    trust_updates: int

    @property
    def certificate(self) -> x509.Certificate: ...


class RenewerCollector(Collector):
    """``<prefix>cert_renewals_total``, ``cert_early_renewals_total``, ``cert_renewal_failures_total``,
    ``trust_bundle_updates_total`` and ``cert_not_after_seconds``, read from the renewer when
    scraped."""

    def __init__(self, renewer: RenewerCounters, prefix: str) -> None:
        self._renewer = renewer
        self._prefix = prefix

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        r, p = self._renewer, self._prefix
        yield CounterMetricFamily(p + "cert_renewals", "Certificate renewals done", value=r.renewals)
        yield CounterMetricFamily(
            p + "cert_early_renewals",
            "Renewals done early because the certificate was not from the active CA (a CA rotation)",
            value=r.early_renewals,
        )
        yield CounterMetricFamily(p + "cert_renewal_failures", "Failed renewal attempts", value=r.failures)
        yield CounterMetricFamily(
            p + "trust_bundle_updates", "Trust bundle changes loaded", value=r.trust_updates
        )
        try:
            not_after = r.certificate.not_valid_after_utc.timestamp()
        except Exception:  # the file is being replaced: skip this scrape's value
            return
        yield GaugeMetricFamily(
            p + "cert_not_after_seconds", "Expiry of the current certificate (Unix time)", value=not_after
        )
