"""``cluster-proxy kubectl CLUSTER [-- ARGS]``: the real kubectl against a managed cluster's
kube-apiserver, through the tunnel.

It runs the local proxy of ``cluster-proxy proxy`` in this process on an ephemeral loopback port,
writes a temporary kubeconfig (mode 0600, deleted at exit) and runs kubectl with ARGS on it::

    server: https://CLUSTER                               # the bare cluster name: its kube-apiserver
    proxy-url: socks5://CLUSTER@127.0.0.1:PORT            # the in-process proxy; the user names the cluster
    certificate-authority: the API server's CA            # --cluster-ca, or the --kubeconfig context's
    tls-server-name: kubernetes.default.svc               # --tls-server-name; on every API server's certificate

kubectl resolves nothing: Go hands ``CLUSTER`` to the SOCKS5 proxy as a name, the agent maps its own
cluster name to its kube-apiserver. SOCKS5 rather than an ``https://`` proxy URL because Go verifies an
HTTPS proxy and the target with one TLS configuration; through SOCKS5 the TLS to the API server is
kubectl's own, end to end, and this process holds the hub certificate. The server name kubectl checks
is ``kubernetes.default.svc`` unless told otherwise: SNI and verification would otherwise use the
cluster name, which an API server's certificate does not carry.

The managed cluster's credentials are the user's: ``--token``/``--token-file``,
``--client-certificate``/``--client-key``, or a context of an existing kubeconfig (``--kubeconfig FILE
[--context NAME]``: its user and CA; its server and proxy-url are replaced). Flags win over the
context. kubectl's exit status is ours; Ctrl-C reaches kubectl (and SIGTERM is passed on to it).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import trio
import yaml

from clusterproxy_protocol import (
    LOG_LEVELS,
    ConfigError,
    TunnelError,
    add_flag,
    configure_logging,
    existing_file,
    get_logger,
)
from clusterproxy_sdk import check_cluster, format_authority

from .hubtunnel import add_hub_flags, followed_tls, resolve_hub
from .kubeconfig import PATH_KEYS, _absolute, _named
from .proxy import LocalProxy, run_local_proxy

API_SERVER_NAME = "kubernetes.default.svc"  # on every kube-apiserver's serving certificate


@dataclass(frozen=True)
class KubeAccess:
    """How kubectl reaches and authenticates to the managed cluster's API server."""

    cluster: dict[str, Any]  # kubeconfig cluster fields other than server and proxy-url
    user: dict[str, Any]  # kubeconfig user fields


def _from_kubeconfig(path: Path, context: str | None) -> KubeAccess:
    try:
        document = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--kubeconfig {path}: {exc}") from None
    what = f"the kubeconfig {path}"
    context_name = context or document.get("current-context")
    if not context_name:
        raise ConfigError(f"{what} has no current-context; pass --context")
    entry = _named(document.get("contexts"), context_name, "context", path, what=what)["context"]
    cluster = _named(document.get("clusters"), entry.get("cluster", ""), "cluster", path, what=what)[
        "cluster"
    ]
    user_name = entry.get("user", "")
    user = _named(document.get("users"), user_name, "user", path, what=what)["user"] if user_name else {}
    base = path.resolve().parent
    _absolute(cluster, PATH_KEYS["cluster"], base)
    _absolute(user, PATH_KEYS["user"], base)
    # Kept: what verifies the API server (CA, tls-server-name, insecure-skip-tls-verify). Replaced:
    # where it is (server, proxy-url); dropped: whatever else pointed at the old address.
    kept = (
        "certificate-authority",
        "certificate-authority-data",
        "tls-server-name",
        "insecure-skip-tls-verify",
    )
    return KubeAccess({key: cluster[key] for key in kept if key in cluster}, user)


def access_from_args(args: argparse.Namespace) -> KubeAccess:
    """The cluster and user fields from the flags, over the ``--kubeconfig`` context's when given.
    Raises ConfigError for what cannot work."""
    access = KubeAccess({}, {})
    if args.kubeconfig is not None:
        access = _from_kubeconfig(args.kubeconfig, args.context)
    elif args.context is not None:
        raise ConfigError("--context needs --kubeconfig FILE (the kubeconfig it is a context of)")
    cluster, user = dict(access.cluster), dict(access.user)
    if args.cluster_ca is not None:
        cluster.pop("certificate-authority-data", None)
        cluster["certificate-authority"] = str(Path(args.cluster_ca).resolve())
    if args.insecure:
        for key in ("certificate-authority", "certificate-authority-data", "tls-server-name"):
            cluster.pop(key, None)
        cluster["insecure-skip-tls-verify"] = True
    elif not cluster.get("certificate-authority") and not cluster.get("certificate-authority-data"):
        raise ConfigError(
            "kubectl needs the CA of the cluster's kube-apiserver to verify it: --cluster-ca FILE, or "
            "--kubeconfig FILE whose context has it (or --insecure to skip verification)"
        )
    else:
        cluster.pop("insecure-skip-tls-verify", None)
        if args.tls_server_name:
            cluster["tls-server-name"] = args.tls_server_name
        cluster.setdefault("tls-server-name", API_SERVER_NAME)
    if args.token is not None or args.token_file is not None:
        for key in ("token", "tokenFile", "client-certificate", "client-key", "client-certificate-data",
                    "client-key-data", "exec", "auth-provider", "username", "password"):  # fmt: skip
            user.pop(key, None)
        if args.token is not None:
            user["token"] = args.token
        else:
            user["tokenFile"] = str(Path(args.token_file).resolve())
    if (args.client_certificate is None) != (args.client_key is None):
        raise ConfigError("--client-certificate and --client-key go together")
    if args.client_certificate is not None:
        for key in ("client-certificate-data", "client-key-data"):
            user.pop(key, None)
        user["client-certificate"] = str(Path(args.client_certificate).resolve())
        user["client-key"] = str(Path(args.client_key).resolve())
    return KubeAccess(cluster, user)


def proxied_kubeconfig(cluster_name: str, proxy: tuple[str, int], access: KubeAccess) -> dict[str, Any]:
    """The kubeconfig document: the bare cluster name as the server, through the local proxy."""
    check_cluster(cluster_name)
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": cluster_name,
                "cluster": {
                    "server": f"https://{cluster_name}",
                    "proxy-url": f"socks5://{cluster_name}@{format_authority(*proxy)}",
                    **access.cluster,
                },
            }
        ],
        "users": [{"name": cluster_name, "user": access.user}],
        "contexts": [{"name": cluster_name, "context": {"cluster": cluster_name, "user": cluster_name}}],
        "current-context": cluster_name,
    }


@contextlib.contextmanager
def temporary_kubeconfig(document: dict[str, Any]) -> Iterator[Path]:
    """The document in a file only this user can read (it may hold a token), removed at the end."""
    descriptor, name = tempfile.mkstemp(prefix="cluster-proxy-kubectl-", suffix=".kubeconfig")
    path = Path(name)
    try:
        os.fchmod(descriptor, 0o600)
        with os.fdopen(descriptor, "w") as file:
            yaml.safe_dump(document, file)
        yield path
    finally:
        path.unlink(missing_ok=True)


def exit_status(returncode: int) -> int:
    """kubectl's status as a shell reports it: a kill by signal N is 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def _terminal_sends_sigint_to_kubectl() -> bool:
    """Whether a Ctrl-C reaches kubectl by itself: we (and kubectl, in our process group) are the
    terminal's foreground. Then a SIGINT we got was the terminal's and kubectl has its own; passing it
    on would be a second one (kubectl port-forward stops gracefully at the first)."""
    for stream in (sys.stdin, sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            return os.tcgetpgrp(stream.fileno()) == os.getpgrp()
    return False


async def run_kubectl_through_proxy(
    lp: LocalProxy, kubectl: str, cluster: str, access: KubeAccess, kubectl_args: Sequence[str]
) -> int:
    """Start the proxy, run kubectl on the temporary kubeconfig, and return kubectl's exit status."""
    log = get_logger("kubectl")
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(partial(run_local_proxy, lp, out=io.StringIO()))
            document = proxied_kubeconfig(cluster, bound[0], access)
            with temporary_kubeconfig(document) as path:
                process = await trio.lowlevel.open_process([kubectl, f"--kubeconfig={path}", *kubectl_args])

                async def pass_signals() -> None:
                    async for signum in signals:
                        if signum == signal.SIGINT and _terminal_sends_sigint_to_kubectl():
                            continue
                        log.debug("signal_passed_on", signal=signal.Signals(signum).name)
                        with contextlib.suppress(ProcessLookupError):
                            process.send_signal(signum)

                nursery.start_soon(pass_signals)
                try:
                    returncode = await process.wait()
                finally:
                    if process.returncode is None:  # cancelled from outside: kubectl goes too
                        process.kill()
            nursery.cancel_scope.cancel()
    return exit_status(returncode)


def _only(group: BaseExceptionGroup) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


# --- the command ---------------------------------------------------------------------------------------


class _KubectlParser(argparse.ArgumentParser):
    """The kubectl command's parser: the arguments after the first ``--`` are ``kubectl_args``,
    untouched; the flags before it are ours."""

    def parse_known_args(  # type: ignore[override]  # one signature for argparse's overloads (a namespace given or not)
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        ours = list(sys.argv[1:] if args is None else args)
        kubectl_args: list[str] = []
        if "--" in ours:
            split = ours.index("--")
            ours, kubectl_args = ours[:split], ours[split + 1 :]
        parsed, extras = super().parse_known_args(ours, namespace)
        parsed.kubectl_args = kubectl_args
        return parsed, extras


def add_kubectl_command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "kubectl",
        help="run kubectl against a managed cluster's kube-apiserver through the tunnel",
        description="Runs kubectl ARGS against CLUSTER's kube-apiserver: a local SOCKS5 proxy in this "
        "process (an ephemeral loopback port) and a temporary kubeconfig (server https://CLUSTER, "
        "proxy-url socks5://CLUSTER@127.0.0.1:PORT, deleted at exit). The managed cluster's "
        "credentials and CA are yours to give. Exits with kubectl's status. docs/local-proxy.md",
        usage="%(prog)s CLUSTER [flags] [-- KUBECTL-ARGS...]",
    )
    parser.add_argument("cluster", metavar="CLUSTER", help="managed cluster name")
    # Everything after the first "--" is kubectl's (argparse alone cannot take flags on both sides
    # of a positional list: it would match the list empty before them).
    parser.__class__ = _KubectlParser
    add_flag(parser, "--kubectl", env="CLUSTER_PROXY_KUBECTL", default="kubectl",
             help="the kubectl program (a name searched on PATH, or a path)")  # fmt: skip
    add_flag(parser, "--cluster-ca", env="CLUSTER_PROXY_CLUSTER_CA", type=existing_file,
             help="the CA of the cluster's kube-apiserver (PEM)")  # fmt: skip
    add_flag(parser, "--tls-server-name", env="CLUSTER_PROXY_TLS_SERVER_NAME",
             help=f"the name kubectl checks on the API server's certificate (default {API_SERVER_NAME}, "
             "which every kube-apiserver's certificate names)")  # fmt: skip
    add_flag(parser, "--insecure", env="CLUSTER_PROXY_INSECURE", type=bool, default=False,
             help="do not verify the API server's certificate (insecure-skip-tls-verify)")  # fmt: skip
    add_flag(parser, "--token", env="CLUSTER_PROXY_KUBE_TOKEN",
             help="a bearer token of the managed cluster (written to the temporary kubeconfig, mode 0600)")  # fmt: skip
    add_flag(parser, "--token-file", env="CLUSTER_PROXY_KUBE_TOKEN_FILE", type=existing_file,
             help="a file holding such a token (read by kubectl)")  # fmt: skip
    add_flag(parser, "--client-certificate", env="CLUSTER_PROXY_KUBE_CLIENT_CERTIFICATE", type=existing_file,
             help="a client certificate of the managed cluster (PEM), with --client-key")  # fmt: skip
    add_flag(parser, "--client-key", env="CLUSTER_PROXY_KUBE_CLIENT_KEY", type=existing_file,
             help="its private key (PEM)")  # fmt: skip
    add_flag(parser, "--kubeconfig", env="CLUSTER_PROXY_KUBE_KUBECONFIG", type=existing_file,
             help="take the user and the CA of a context of this kubeconfig (its server is replaced)")  # fmt: skip
    add_flag(parser, "--context", env="CLUSTER_PROXY_KUBE_CONTEXT",
             help="that context (default: its current-context)")  # fmt: skip
    add_hub_flags(parser)
    add_flag(parser, "--log-level", env="CLUSTER_PROXY_LOG_LEVEL", default="warning", choices=LOG_LEVELS,
             help="log level of the in-process proxy (logs go to stderr, beside kubectl's)")  # fmt: skip
    return parser


def run_kubectl(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        cluster = check_cluster(args.cluster)
    except ValueError as exc:
        parser.error(str(exc))
    kubectl_args = list(args.kubectl_args)
    if args.token is not None and args.token_file is not None:
        parser.error("--token and --token-file: give one")
    try:
        access = access_from_args(args)
    except ConfigError as exc:
        parser.error(str(exc))
    hub = resolve_hub(args, parser, "kubectl")
    kubectl = shutil.which(args.kubectl)
    if kubectl is None:
        print(
            f"cluster-proxy kubectl: {args.kubectl!r} not found (on PATH): install kubectl or pass --kubectl PATH",
            file=sys.stderr,
        )
        return 127
    configure_logging(args.log_level)
    tls = followed_tls(hub.tls, parser, get_logger("proxy"))
    lp = LocalProxy("127.0.0.1", 0, hub.proxy, tls, None, hub.server_name, hub.connect_timeout)
    try:
        try:
            return trio.run(run_kubectl_through_proxy, lp, kubectl, cluster, access, kubectl_args)
        except BaseExceptionGroup as group:  # the nursery's: a failure to start is one exception
            raise _only(group) from None
    except TunnelError as exc:
        print(f"cluster-proxy kubectl: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"cluster-proxy kubectl: {exc}", file=sys.stderr)
        return 1
