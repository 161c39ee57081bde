"""``cluster-proxy-cert-signer``: the signer process and its administration commands.

::

    cluster-proxy-cert-signer serve --store DIR [--listen 0.0.0.0:8443] [--tls-host NAME ...]
    cluster-proxy-cert-signer init --store DIR                     create the CA (serve does it too)
    cluster-proxy-cert-signer token create --store DIR --cluster X [--agent-id A] [--ttl 10m]
    cluster-proxy-cert-signer token create --store DIR --server NAME --host H [--host H ...]
    cluster-proxy-cert-signer token create --store DIR --client NAME [--org O]
    cluster-proxy-cert-signer token list|delete --store DIR
    cluster-proxy-cert-signer status --store DIR [--json]
    cluster-proxy-cert-signer rotate-ca --store DIR [start|activate|retire] [--force]
    cluster-proxy-cert-signer trust-bundle --store DIR [--out FILE]

Every ``serve`` flag has an environment twin ``CLUSTER_PROXY_CERT_SIGNER_<FLAG>``; ``--store`` is
``CLUSTER_PROXY_CERT_SIGNER_STORE`` everywhere.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from clusterproxy_castore.filestore import FileStore
from clusterproxy_castore.rotation import DEFAULT_CA_DAYS, RotationError, ensure_ca
from clusterproxy_castore.store import CertStore, StoreError
from clusterproxy_protocol import (
    LOG_FORMATS,
    ConfigError,
    InvalidValue,
    add_log_flags,
    configure_logging,
    failure_in_log,
    flag_adder,
    get_logger,
    parse_args_or_exit,
    parse_duration,
    parse_hostport,
    parse_positive_float,
    parse_positive_int,
    parse_size,
    run_service,
    serve_until_signalled,
)

from .cli_commands import add_store_flag, open_store_from_args, parse_host, register_certs_commands
from .https import HttpLimits
from .service import SignerConfig, SignerService

ENV = "CLUSTER_PROXY_CERT_SIGNER_"
PROG = "cluster-proxy-cert-signer"


def _cert_ttl(text: str) -> dt.timedelta:
    seconds = parse_duration(text)
    if seconds < 1:
        raise InvalidValue(f"invalid certificate lifetime {text!r}: at least 1s")
    return dt.timedelta(seconds=seconds)


def _rotation_refresh(text: str) -> float:
    seconds = parse_duration(text)
    if 0 < seconds < 1:
        raise InvalidValue(f"invalid rotation refresh {text!r}: at least 1s, or 0 for no hint")
    return seconds


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="The cluster-proxy CA: issues server, agent and client certificates over HTTPS "
        "(bootstrap tokens, mTLS renewal) and rotates the CA with overlap.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = commands.add_parser("serve", help="run the signing API")

    flag = flag_adder(serve, ENV)

    add_store_flag(serve)
    flag("--listen", type=parse_hostport, default="0.0.0.0:8443", help="HTTPS address of the signing API")
    flag(
        "--tls-host",
        type=parse_host,
        multiple=True,
        default=["localhost", "127.0.0.1", "::1"],
        help="names/addresses in the signer's own serving certificate (repeat)",
    )
    flag(
        "--tls-dir",
        type=Path,
        help="where the signer keeps its own certificate (default: STORE/signer "
        "for a files store, else a private temporary folder, deleted when the signer stops)",
    )
    flag("--cert-ttl", type=_cert_ttl, default="24h", help="lifetime of issued certificates")
    flag(
        "--ca-days", type=parse_positive_int, default=str(DEFAULT_CA_DAYS), help="lifetime of a new CA, days"
    )
    flag("--max-body", type=parse_size, default="64KiB", help="largest request body (413 above)")
    flag(
        "--ip-burst",
        type=parse_positive_float,
        default="20",
        help="requests without a client certificate per client IP at once",
    )
    flag(
        "--ip-rate",
        type=parse_positive_float,
        default="2",
        help="requests without a client certificate per client IP per second, sustained",
    )
    flag(
        "--cert-burst",
        type=parse_positive_float,
        default="20",
        help="requests per client certificate (mTLS: renewals, trust reports) at once",
    )
    flag(
        "--cert-rate",
        type=parse_positive_float,
        default="1",
        help="requests per client certificate per second, sustained",
    )
    flag("--token-burst", type=parse_positive_float, default="5", help="attempts per bootstrap token at once")
    flag(
        "--token-rate",
        type=parse_positive_float,
        default="0.0167",
        help="attempts per token per second, sustained",
    )
    flag(
        "--store-poll",
        type=parse_duration,
        default="5s",
        help="how often the CA list is re-read from the store",
    )
    flag(
        "--rotation-refresh",
        type=_rotation_refresh,
        default="5s",
        help="while a CA rotation is under way, ask every party to fetch the trust bundle this often "
        "(sooner than its --trust-refresh), so each step reaches the fleet within seconds; 0: no hint",
    )
    add_log_flags(flag)
    serve.set_defaults(run=_serve, subparser=serve)

    init = commands.add_parser("init", help="create the CA in the store if there is none")
    add_store_flag(init)
    init.add_argument("--ca-days", type=int, default=DEFAULT_CA_DAYS, help="lifetime of the CA in days")
    init.set_defaults(run=_init, subparser=init)

    bundle = commands.add_parser("trust-bundle", help="print the trust bundle (every non-retired CA), PEM")
    add_store_flag(bundle)
    bundle.add_argument("--out", type=Path, help="write it to this file instead")
    bundle.set_defaults(run=_trust_bundle, subparser=bundle)

    register_certs_commands(commands)
    return parser


def _open(args: argparse.Namespace) -> CertStore:
    return open_store_from_args(args)


def _init(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    store = _open(args)
    current = ensure_ca(store, now=dt.datetime.now(dt.UTC), days=args.ca_days)
    assert current.active is not None
    print(f"active CA {current.active.id} {current.active.fingerprint} in {store.description}")
    return 0


def _trust_bundle(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from clusterproxy_protocol import write_bundle

    pem = ensure_ca(_open(args), now=dt.datetime.now(dt.UTC)).bundle_pem()
    if args.out is not None:
        write_bundle(args.out, pem)
    else:
        sys.stdout.write(pem)
    return 0


def config_from_args(args: argparse.Namespace, scratch: Path) -> SignerConfig:
    """The signer's configuration; its own certificate goes to ``--tls-dir``, else STORE/signer for a
    files store, else ``scratch`` (a private folder the caller deletes when the signer stops)."""
    store = _open(args)
    store.check()
    tls_dir = args.tls_dir
    if tls_dir is None:
        tls_dir = store.root / "signer" if isinstance(store, FileStore) else scratch
    return SignerConfig(
        store=store,
        tls_dir=tls_dir,
        listen=args.listen,
        tls_hosts=tuple(args.tls_host),
        cert_ttl=args.cert_ttl,
        ca_days=args.ca_days,
        limits=HttpLimits(max_body=args.max_body),
        ip_burst=args.ip_burst,
        ip_rate=args.ip_rate,
        cert_burst=args.cert_burst,
        cert_rate=args.cert_rate,
        token_burst=args.token_burst,
        token_rate=args.token_rate,
        store_poll=max(0.1, args.store_poll),
        rotation_refresh=args.rotation_refresh,
    )


async def serve(config: SignerConfig) -> None:
    """Run until SIGTERM/SIGINT (nothing to drain: each request is one short exchange)."""
    service = SignerService(config)
    await serve_until_signalled(service.run, service.log)


FAILURES = (ConfigError, RotationError, StoreError, NotImplementedError, OSError)


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    configure_logging(args.log_level, json=LOG_FORMATS[args.log_format])
    in_log = failure_in_log(get_logger("cert-signer"), "signer_failed")

    def failed(errors: list[BaseException]) -> int:
        """A bad setting: status 2 and its message, as for a bad flag; else one ``signer_failed``."""
        config_errors = [e for e in errors if isinstance(e, ConfigError)]
        if config_errors:
            parser.exit(2, f"{PROG}: error: {config_errors[0]}\n")
        return in_log(errors)

    # the signer's key must not outlive it on disk: a folder that goes with the process
    with tempfile.TemporaryDirectory(prefix="cert-signer-") as scratch:
        try:
            config = config_from_args(args, Path(scratch))
        except FAILURES as exc:
            return failed([exc])
        return run_service(serve, config, on_failure=failed, known=FAILURES)


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parse_args_or_exit(parser, argv)
    try:
        code = args.run(args, args.subparser)
    except (StoreError, RotationError, NotImplementedError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        code = 1
    raise SystemExit(code)


if __name__ == "__main__":
    main()
