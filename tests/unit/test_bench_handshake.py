"""bench.handshake: each of its three server set-ups completes a real TLS 1.3 handshake, with each
key type it can time."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from bench.handshake import KEY_NAMES, Certificates, _contexts, server_seconds
from bench.pki import KEY_TYPES


@pytest.mark.parametrize(("tickets", "verify"), [(True, True), (False, True), (False, False)])
def test_each_setup_handshakes_and_is_what_it_says(tmp_path: Path, tickets: bool, verify: bool) -> None:
    server, client = _contexts(Certificates.in_folder(tmp_path), tickets=tickets, verify_client=verify)
    assert server.num_tickets == (2 if tickets else 0)
    assert server.verify_mode == (ssl.CERT_REQUIRED if verify else ssl.CERT_NONE)
    assert server_seconds(server, client) > 0


def test_a_client_without_the_ca_fails_instead_of_being_timed(tmp_path: Path) -> None:
    server, _ = _contexts(Certificates.in_folder(tmp_path / "a"), tickets=False, verify_client=True)
    _, stranger = _contexts(Certificates.in_folder(tmp_path / "b"), tickets=False, verify_client=True)
    with pytest.raises(ssl.SSLError):
        server_seconds(server, stranger)


def test_a_kept_folder_is_issued_once_then_reused(tmp_path: Path) -> None:
    """``--pki DIR``: a second run (another python3, say) times the same certificates."""
    Certificates.in_folder(tmp_path)
    first = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    assert set(first) == {"ca.crt", "server.crt", "server.key", "client.crt", "client.key"}
    server, client = _contexts(Certificates.in_folder(tmp_path), tickets=False, verify_client=True)
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == first
    assert server_seconds(server, client) > 0


@pytest.mark.parametrize(
    ("key", "kind"),
    [
        ("p256", ec.EllipticCurvePublicKey),
        ("ed25519", ed25519.Ed25519PublicKey),
        ("rsa2048", rsa.RSAPublicKey),
    ],
)
def test_each_key_type_is_issued_as_named_and_handshakes(tmp_path: Path, key: str, kind: type) -> None:
    certificates = Certificates.in_folder(tmp_path, key)
    for name in ("ca", "server", "client"):
        cert = x509.load_pem_x509_certificate((tmp_path / f"{name}.crt").read_bytes())
        assert isinstance(cert.public_key(), kind), name
    server, client = _contexts(certificates, tickets=False, verify_client=True)
    assert server_seconds(server, client) > 0


def test_the_key_types_it_names_are_the_ones_the_pki_issues() -> None:
    assert set(KEY_NAMES) == set(KEY_TYPES)
