"""The renewer's Prometheus families, read from the renewer at each scrape."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from prometheus_client import CollectorRegistry

from clusterproxy_protocol.pki import DevCA
from clusterproxy_protocol.renewal_metrics import RenewerCollector


@dataclass
class Counts:
    certificate: x509.Certificate
    renewals: int = 0
    early_renewals: int = 0
    failures: int = 0
    trust_updates: int = 0


def test_every_counter_of_the_renewer_is_scraped_under_the_prefix(tmp_path: Path) -> None:
    ca = DevCA.create_or_load(tmp_path / "ca", name="metrics-ca")
    leaf = ca.issue_server("server", ["localhost"], tmp_path / "leaf", stem="server")
    counts = Counts(x509.load_pem_x509_certificate(leaf.cert.read_bytes()))
    registry = CollectorRegistry()
    registry.register(RenewerCollector(counts, "cluster_proxy_test_"))
    counts.renewals, counts.early_renewals, counts.failures, counts.trust_updates = 3, 1, 2, 4

    def sample(name: str) -> float | None:
        return registry.get_sample_value(f"cluster_proxy_test_{name}")

    assert sample("cert_renewals_total") == 3
    assert sample("cert_early_renewals_total") == 1
    assert sample("cert_renewal_failures_total") == 2
    assert sample("trust_bundle_updates_total") == 4
    not_after = counts.certificate.not_valid_after_utc
    assert sample("cert_not_after_seconds") == not_after.timestamp()
    assert not_after > dt.datetime.now(dt.UTC)
