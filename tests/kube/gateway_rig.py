"""A cluster-gateway behind the hub's aggregator, as tests/kube/test_gateway.py's ``gateway`` fixture
builds it, for other modules and the bench: :func:`running_gateway`.

The ManagedClusters are named ``<api server>-<stack tag>`` (``cluster1-3f2a1c``), not ``cluster1``: a
cluster's namespace on the hub stays Terminating once deleted (no controller-manager runs), so only one
module of a session may use a name, and test_gateway.py has ``cluster1`` and ``cluster2``. Which API
server answered is still proved by a namespace that exists only there (``Managed.only_here``).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

from kubernetes import client

from tests.kube.test_gateway import (
    APISERVICE,
    Gateway,
    Managed,
    _project_token,
    _register,
    _set_reader,
)
from tests.support.kubeapi import KubeClusters, free_port
from tests.support.procs import BIN, Process
from tests.support.workagent import AddonStack, poll_until

__all__ = ["running_gateway"]


@contextlib.contextmanager
def running_gateway(
    kube_clusters: KubeClusters,
    directory: Path,
    apis: Sequence[str] = ("cluster1", "cluster2"),
    *,
    extra_args: Sequence[str] = (),
    log_level: str = "debug",
) -> Iterator[Gateway]:
    """The addon's stack, the API servers ``apis`` joined (each with the token Secret of a
    ServiceAccount ``cluster-gateway`` there), the APIService and the gateway process; all removed on
    exit. ``Gateway.clusters`` is keyed by API server name; ``Managed.name`` is the ManagedCluster."""
    hub = kube_clusters["hub"]
    stack = AddonStack(hub, directory)
    process = None
    registered = False
    try:
        stack.start()
        managed: dict[str, Managed] = {}
        for api_name in apis:
            api = kube_clusters[api_name]
            name = f"{api_name}-{stack.tag}"
            only_here = f"only-in-{name}"
            with api.api_client() as admin:
                client.CoreV1Api(admin).create_namespace({"metadata": {"name": only_here}})
            stack.join(name, api)
            managed[api_name] = Managed(name, api, only_here)
            _project_token(hub, managed[api_name])
        port = free_port()
        _register(hub, stack.namespace, port)
        registered = True
        signer_cli = [
            str(BIN / "cluster-proxy-cert-signer"),
            f"--store={stack.store}",
            f"--kubeconfig={hub.kubeconfig}",
        ]
        bundle = directory / "bootstrap-ca.crt"
        made = subprocess.run(
            [*signer_cli[:1], "trust-bundle", *signer_cli[1:], f"--out={bundle}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert made.returncode == 0, made.stderr
        minted = subprocess.run(
            [*signer_cli[:1], "token", "create", *signer_cli[1:], "--client=cluster-gateway", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert minted.returncode == 0, minted.stderr
        credentials = directory / "gateway-credentials"
        process = Process(
            "cluster-gateway",
            [
                str(BIN / "cluster-proxy-cluster-gateway"),
                f"--listen=127.0.0.1:{port}",
                f"--serving-name=cluster-gateway.{stack.namespace}.svc",
                f"--apiservice={APISERVICE}",
                f"--state-dir={directory / 'gateway-state'}",
                f"--kubeconfig={hub.kubeconfig}",
                f"--proxy-server=127.0.0.1:{stack.ports.client}",
                f"--signer=https://127.0.0.1:{stack.ports.signer}",
                f"--bootstrap-ca={bundle}",
                f"--proxy-ca={credentials / 'ca.crt'}",
                f"--proxy-cert={credentials / 'tls.crt'}",
                f"--proxy-key={credentials / 'tls.key'}",
                "--log-format=json",
                f"--log-level={log_level}",
                *extra_args,
            ],
            directory,
            env={"CLUSTER_PROXY_GATEWAY_BOOTSTRAP_TOKEN": json.loads(minted.stdout)["token"]},
        )
        poll_until(
            lambda: (
                any(r.get("event") == "gateway_started" for r in process.events())
                or (process.popen.poll() is not None and _exited(process))
            ),
            timeout=60,
            what="the gateway's gateway_started",
        )
        waited = hub.kubectl("wait", "--for=condition=Available", "--timeout=60s", f"apiservice/{APISERVICE}")
        assert waited.returncode == 0, f"{waited.stderr}\n--- gateway\n{process.tail()}"
        yield Gateway(stack, hub, process, port, managed, directory, kube_clusters)
    finally:
        if registered:
            with hub.api_client() as admin, contextlib.suppress(client.exceptions.ApiException):
                client.ApiregistrationV1Api(admin).delete_api_service(APISERVICE)
        if process is not None:
            process.stop()
        for api_name in apis:
            with contextlib.suppress(Exception):
                _set_reader(kube_clusters[api_name], False)
        stack.close()


def _exited(process: Process) -> bool:
    raise AssertionError(f"the gateway exited:\n{process.tail()}")
