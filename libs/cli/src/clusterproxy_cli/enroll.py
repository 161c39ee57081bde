"""``cluster-proxy enroll``: trade a client bootstrap token for a hub client certificate.

An operator creates the token on the signer's store (``cluster-proxy-cert-signer token create
--client NAME``, in Kubernetes mode with ``--store kubernetes:NAMESPACE/PREFIX``) and hands it over;
the user runs this once: a key is generated here (it never leaves the machine), the signer checks the
token and the CSR's name against its binding and answers with the certificate and the trust bundle.
The files are what curl, kubectl, the SDK and ``port-forward`` take.
"""

from __future__ import annotations

import argparse
import datetime as dt
from pathlib import Path

import trio

from clusterproxy_protocol import (
    CertFiles,
    ConfigError,
    SignerEndpoint,
    SignerRequestError,
    add_flag,
    certclient,
    existing_file,
)

__all__ = ["add_enroll_command", "enroll", "run_enroll"]

TOKEN_ENV = "CLUSTER_PROXY_ENROLL_TOKEN"
REQUIRED = (("signer", "CLUSTER_PROXY_SIGNER"), ("ca", "CLUSTER_PROXY_CA"), ("token", TOKEN_ENV),
            ("name", "CLUSTER_PROXY_CLIENT_NAME"))  # fmt: skip


def files_in(directory: Path) -> CertFiles:
    return CertFiles(directory / "client.crt", directory / "client.key", directory / "ca.crt")


def add_enroll_command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    enroll_parser = commands.add_parser(
        "enroll",
        help="get a hub client certificate from the cert-signer with a bootstrap token",
        description="Generate a key here, send a CSR with the bootstrap token to the cert-signer and "
        "write OUT/client.crt, OUT/client.key (0600) and OUT/ca.crt (the trust bundle). The token comes "
        "from `cluster-proxy-cert-signer token create --client NAME` (single use, short-lived); NAME "
        f"must be the one it was created for. Give the token through {TOKEN_ENV} rather than --token "
        "to keep it out of the process list.",
    )
    add_flag(enroll_parser, "--signer", env="CLUSTER_PROXY_SIGNER",
             help="the cert-signer, https://HOST:PORT")  # fmt: skip
    add_flag(enroll_parser, "--ca", env="CLUSTER_PROXY_CA", type=existing_file,
             help="CA bundle to verify the signer with (the hub's CA)")  # fmt: skip
    add_flag(enroll_parser, "--token", env=TOKEN_ENV, help="the client bootstrap token")
    add_flag(enroll_parser, "--name", env="CLUSTER_PROXY_CLIENT_NAME",
             help="the client name the token is bound to")  # fmt: skip
    add_flag(enroll_parser, "--org", env="CLUSTER_PROXY_CLIENT_ORG",
             help="the organization the token is bound to, if any")  # fmt: skip
    add_flag(enroll_parser, "--out", env="CLUSTER_PROXY_ENROLL_OUT", type=Path, default=".",
             help="folder for client.crt, client.key and ca.crt")  # fmt: skip
    add_flag(enroll_parser, "--server-name", env="CLUSTER_PROXY_SIGNER_SERVER_NAME",
             help="name checked against the signer's certificate (default: the host of --signer)")  # fmt: skip
    enroll_parser.add_argument("--force", action="store_true",
                               help="replace a certificate in OUT that is still valid")  # fmt: skip
    return enroll_parser


def enroll(args: argparse.Namespace) -> str:
    """Run the enrolment; returns what to tell the user. Raises ConfigError or SignerRequestError."""
    missing = [f"--{flag} (or {env})" for flag, env in REQUIRED if not getattr(args, flag)]
    if missing:
        # checked here: the CLI's flag parser enforces `required` across every sub-command
        raise ConfigError(f"missing {', '.join(missing)}")
    out: Path = args.out
    files = files_in(out)
    current = certclient.usable_credentials(files)
    if current is not None and not args.force:
        raise ConfigError(
            f"{files.cert} holds a valid certificate (until {current.not_valid_after_utc:%Y-%m-%d %H:%M} "
            "UTC): use it, or --force to replace it"
        )
    endpoint = SignerEndpoint.parse(args.signer, args.ca, server_name=args.server_name)
    out.mkdir(parents=True, exist_ok=True)
    issued = trio.run(
        certclient.bootstrap_files,
        endpoint,
        args.token,
        files,
        lambda key: certclient.client_csr(key, args.name, args.org),
    )
    left = issued.not_after - dt.datetime.now(dt.UTC)
    return (
        f"enrolled as client {args.name!r}: certificate serial {issued.serial[:12]}, valid until "
        f"{issued.not_after:%Y-%m-%d %H:%M} UTC ({left.total_seconds() / 3600:.1f} h)\n"
        f"  certificate  {files.cert}\n  key          {files.key}\n  trust bundle {files.ca}\n"
        f"use them as --proxy-cert/--proxy-key/--proxy-cacert (curl), client-certificate/client-key "
        f"(kubectl proxy-url), or --cert/--key/--ca (cluster-proxy port-forward); enrol again with a new "
        f"token before it expires"
    )


def run_enroll(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        print(enroll(args))
    except (ConfigError, SignerRequestError, OSError) as exc:
        raise SystemExit(f"cluster-proxy enroll: {exc}") from None
    return 0
