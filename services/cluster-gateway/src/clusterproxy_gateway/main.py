"""``cluster-proxy-cluster-gateway``: the aggregated API server of ``cluster.core.oam.dev/v1alpha1``.

::

    cluster-proxy-cluster-gateway --tls-cert serving.crt --tls-key serving.key \\
        --proxy-server proxy-server.NS.svc:8090 --proxy-ca ca.crt --proxy-cert client.crt --proxy-key client.key

Every flag has an environment twin (``CLUSTER_PROXY_GATEWAY_<FLAG>``). See docs/cluster-gateway.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import trio

from clusterproxy_protocol import (
    LOG_FORMATS,
    CertFiles,
    ConfigError,
    add_audit_flag,
    add_certificate_flags,
    add_log_flags,
    add_signer_flags,
    allocator,
    check_without_signer,
    configure_logging,
    existing_file,
    failure_on_stderr,
    flag_adder,
    get_logger,
    load_configuration,
    open_sink,
    parse_args_or_exit,
    parse_duration,
    parse_hostport,
    parse_positive_duration,
    parse_positive_int,
    run_service,
    serve_until_signalled,
    workarounds,
)
from clusterproxy_sdk import TLSFiles, open_shared_tunnel

from .allowlist import DEFAULT_ALLOWLIST, AllowList
from .credentials import (
    make_self_signed,
    prepare_client_certificate,
    prepare_serving_certificate,
    register_ca_bundle,
)
from .inventory import HubInventory, RequestHeaderConfig
from .oidc import DEFAULT_SIGNING_ALGS, SUPPORTED_ALGS, OIDCConfig, OIDCVerifier, parse_required_claim
from .profiles import ProfilePublisher
from .proxy import ClusterProxy
from .server import GatewayServer, serving_context
from .service_proxy import DEFAULT_CREDENTIAL_SECRET, ServiceProxy, ServingCertificate
from .serviceaccounts import ManagedServiceAccounts

ENV_PREFIX = "CLUSTER_PROXY_GATEWAY_"
PROG = "cluster-proxy-cluster-gateway"
DEFAULT_TOKEN_SECRET = "cluster-gateway"
DEFAULT_PROFILE_NAMESPACE = "open-cluster-management"
DEFAULT_SERVICE_PROXY_NAME = "cluster-proxy-service-proxy"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])

    flag = flag_adder(parser, ENV_PREFIX)

    flag("--listen", type=parse_hostport, default="0.0.0.0:9443", metavar="HOST:PORT",
         help="HTTPS address the hub's aggregator calls (port 0: any free port, logged as gateway_started)")  # fmt: skip
    flag("--tls-cert", type=existing_file, metavar="FILE",
         help="serving certificate (the APIService's caBundle must hold its CA; it must name the Service); "
         "default: one made at start for --serving-name, its CA written into --apiservice")  # fmt: skip
    flag("--tls-key", type=existing_file, metavar="FILE", help="its private key")
    flag("--serving-name", multiple=True, metavar="NAME",
         help="names of the serving certificate made at start (default: cluster-gateway.$POD_NAMESPACE.svc)")  # fmt: skip
    flag("--apiservice", metavar="NAME",
         help="the APIService whose caBundle gets the CA of the serving certificate made at start "
         "(e.g. v1alpha1.cluster.core.oam.dev)")  # fmt: skip
    flag("--state-dir", type=Path, default="/var/lib/cluster-gateway", metavar="DIR",
         help="where the serving certificate made at start is written")  # fmt: skip
    flag("--kubeconfig", type=Path, metavar="FILE",
         help="hub kubeconfig (default: $KUBECONFIG, else the pod's service account)")  # fmt: skip
    flag("--proxy-server", type=parse_hostport, required=True, metavar="HOST:PORT",
         help="the proxy-server's client port (HTTP/2 frontend)")  # fmt: skip
    add_certificate_flags(
        flag,
        prefix="--proxy-",
        ca_help="CA bundle that signed the proxy-server's certificate (with --signer: kept current)",
        cert_help="the gateway's hub client certificate (read again at each dial; with --signer: written there)",
        key_help="its private key",
        metavar="FILE",
    )
    add_signer_flags(
        flag,
        signer_help="cert-signer (https://HOST:PORT): get --proxy-cert/--proxy-key with --bootstrap-token when "
        "they hold no valid certificate, renew them, follow the trust bundle",
        token_help="with --signer: a single-use token bound to --client-name "
        "(cluster-proxy-cert-signer token create --client cluster-gateway)",
    )
    flag("--bootstrap-ca", type=Path, metavar="FILE",
         help="with --signer: the trust bundle that seeds --proxy-ca when that file does not exist yet")  # fmt: skip
    flag("--client-name", default="cluster-gateway", metavar="NAME",
         help="with --signer: the name in the client certificate (the token's --client)")  # fmt: skip
    flag("--proxy-server-name", metavar="NAME",
         help="name checked on the proxy-server's certificate (default: the host of --proxy-server)")  # fmt: skip
    flag("--token-secret", default=DEFAULT_TOKEN_SECRET, metavar="NAME",
         help="each cluster's token: the hub Secret of this name in the cluster's namespace (keys token, ca.crt)")  # fmt: skip
    flag("--managed-serviceaccounts", type=bool, default=False,
         help="run the ManagedServiceAccount controller: each MSA's ServiceAccount made in its cluster, its token "
         "asked for through the tunnel and kept in the hub Secret of its name (docs/managed-serviceaccount.md; the "
         "proxy-server's --control-client must name this gateway's client certificate)")  # fmt: skip
    flag("--serviceaccount-interval", type=parse_positive_duration, default="2s", metavar="DURATION",
         help="with --managed-serviceaccounts: how often the ManagedServiceAccounts are looked at")  # fmt: skip
    flag("--serviceaccount-renew-fraction", type=float, default="0.8", metavar="FRACTION",
         help="with --managed-serviceaccounts: a rotated token is renewed after this fraction of its life")  # fmt: skip
    flag("--requestheader-client-ca", type=existing_file, metavar="FILE",
         help="CA of the aggregator's front-proxy client certificate (default: read from the hub's ConfigMap "
         "kube-system/extension-apiserver-authentication, as kube-apiserver publishes it)")  # fmt: skip
    flag("--requestheader-allowed-names", multiple=True, metavar="CN",
         help="common names that certificate may carry (with --requestheader-client-ca; empty: any)")  # fmt: skip
    flag("--cache-ttl", type=parse_positive_duration, default="2s", metavar="DURATION",
         help="how long a read of the hub (clusters, token Secrets) is reused")  # fmt: skip
    flag("--watch-interval", type=parse_positive_duration, default="1s", metavar="DURATION",
         help="a watch of clustergateways looks at the hub this often")  # fmt: skip
    flag("--cluster-profile-namespace", default=DEFAULT_PROFILE_NAMESPACE, metavar="NAMESPACE",
         help="publish a ClusterProfile (multicluster.x-k8s.io, the Cluster Inventory API) per cluster in this "
         "hub namespace, its access provider cluster-proxy pointing at the gateway; '' publishes none")  # fmt: skip
    flag("--cluster-profile-interval", type=parse_positive_duration, default="5s", metavar="DURATION",
         help="how often the ClusterProfiles are made to match the clusters")  # fmt: skip
    flag("--hub-url", metavar="URL",
         help="the hub kube-apiserver's URL in the ClusterProfiles (default: the server of the gateway's own "
         "hub connection)")  # fmt: skip
    flag("--hub-ca", type=existing_file, metavar="FILE",
         help="the CA of the hub kube-apiserver's serving certificate, in the ClusterProfiles (default: the "
         "one the gateway's own hub connection trusts)")  # fmt: skip
    # the hub's HTTPS endpoint per cluster (docs/cluster-gateway.md, "The HTTPS endpoint")
    flag("--service-proxy-listen", type=parse_hostport, metavar="HOST:PORT",
         help="serve https://HOST/<cluster>/<path> here for bearer tokens of the managed clusters and the hub "
         "(unset: no such endpoint; port 0: any free port, logged as service_proxy_started)")  # fmt: skip
    flag("--service-proxy-tls-cert", type=existing_file, metavar="FILE",
         help="its serving certificate (followed when the file changes); default: one from --signer with "
         "--service-proxy-bootstrap-token, else one made at start under --state-dir")  # fmt: skip
    flag("--service-proxy-tls-key", type=existing_file, metavar="FILE", help="its private key")
    flag("--service-proxy-bootstrap-token", metavar="TOKEN",
         help="with --signer: a single-use server token bound to --service-proxy-name and its hosts "
         "(cluster-proxy-cert-signer token create --server NAME --host HOST ...); the certificate is renewed")  # fmt: skip
    flag("--service-proxy-name", default=DEFAULT_SERVICE_PROXY_NAME, metavar="NAME",
         help="the common name of its serving certificate (the server token's --server)")  # fmt: skip
    flag("--service-proxy-host", multiple=True, metavar="HOST",
         help="the names (or IPs) in its serving certificate (default: cluster-gateway.$POD_NAMESPACE.svc)")  # fmt: skip
    flag("--service-proxy-credential-secret", default=DEFAULT_CREDENTIAL_SECRET, metavar="NAME",
         help="each cluster's credential for token and access reviews and impersonation: the hub Secret of this "
         "name in the cluster's namespace (keys token, ca.crt; the ManagedServiceAccount of that name)")  # fmt: skip
    flag("--service-proxy-allowlist", metavar="NAMESPACE/NAME",
         help="the hub ConfigMap listing the in-cluster Services .../proxy-service/ may reach (default: "
         f"$POD_NAMESPACE/{DEFAULT_ALLOWLIST}; none listed: none reachable)")  # fmt: skip
    flag("--service-proxy-hub-tokens", type=bool, default=True,
         help="accept hub tokens (the hub's TokenReview) and impersonate their users; --no-service-proxy-hub-tokens: "
         "managed clusters' own tokens only")  # fmt: skip
    flag("--service-proxy-token-cache-ttl", type=parse_duration, default="10s", metavar="DURATION",
         help="how long a TokenReview's answer (either way) is reused for the same token (0: never)")  # fmt: skip
    flag("--service-proxy-token-cache-size", type=parse_positive_int, default="4096", metavar="N",
         help="at most this many TokenReview answers are kept (the oldest dropped first)")  # fmt: skip
    # OIDC ID tokens at the HTTPS endpoint, verified here (kube-apiserver's --oidc-* flags and meanings)
    flag("--oidc-issuer-url", metavar="URL",
         help="verify the endpoint's bearer tokens of this OIDC issuer (https; their iss exactly) with its "
         "discovery document and keys, after the managed cluster's TokenReview and before the hub's; unset: none")  # fmt: skip
    flag("--oidc-client-id", metavar="AUDIENCE",
         help="with --oidc-issuer-url: the audience its tokens must name (aud)")  # fmt: skip
    flag("--oidc-username-claim", default="sub", metavar="CLAIM", help="the claim that names the user")
    flag("--oidc-username-prefix", default="", metavar="PREFIX",
         help="put before every user name (default: the issuer URL and '#', none for the claim email; '-': none)")  # fmt: skip
    flag("--oidc-groups-claim", default="", metavar="CLAIM",
         help="the claim that lists the user's groups (a string or a list of strings; unset: no groups)")  # fmt: skip
    flag("--oidc-groups-prefix", default="", metavar="PREFIX", help="put before every group name")
    flag("--oidc-required-claim", multiple=True, metavar="KEY=VALUE",
         help="a claim every token must carry with this (string) value")  # fmt: skip
    flag("--oidc-signing-algs", default=",".join(DEFAULT_SIGNING_ALGS), metavar="ALG,...",
         help=f"the signature algorithms accepted, of {','.join(SUPPORTED_ALGS)} (never none or HMAC)")  # fmt: skip
    flag("--oidc-ca-file", type=existing_file, metavar="FILE",
         help="the CA that signed the issuer's HTTPS certificate (default: the system's roots)")  # fmt: skip
    add_audit_flag(flag)  # the HTTPS endpoint's records (frontend service-proxy), one per request
    add_log_flags(flag)
    return parser


def _requestheader(args: argparse.Namespace, inventory: HubInventory) -> RequestHeaderConfig:
    if args.requestheader_client_ca is not None:
        return RequestHeaderConfig(
            client_ca_pem=Path(args.requestheader_client_ca).read_bytes(),
            allowed_names=tuple(args.requestheader_allowed_names),
        )
    try:
        return inventory.requestheader_config()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    except Exception as exc:
        raise ConfigError(
            f"cannot read ConfigMap kube-system/extension-apiserver-authentication from the hub ({exc}); grant "
            "the gateway the Role extension-apiserver-authentication-reader, or pass --requestheader-client-ca"
        ) from None


def profile_publisher(args: argparse.Namespace, inventory: HubInventory) -> ProfilePublisher | None:
    """The ClusterProfile publisher, with the hub's URL and CA from the flags or the gateway's own hub
    connection; None when --cluster-profile-namespace is empty."""
    if not args.cluster_profile_namespace:
        return None
    configuration = inventory.api.configuration
    if args.hub_ca is not None:
        ca: bytes | None = Path(args.hub_ca).read_bytes()
    elif configuration.ssl_ca_cert:
        ca = Path(configuration.ssl_ca_cert).read_bytes()
    else:
        ca = None  # a hub certificate of a public CA: consumers use their system roots
    return ProfilePublisher(
        inventory,
        namespace=args.cluster_profile_namespace,
        hub_url=args.hub_url or configuration.host,
        hub_ca_pem=ca,
        interval=args.cluster_profile_interval,
    )


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Flags that only make sense together, checked before anything starts."""
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    if not 0 < args.serviceaccount_renew_fraction < 1:
        parser.error(
            f"--serviceaccount-renew-fraction {args.serviceaccount_renew_fraction:g} must be between 0 and 1 "
            "(0.8: renew at 80 % of a token's life)"
        )
    if args.tls_cert is None and not args.serving_name and not os.environ.get("POD_NAMESPACE"):
        parser.error(
            "without --tls-cert the gateway makes its serving certificate: name it with --serving-name "
            "(e.g. cluster-gateway.NAMESPACE.svc) or set POD_NAMESPACE"
        )
    if (args.service_proxy_tls_cert is None) != (args.service_proxy_tls_key is None):
        parser.error("--service-proxy-tls-cert and --service-proxy-tls-key go together")
    check_oidc_args(args, parser)
    if args.signer is None:
        tokens = ("--bootstrap-token", "--bootstrap-ca", "--service-proxy-bootstrap-token")
        check_without_signer(
            parser.error,
            tokens=[(name, getattr(args, name[2:].replace("-", "_"))) for name in tokens],
            files=[
                ("--proxy-ca", args.proxy_ca),
                ("--proxy-cert", args.proxy_cert),
                ("--proxy-key", args.proxy_key),
            ],
        )


def check_oidc_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if not args.oidc_issuer_url:
        for name in ("--oidc-client-id", "--oidc-required-claim", "--oidc-ca-file"):
            if getattr(args, name[2:].replace("-", "_")):
                parser.error(f"{name} needs --oidc-issuer-url")
        return
    parts = urlsplit(args.oidc_issuer_url)
    if parts.scheme != "https" or not parts.hostname or parts.query or parts.fragment:
        parser.error(
            f"--oidc-issuer-url {args.oidc_issuer_url!r} must be an https URL without query or fragment "
            "(as kube-apiserver's; the iss of the issuer's tokens, exactly)"
        )
    if not args.oidc_client_id:
        parser.error("--oidc-issuer-url needs --oidc-client-id (the audience its tokens must name)")
    if args.service_proxy_listen is None:
        parser.error("--oidc-issuer-url is for the HTTPS endpoint: it needs --service-proxy-listen")
    for alg in args.oidc_signing_algs.split(","):
        if alg not in SUPPORTED_ALGS:
            parser.error(f"--oidc-signing-algs: {alg!r} is not one of {','.join(SUPPORTED_ALGS)}")
    for claim in args.oidc_required_claim:
        try:
            parse_required_claim(claim)
        except ValueError as exc:
            parser.error(f"--oidc-required-claim: {exc}")


def oidc_verifier(args: argparse.Namespace) -> OIDCVerifier | None:
    if not args.oidc_issuer_url:
        return None
    return OIDCVerifier(
        OIDCConfig(
            issuer=args.oidc_issuer_url,
            client_id=args.oidc_client_id,
            username_claim=args.oidc_username_claim,
            username_prefix=args.oidc_username_prefix,
            groups_claim=args.oidc_groups_claim,
            groups_prefix=args.oidc_groups_prefix,
            required_claims=tuple(parse_required_claim(c) for c in args.oidc_required_claim),
            signing_algs=tuple(args.oidc_signing_algs.split(",")),
            ca_file=Path(args.oidc_ca_file) if args.oidc_ca_file else None,
        )
    )


async def run(
    args: argparse.Namespace, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """The gateway until cancelled (``main``: at SIGTERM or SIGINT)."""
    from kubernetes import client

    task_status.started()  # nothing to wait for: a signal during the start stops it too
    log = get_logger("cluster-gateway")
    api = client.ApiClient(
        load_configuration(args.kubeconfig, flag_env=ENV_PREFIX + "KUBECONFIG").configuration
    )
    inventory = HubInventory(api, token_secret=args.token_secret, ttl=args.cache_ttl)
    requestheader = await trio.to_thread.run_sync(_requestheader, args, inventory)
    if args.tls_cert is not None:
        cert, key = Path(args.tls_cert), Path(args.tls_key)
    else:
        names = args.serving_name or [f"cluster-gateway.{os.environ['POD_NAMESPACE']}.svc"]
        made = make_self_signed(Path(args.state_dir) / "serving", names)
        cert, key = made.cert, made.key
        if args.apiservice:
            await trio.to_thread.run_sync(register_ca_bundle, api, args.apiservice, made.ca_pem)
            log.info("apiservice_ca_registered", apiservice=args.apiservice, names=names)
    context = serving_context(cert, key, requestheader)
    renewer = None
    if args.signer is not None:
        files = CertFiles(Path(args.proxy_cert), Path(args.proxy_key), Path(args.proxy_ca))
        token = (args.bootstrap_token or "").strip() or None
        renewer = await prepare_client_certificate(
            args.signer, files, token, args.bootstrap_ca, args.client_name
        )
        log.info("client_certificate_ready", subject=renewer.certificate.subject.rfc4514_string())
    host, port = args.listen
    proxy_address = f"{args.proxy_server[0]}:{args.proxy_server[1]}"
    tls = TLSFiles(args.proxy_ca, args.proxy_cert, args.proxy_key).reloading()
    async with (
        trio.open_nursery() as nursery,
        open_shared_tunnel(proxy_address, tls, server_hostname=args.proxy_server_name) as tunnel,
    ):
        if renewer is not None:
            await nursery.start(renewer.run)
        publisher = profile_publisher(args, inventory)
        if publisher is not None:
            nursery.start_soon(publisher.run)
        proxy = ClusterProxy(inventory, tunnel, proxy_server=proxy_address)
        server = GatewayServer(inventory, proxy, requestheader, watch_interval=args.watch_interval)
        if args.managed_serviceaccounts:
            accounts = ManagedServiceAccounts(
                api,
                tunnel,
                interval=args.serviceaccount_interval,
                renew_fraction=args.serviceaccount_renew_fraction,
            )
            await nursery.start(accounts.run)
        if args.service_proxy_listen is not None:
            await nursery.start(run_service_proxy, args, inventory, proxy, api)
        listeners = await trio.open_tcp_listeners(port, host=host)
        bound = listeners[0].socket.getsockname()
        log.info(
            "gateway_started",
            listen=f"{bound[0]}:{bound[1]}",
            proxy_server=proxy_address,
            token_secret=args.token_secret,
            cluster_profiles=f"{publisher.namespace} ({publisher.hub_url})" if publisher else "none",
            requestheader_allowed_names=list(requestheader.allowed_names),
        )
        await server.serve(listeners, context)


async def _service_proxy_certificate(args: argparse.Namespace, nursery: trio.Nursery) -> ServingCertificate:
    """From files, from the cert-signer (renewed in ``nursery``), or made at start."""
    if args.service_proxy_tls_cert is not None:
        return ServingCertificate(Path(args.service_proxy_tls_cert), Path(args.service_proxy_tls_key))
    hosts = list(args.service_proxy_host) or [
        f"cluster-gateway.{os.environ.get('POD_NAMESPACE', 'default')}.svc"
    ]
    directory = Path(args.state_dir) / "service-proxy"
    token = (args.service_proxy_bootstrap_token or "").strip() or None
    files = CertFiles(directory / "tls.crt", directory / "tls.key", directory / "ca.crt")
    if args.signer is not None and (token is not None or files.cert.exists()):
        directory.mkdir(parents=True, exist_ok=True)
        bootstrap_ca = args.bootstrap_ca or Path(args.proxy_ca)
        renewer = await prepare_serving_certificate(
            args.signer, files, token, bootstrap_ca, args.service_proxy_name, hosts
        )
        await nursery.start(renewer.run)
        return ServingCertificate(files.cert, files.key)
    made = make_self_signed(directory, hosts)
    get_logger("cluster-gateway").warning(
        "service_proxy_self_signed",
        hosts=hosts,
        ca=made.ca_pem.decode(),
        hint="give it one from the cert-signer",
    )
    return ServingCertificate(made.cert, made.key)


async def run_service_proxy(
    args: argparse.Namespace,
    inventory: HubInventory,
    proxy: ClusterProxy,
    api: Any,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    audit = open_sink(args.audit_log)
    async with trio.open_nursery() as nursery:
        serving = await _service_proxy_certificate(args, nursery)
        oidc = oidc_verifier(args)
        if oidc is not None:
            nursery.start_soon(oidc.refresh)  # its keys at start: a wrong issuer or CA shows in the log now
        where = args.service_proxy_allowlist
        if where is None and os.environ.get("POD_NAMESPACE"):
            where = f"{os.environ['POD_NAMESPACE']}/{DEFAULT_ALLOWLIST}"
        service = ServiceProxy(
            inventory,
            proxy,
            AllowList(api, where or "", ttl=args.cache_ttl),
            hub_api=api if args.service_proxy_hub_tokens else None,
            credential_secret=args.service_proxy_credential_secret,
            cache_ttl=args.service_proxy_token_cache_ttl,
            cache_size=args.service_proxy_token_cache_size,
            audit=audit,
            oidc=oidc,
        )
        host, port = args.service_proxy_listen
        listeners = await trio.open_tcp_listeners(port, host=host)
        bound = listeners[0].socket.getsockname()
        get_logger("cluster-gateway").info(
            "service_proxy_started",
            listen=f"{bound[0]}:{bound[1]}",
            credential_secret=args.service_proxy_credential_secret,
            allowlist=where or "none",
            hub_tokens=args.service_proxy_hub_tokens,
            oidc_issuer=args.oidc_issuer_url or "none",
        )
        task_status.started()
        try:
            await service.serve(listeners, serving)
        finally:
            audit.close()


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> None:
    workarounds.apply()
    allocator.tune()
    parser = build_parser()
    args = parse_args_or_exit(parser, argv, environ=environ)
    check_args(args, parser)
    configure_logging(args.log_level, json=LOG_FORMATS[args.log_format])
    sys.exit(run_service(serve, args, on_failure=failure_on_stderr(PROG)))


async def serve(args: argparse.Namespace) -> None:
    """:func:`run` until SIGTERM/SIGINT (nothing to drain: the aggregator retries elsewhere)."""
    await serve_until_signalled(partial(run, args), get_logger("cluster-gateway"))


if __name__ == "__main__":
    main()
