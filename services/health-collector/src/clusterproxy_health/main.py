"""``cluster-proxy-health-collector``: command line, the HTTP port, the rounds.

::

    cluster-proxy-health-collector --admin-url https://hub:8092 --proxy hub:8090 \\
        --ca ca.crt --cert client.crt --key client.key [--kubernetes --kubeconfig hub.kubeconfig]

``--once`` runs one round, prints the ``/api/v1/clusters`` document on stdout and exits (0): what
``cluster-proxy health`` runs when no collector is running.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import trio

from clusterproxy_protocol import (
    CLUSTER_NAME,
    LOG_FORMATS,
    ConfigError,
    InvalidValue,
    Response,
    SignerSettings,
    add_certificate_flags,
    add_log_flags,
    add_signer_flags,
    check_without_signer,
    configure_logging,
    existing_file,
    failure_on_stderr,
    flag_adder,
    format_authority,
    get_logger,
    listen_on,
    metrics_response,
    parse_args_or_exit,
    parse_hostport,
    parse_positive_duration,
    parse_positive_int,
    run_service,
    serve_admin,
    serve_until_signalled,
    workarounds,
)

from .collector import Collector, CollectorSettings, run_with
from .credentials import DEFAULT_CLIENT_NAME
from .page import PAGE_HEADERS, page_html
from .probe import parse_probe_url
from .servers import parse_admin_url

__all__ = ["build_parser", "main", "parse_settings", "serve"]

PROG = "cluster-proxy-health-collector"
ENV_PREFIX = "CLUSTER_PROXY_HEALTH_"


def _dialable(text: str) -> tuple[str, int]:
    raw = text
    if text.startswith("https://"):
        text = text[len("https://") :].rstrip("/").rpartition("@")[2]
    host, port = parse_hostport(text)
    if port == 0 or not host:
        raise InvalidValue(f"invalid address {raw!r}: HOST:PORT with a port 1-65535")
    return host, port


def _secret_name(text: str) -> tuple[str, str]:
    namespace, _, name = text.strip().partition("/")
    if not CLUSTER_NAME.match(namespace) or not CLUSTER_NAME.match(name):
        raise InvalidValue(f"invalid Secret {text!r}: NAMESPACE/NAME")
    return namespace, name


def _client_name(text: str) -> str:
    if not CLUSTER_NAME.match(text.strip()):
        raise InvalidValue(f"invalid client name {text!r}: lower-case letters, digits, '-' and '.'")
    return text.strip()


def _addon_name(text: str) -> str:
    if not CLUSTER_NAME.match(text.strip()):
        raise InvalidValue(f"invalid addon name {text!r}: a Kubernetes object name")
    return text.strip()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="cluster-proxy health-collector: reads which agents each proxy-server replica holds, "
        "probes every cluster through its tunnel on an interval, and serves the answer on one port: "
        "/api/v1/clusters (JSON), /metrics (Prometheus), /healthz, /readyz and / (a page).",
    )

    flag = flag_adder(parser, ENV_PREFIX)

    flag("--listen", type=parse_hostport, default="0.0.0.0:8080", metavar="HOST:PORT",
         help="plain HTTP: / /api/v1/clusters /metrics /healthz /readyz (port 0: any free port)")  # fmt: skip
    flag("--admin-url", type=parse_admin_url, multiple=True, metavar="URL",
         help="admin port of a proxy-server replica, https://HOST:PORT (repeat for every replica): its "
         "agents and clusters, read over mutual TLS with --cert")  # fmt: skip
    flag("--admin-service", type=_dialable, metavar="HOST:PORT",
         help="a name whose every address is a replica's admin port, resolved each round (Kubernetes: "
         "the headless Service, cluster-proxy-admin.NAMESPACE.svc:8092)")  # fmt: skip
    flag("--proxy", type=_dialable, metavar="HOST:PORT",
         help="the proxy-server's client port the probes go through (without it: no probes)")  # fmt: skip
    add_certificate_flags(
        flag,
        ca_help="CA bundle that signed the proxy-server's certificate (with --signer: the cert-signer's "
        "too, kept current there)",
        cert_help="hub client certificate (followed when renewed; with --signer: written there)",
        key_help="its private key",
        required=False,  # asked for below, with why
        metavar="FILE",
    )
    add_signer_flags(
        flag,
        signer_help="cert-signer (https://HOST:PORT, verified with --ca): get --cert/--key with "
        "--bootstrap-token when they hold no valid certificate, renew them at 80% of their lifetime, "
        "follow the trust bundle in --ca",
        token_help="with --signer: a single-use token bound to --client-name (cluster-proxy-cert-signer "
        "token create --client NAME); better given as its environment twin",
    )
    flag("--bootstrap-secret", type=_secret_name, metavar="NAMESPACE/NAME",
         help="with --signer, instead of --bootstrap-token: a Secret (keys bootstrap-token and ca.crt, the "
         "hub's trust bundle, which seeds --ca) read through the Kubernetes API until the first "
         "certificate; it may be created or replaced while the collector runs")  # fmt: skip
    flag("--client-name", type=_client_name, default=DEFAULT_CLIENT_NAME,
         help="with --signer: the name in the client certificate (the token's --client)")  # fmt: skip
    flag(
        "--server-name",
        metavar="NAME",
        help="name checked on the proxy-server's certificate, on its client and admin ports (default: "
        "the --proxy host; for --admin-url without --proxy, the URL's host)",
    )
    flag("--probe-url", type=parse_probe_url, default="https://{cluster}:443/healthz", metavar="URL",
         help="what each probe requests inside each cluster; {cluster} is the cluster's name (the bare "
         "name reaches its kube-apiserver); schemes https, http, tcp (connect only)")  # fmt: skip
    flag("--probe-ca", type=existing_file, metavar="FILE",
         help="verify the probe target's certificate with this bundle (default: not verified)")  # fmt: skip
    flag("--probe-server-name", metavar="NAME",
         help="name checked on the probe target's certificate (default: kubernetes.default.svc for the "
         "bare cluster name, else the host)")  # fmt: skip
    flag("--interval", type=parse_positive_duration, default="10s", metavar="DURATION",
         help="a round (servers, addons, every probe) starts this often")  # fmt: skip
    flag("--probe-timeout", type=parse_positive_duration, default="5s", metavar="DURATION",
         help="bound of one probe, from the dial to the answer's end")  # fmt: skip
    flag("--server-timeout", type=parse_positive_duration, default="5s", metavar="DURATION",
         help="bound of the questions to one proxy-server's admin port")  # fmt: skip
    flag("--max-concurrent-probes", type=parse_positive_int, default="64",
         help="probes in flight at once (keep it below the server's --max-pending-dials-per-connection)")  # fmt: skip
    flag("--history", type=parse_positive_int, default="60", help="probe results kept per cluster")
    flag("--forget-after", type=parse_positive_duration, default="1h", metavar="DURATION",
         help="a cluster no source mentions any more leaves the table after this long")  # fmt: skip
    flag("--kubernetes", type=bool, default=False,
         help="Kubernetes mode: installed and available come from each cluster's ManagedClusterAddOn")  # fmt: skip
    flag("--kubeconfig", type=Path, metavar="FILE",
         help="hub kubeconfig for --kubernetes (default: $KUBECONFIG, the pod's service account)")  # fmt: skip
    flag("--addon-name", type=_addon_name, default="cluster-proxy", help="the ManagedClusterAddOn's name")
    flag("--once", type=bool, default=False,
         help="one round, print the /api/v1/clusters document on stdout, exit")  # fmt: skip
    add_log_flags(flag)
    return parser


def parse_settings(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[CollectorSettings, bool]:
    """The settings and ``--once``; a bad value exits with status 2 and a message naming it."""
    parser = build_parser()
    args = parse_args_or_exit(parser, argv, environ=environ)
    tls_files = (("--ca", args.ca), ("--cert", args.cert), ("--key", args.key))
    missing = [f for f, v in tls_files if v is None]
    if missing:
        parser.error(
            f"give {', '.join(missing)}: the hub client certificate that the proxy-servers' admin API "
            "(agents and clusters, mutual TLS) and the probes want"
        )
    if args.bootstrap_token and args.bootstrap_secret:
        parser.error("give the token once: --bootstrap-token or --bootstrap-secret")
    signer = SignerSettings.from_args(args)
    if signer is None:
        tokens = [("--bootstrap-token", args.bootstrap_token), ("--bootstrap-secret", args.bootstrap_secret)]
        check_without_signer(parser.error, tokens=tokens, files=tls_files)
    elif args.proxy is None:
        parser.error("--signer needs --proxy: the client certificate is for the probes through it")
    if not args.admin_url and args.admin_service is None:
        parser.error(
            "name the proxy-servers: --admin-url https://HOST:PORT (repeat) or --admin-service HOST:PORT"
        )
    probe = args.probe_url
    if args.probe_ca is not None or args.probe_server_name:
        from dataclasses import replace

        probe = replace(probe, ca=args.probe_ca, server_name=args.probe_server_name)
    settings = CollectorSettings(
        admin_urls=list(dict.fromkeys(args.admin_url)),
        admin_service=args.admin_service,
        proxy=args.proxy,
        ca=args.ca,
        cert=args.cert,
        key=args.key,
        server_name=args.server_name,
        signer=signer.url if signer else None,
        bootstrap_token=signer.bootstrap_token if signer else None,
        bootstrap_secret=args.bootstrap_secret,
        client_name=args.client_name,
        probe=probe,
        interval=args.interval,
        probe_timeout=args.probe_timeout,
        server_timeout=args.server_timeout,
        max_concurrent_probes=args.max_concurrent_probes,
        history=args.history,
        forget_after=args.forget_after,
        kubernetes=args.kubernetes or args.kubeconfig is not None,
        kubeconfig=args.kubeconfig,
        addon_name=args.addon_name,
        listen=args.listen,
        log_level=args.log_level,
        log_format=args.log_format,
    )
    return settings, args.once


def routes(collector: Collector) -> dict[str, Any]:
    def ready() -> Response:
        if collector.state.rounds == 0:
            return Response.text("not ready: the first round has not finished", 503)
        return Response.text(f"ready: {len(collector.state.clusters)} cluster(s)")

    page = page_html()
    return {
        "/": lambda: Response(200, page, PAGE_HEADERS, content_type="text/html; charset=utf-8"),
        "/api/v1/clusters": lambda: Response(200, collector.published),
        "/metrics": lambda: metrics_response(collector.metrics.registry),
        "/healthz": lambda: Response.text("ok"),
        "/readyz": ready,
    }


def _addon_reader(settings: CollectorSettings) -> Any:
    if not settings.kubernetes:
        return None
    from .addons import AddonReader, hub_configuration

    reader = AddonReader(
        hub_configuration(settings.kubeconfig), settings.addon_name, timeout=settings.server_timeout
    )
    return reader.read


async def serve(
    settings: CollectorSettings, *, task_status: trio.TaskStatus[Collector] = trio.TASK_STATUS_IGNORED
) -> None:
    """Listen, then run rounds until cancelled (SIGTERM or SIGINT in ``main``)."""
    listeners, address = await listen_on("--listen", settings.listen)
    read_addons = _addon_reader(settings)

    async def body(collector: Collector) -> None:
        collector.address = address
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_admin, listeners, routes(collector))
            get_logger("clusterproxy_health").info(
                "collector_started",
                listen=address,
                url=f"http://{address}/",
                admin_urls=settings.admin_urls,
                admin_service=format_authority(*settings.admin_service) if settings.admin_service else None,
                proxy=format_authority(*settings.proxy) if settings.proxy else None,
                probe=settings.probe.url,
                interval=settings.interval,
                kubernetes=settings.kubernetes,
            )
            await nursery.start(collector.run)
            task_status.started(collector)

    await run_with(settings, body, read_addons=read_addons)


async def once(settings: CollectorSettings) -> dict[str, Any]:
    document: dict[str, Any] = {}

    async def body(collector: Collector) -> None:
        await collector.round()
        document.update(collector.document())

    await run_with(settings, body, read_addons=_addon_reader(settings))
    return document


async def _until_signal(settings: CollectorSettings) -> None:
    log = get_logger("clusterproxy_health")
    await serve_until_signalled(partial(serve, settings), log, first_event="stopping")


def main(argv: Sequence[str] | None = None) -> None:
    workarounds.apply()
    settings, run_once = parse_settings(argv)
    configure_logging(settings.log_level, json=LOG_FORMATS[settings.log_format])
    # h2's and hpack's debug lines are one per frame and header: a thousand probes a round drown the log
    for noisy in ("h2", "hpack"):
        logging.getLogger(noisy).setLevel(max(logging.INFO, logging.getLogger(noisy).level))
    failed = failure_on_stderr(PROG)
    if run_once:

        async def print_once() -> None:
            document = await once(settings)
            sys.stdout.write(json.dumps(document, indent=2, sort_keys=True) + "\n")

        sys.exit(run_service(print_once, on_failure=failed, known=(ConfigError,)))
    sys.exit(run_service(_until_signal, settings, on_failure=failed, known=(ConfigError,)))


if __name__ == "__main__":
    main()
