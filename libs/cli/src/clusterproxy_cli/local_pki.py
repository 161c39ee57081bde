"""The certificates of ``cluster-proxy local up``: prepared with the cert-signer's own commands
(``cluster-proxy-cert-signer init|trust-bundle|token create``, run as processes), or static ones from
a development CA (``--no-cert-signer``)."""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from pathlib import Path

import trio
from cryptography import x509
from cryptography.exceptions import InvalidSignature

from clusterproxy_protocol import CertFiles, DevCA, PemPair, certclient

from .commands import SIGNER, signer_command_argv
from .local_plan import (
    CLIENT_NAME,
    SERVER_HOSTS,
    SERVER_NAME,
    TOKEN_TTL,
    Certificates,
    Party,
    agent_id,
)
from .local_supervise import describe_exit


class SignerCommandError(Exception):
    """A ``cluster-proxy-cert-signer`` command failed; the message names it and quotes its error."""


async def run_signer_command(store: Path, *command: str) -> str:
    """Run ``cluster-proxy-cert-signer COMMAND... --store STORE``; its standard output."""
    result = await trio.run_process(
        signer_command_argv(command, store), capture_stdout=True, capture_stderr=True, check=False
    )
    if result.returncode != 0:
        error = result.stderr.decode(errors="replace").strip() or "(no output)"
        raise SignerCommandError(
            f"`{shlex.join([SIGNER, *command])}` {describe_exit(result.returncode)}: {error}"
        )
    return result.stdout.decode()


def issued_by_bundle(cert: x509.Certificate, bundle_pem: str) -> bool:
    """Whether one of the CAs of ``bundle_pem`` signed ``cert``."""
    for ca in x509.load_pem_x509_certificates(bundle_pem.encode()):
        try:
            cert.verify_directly_issued_by(ca)
            return True
        except (ValueError, TypeError, InvalidSignature):
            continue
    return False


async def prepare_signer_pki(store: Path, parties: Sequence[Party]) -> dict[str, str]:
    """Create the CA (once), give every party the current trust bundle, and a bootstrap token to each
    party without a usable certificate (missing, expired, or from a CA no longer trusted): party name
    -> token."""
    await run_signer_command(store, "init")
    bundle = await run_signer_command(store, "trust-bundle")
    needing = []
    for party in parties:
        files = party.files
        files.cert.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        certclient.write_bundle(files.ca, bundle)
        cert = certclient.usable_credentials(files)
        if cert is not None and issued_by_bundle(cert, bundle):
            continue
        for stale in (files.cert, files.key):
            stale.unlink(missing_ok=True)
        needing.append(party)
    tokens: dict[str, str] = {}

    async def create_token(party: Party) -> None:
        created = await run_signer_command(
            store,
            "token",
            "create",
            *party.binding,
            "--ttl",
            TOKEN_TTL,
            "--description",
            f"local up: {party.name}",
            "--json",
        )
        tokens[party.name] = json.loads(created)["token"]

    async with trio.open_nursery() as nursery:
        for party in needing:
            nursery.start_soon(create_token, party)
    return tokens


def issue_certificates(
    pki_dir: Path, clusters: Sequence[str], servers: Sequence[str] = (SERVER_NAME,)
) -> Certificates:
    """Static certificates from a development CA kept in ``pki_dir`` (``local up --no-cert-signer``):
    the CA is created once and reused; leaves are issued fresh on each start and never renewed (one
    per proxy-server process, in a file of its name)."""
    ca = DevCA.create_or_load(pki_dir)

    def files(pair: PemPair) -> CertFiles:
        return CertFiles(pair.cert, pair.key, ca.ca_path)

    return Certificates(
        ca=ca.ca_path,
        servers={
            name: files(ca.issue_server(SERVER_NAME, list(SERVER_HOSTS), pki_dir, stem=name))
            for name in servers
        },
        client=files(ca.issue_client(CLIENT_NAME, pki_dir)),
        agents={cluster: files(ca.issue_agent(cluster, agent_id(cluster), pki_dir)) for cluster in clusters},
    )
