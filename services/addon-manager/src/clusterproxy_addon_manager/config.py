"""What the manager reads from the API: the ManagedProxyConfiguration, the AddOnDeploymentConfig,
the entrypoint addresses. Pure functions from API objects (dicts) to frozen values; the defaults are
the CRD's (repeated here, so an object stored before a default existed reads the same)."""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

__all__ = [
    "ADDON_DEFAULT_INSTALL_NAMESPACE",
    "AGENT_NAMESPACE",
    "Endpoints",
    "EntrypointWaiting",
    "AGENT_RESOURCES",
    "ProxyConfig",
    "ProxySettings",
    "Resources",
    "SERVER_RESOURCES",
    "agent_namespace",
    "canonical_quantity",
    "deploy_config_ref",
    "parse_deploy_config",
    "parse_mpc",
    "resolve_endpoints",
]

#: where agents go unless the addon or its AddOnDeploymentConfig names another namespace
AGENT_NAMESPACE = "open-cluster-management-cluster-proxy"
#: the OCM CRDs' default for ManagedClusterAddOn.spec.installNamespace and
#: AddOnDeploymentConfig.spec.agentInstallNamespace: present on every object, so it means "unset"
ADDON_DEFAULT_INSTALL_NAMESPACE = "open-cluster-management-agent-addon"

ADDON_GROUP = "addon.open-cluster-management.io"
ADC_RESOURCE = "addondeploymentconfigs"


def _dig(obj: Mapping[str, Any] | None, *path: str) -> Any:
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _str(value: Any, default: str = "") -> str:
    return value if isinstance(value, str) and value else default


def _strings(value: Any) -> tuple[str, ...]:
    return tuple(v for v in value if isinstance(v, str)) if isinstance(value, list) else ()


@dataclass(frozen=True)
class Resources:
    """A container's ``resources``: requests and limits as (resource, quantity) pairs. An MPC that
    gives ``requests`` or ``limits`` replaces that half of the default whole (``limits: {}`` is no
    limit at all), as the CRD's defaults do."""

    requests: tuple[tuple[str, str], ...]
    limits: tuple[tuple[str, str], ...]

    def as_dict(self) -> dict[str, dict[str, str]]:
        out: dict[str, dict[str, str]] = {}
        if self.requests:
            out["requests"] = dict(self.requests)
        if self.limits:
            out["limits"] = dict(self.limits)
        return out


# The defaults (the CRD's, repeated), from docs/benchmarks.md's RSS figures. The proxy-server: 51 MiB
# per idle worker, ~100 KiB per agent tunnel per worker; its CPU limit is its worker count (the
# render's downward API), so 2 workers, ~150 MiB idle with the parent, and 1 GiB holds ~4,000 clusters.
# The agent: ~48 MiB with one idle tunnel, ~19 KiB per open stream; one process, at most one core.
SERVER_RESOURCES = Resources(
    requests=(("cpu", "200m"), ("memory", "192Mi")), limits=(("cpu", "2"), ("memory", "1Gi"))
)
AGENT_RESOURCES = Resources(
    requests=(("cpu", "50m"), ("memory", "64Mi")), limits=(("cpu", "1"), ("memory", "512Mi"))
)


_QUANTITY = re.compile(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+))([KMGTPE]i|[numkMGTPE]|[eE][+-]?\d+)?")
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def canonical_quantity(text: str) -> str:
    """A quantity as the API server stores it (``1000m`` -> ``1``, ``0.5`` -> ``500m``, ``1024Mi`` ->
    ``1Gi``), so that comparing a Deployment on the server with the one rendered sees no difference
    where there is none; anything it cannot read is returned as given (the server's validation says
    what is wrong with it). Binary suffixes stay binary for whole values of 1024 or more; everything
    else is written with the largest decimal suffix that keeps it whole (nano at the least)."""
    match = _QUANTITY.fullmatch(text.strip())
    if match is None:
        return text
    number, suffix = match.group(1), match.group(2) or ""
    try:
        value = Decimal(number)
        if suffix in _BINARY:
            value *= Decimal(1024) ** _BINARY[suffix]
        elif suffix[:1] in ("e", "E"):
            value = value.scaleb(int(suffix[1:]))
        else:
            value = value.scaleb(_DECIMAL[suffix])
    except (InvalidOperation, ValueError, KeyError):
        return text
    if suffix in _BINARY and value == value.to_integral_value() and abs(value) >= 1024:
        whole, power = int(value), 0
        while power < 6 and whole % 1024 == 0:
            whole //= 1024
            power += 1
        return f"{whole}{['', 'Ki', 'Mi', 'Gi', 'Ti', 'Pi', 'Ei'][power]}"
    nanos = (value.scaleb(9)).to_integral_value(rounding="ROUND_CEILING")  # the server rounds up
    exponent = -9
    while exponent < 18 and nanos != 0 and nanos % 1000 == 0:
        nanos //= 1000
        exponent += 3
    if nanos == 0:
        return "0"
    if suffix[:1] in ("e", "E"):  # an exponent stays an exponent
        return f"{int(nanos)}e{exponent}" if exponent else str(int(nanos))
    names = {v: k for k, v in _DECIMAL.items()}
    return f"{int(nanos)}{names[exponent]}"


def _quantities(value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, Mapping):
        return ()
    return tuple(
        sorted(
            (str(k), canonical_quantity(str(v)))
            for k, v in value.items()
            if isinstance(v, str | int) and not isinstance(v, bool)
        )
    )


def _resources(value: Any, default: Resources) -> Resources:
    if not isinstance(value, Mapping):
        return default
    return Resources(
        requests=_quantities(value["requests"]) if "requests" in value else default.requests,
        limits=_quantities(value["limits"]) if "limits" in value else default.limits,
    )


@dataclass(frozen=True)
class Entrypoint:
    type: str  # Hostname | LoadBalancerService | PortForward
    hostname: str
    port: int
    service_name: str
    annotations: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class ProxyConfig:
    """A ManagedProxyConfiguration, defaults applied."""

    name: str
    uid: str
    generation: int
    namespace: str
    server_image: str
    server_replicas: int
    in_cluster_service_name: str
    entrypoint: Entrypoint
    server_args: tuple[str, ...]
    server_resources: Resources
    node_selector: tuple[tuple[str, str], ...]
    tolerations: tuple[Any, ...]
    agent_image: str
    agent_replicas: int
    agent_args: tuple[str, ...]
    agent_resources: Resources
    image_pull_secrets: tuple[str, ...]
    client_port: int
    agent_port: int
    admin_port: int
    signer_port: int
    signer_type: str  # SelfSigned | Custom
    additional_sans: tuple[str, ...]
    custom_ca_secret: str


def parse_mpc(obj: Mapping[str, Any], *, default_namespace: str) -> ProxyConfig:
    spec = obj.get("spec") or {}
    server = spec.get("proxyServer") or {}
    agent = spec.get("proxyAgent") or {}
    entrypoint = server.get("entrypoint") or {}
    ports = _dig(spec, "deploy", "ports") or {}
    signer = _dig(spec, "authentication", "signer") or {}
    placement = server.get("nodePlacement") or {}
    lb = entrypoint.get("loadBalancerService") or {}
    return ProxyConfig(
        name=str(_dig(obj, "metadata", "name")),
        uid=str(_dig(obj, "metadata", "uid") or ""),
        generation=_int(_dig(obj, "metadata", "generation"), 0),
        namespace=_str(server.get("namespace"), default_namespace),
        server_image=_str(server.get("image"), "cluster-proxy/proxy-server:dev"),
        server_replicas=_int(server.get("replicas"), 1),
        in_cluster_service_name=_str(server.get("inClusterServiceName"), "proxy-entrypoint"),
        entrypoint=Entrypoint(
            type=_str(entrypoint.get("type"), "LoadBalancerService"),
            hostname=_str(_dig(entrypoint, "hostname", "value")),
            port=_int(entrypoint.get("port"), 8091),
            service_name=_str(lb.get("name"), "proxy-agent-entrypoint"),
            annotations=tuple(
                (str(a.get("key")), str(a.get("value") or ""))
                for a in lb.get("annotations") or []
                if isinstance(a, Mapping) and a.get("key")
            ),
        ),
        server_args=_strings(server.get("additionalArgs")),
        server_resources=_resources(server.get("resources"), SERVER_RESOURCES),
        node_selector=tuple(
            sorted((str(k), str(v)) for k, v in (placement.get("nodeSelector") or {}).items())
        ),
        tolerations=tuple(t for t in placement.get("tolerations") or [] if isinstance(t, Mapping)),
        agent_image=_str(agent.get("image"), "cluster-proxy/proxy-agent:dev"),
        agent_replicas=_int(agent.get("replicas"), 1),
        agent_args=_strings(agent.get("additionalArgs")),
        agent_resources=_resources(agent.get("resources"), AGENT_RESOURCES),
        image_pull_secrets=_strings(agent.get("imagePullSecrets")),
        client_port=_int(ports.get("proxyServer"), 8090),
        agent_port=_int(ports.get("agentServer"), 8091),
        admin_port=_int(ports.get("adminServer"), 8092),
        signer_port=_int(ports.get("signer"), 8443),
        signer_type=_str(signer.get("type"), "SelfSigned"),
        additional_sans=_strings(_dig(signer, "selfSigned", "additionalSANs")),
        custom_ca_secret=_str(_dig(signer, "custom", "caSecretName")),
    )


# --- where agents reach the hub ------------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoints:
    """The addresses agents dial: the proxy-servers' agent port and the cert-signer."""

    server_host: str
    server_port: int
    signer_host: str
    signer_port: int


@dataclass(frozen=True)
class EntrypointWaiting:
    """The entrypoint has no address yet (a LoadBalancer Service not provisioned)."""

    reason: str
    message: str


def _ingress_address(service: Mapping[str, Any] | None) -> str:
    for ingress in _dig(service, "status", "loadBalancer", "ingress") or []:
        if isinstance(ingress, Mapping):
            address = ingress.get("ip") or ingress.get("hostname")
            if isinstance(address, str) and address:
                return address
    return ""


def resolve_endpoints(
    cfg: ProxyConfig, services: Mapping[str, Mapping[str, Any]], *, signer_entrypoint_service: str
) -> Endpoints | EntrypointWaiting:
    """Where agents dial, from the entrypoint type: ``Hostname`` (its value, the signer on the same
    host), ``LoadBalancerService`` (the external addresses of the two LoadBalancer Services, which
    appear in their status once a load balancer is provisioned), ``PortForward`` (loopback in the
    agent's pod: something there must forward both ports to the hub)."""
    entry = cfg.entrypoint
    if entry.type == "Hostname":
        if not entry.hostname:
            return EntrypointWaiting(
                "EntrypointInvalid",
                "spec.proxyServer.entrypoint.hostname.value is required for type Hostname",
            )
        return Endpoints(entry.hostname, entry.port, entry.hostname, cfg.signer_port)
    if entry.type == "PortForward":
        return Endpoints("127.0.0.1", entry.port, "127.0.0.1", cfg.signer_port)
    server_address = _ingress_address(services.get(entry.service_name))
    signer_address = _ingress_address(services.get(signer_entrypoint_service))
    missing = [
        name
        for name, address in (
            (entry.service_name, server_address),
            (signer_entrypoint_service, signer_address),
        )
        if not address
    ]
    if missing:
        return EntrypointWaiting(
            "WaitingForLoadBalancer",
            f"waiting for an external address of the LoadBalancer Service(s) {', '.join(missing)} in "
            f"namespace {cfg.namespace} (status.loadBalancer.ingress); agents are configured once it "
            "exists. Without a load-balancer provider use entrypoint type Hostname",
        )
    return Endpoints(server_address, entry.port, signer_address, cfg.signer_port)


# --- AddOnDeploymentConfig -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ProxySettings:
    """An AddOnDeploymentConfig's settings for the agent."""

    http_proxy: str = ""
    https_proxy: str = ""
    no_proxy: str = ""
    ca_bundle_pem: str = ""
    node_selector: tuple[tuple[str, str], ...] = ()
    tolerations: tuple[Any, ...] = ()
    registries: tuple[tuple[str, str], ...] = ()  # (source, mirror)
    install_namespace: str = ""
    problems: tuple[str, ...] = field(default=(), compare=False)


def deploy_config_ref(addon: Mapping[str, Any], cma: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """(namespace, name) of the AddOnDeploymentConfig for this addon: its own spec.configs entry,
    else the ClusterManagementAddOn's default; None when neither names one."""
    for ref in _dig(addon, "spec", "configs") or []:
        if (
            isinstance(ref, Mapping)
            and ref.get("resource") == ADC_RESOURCE
            and (ref.get("group") or ADDON_GROUP) == ADDON_GROUP
            and ref.get("name")
        ):
            namespace = ref.get("namespace") or _dig(addon, "metadata", "namespace")
            return str(namespace), str(ref["name"])
    for supported in _dig(cma, "spec", "supportedConfigs") or []:
        if (
            isinstance(supported, Mapping)
            and supported.get("resource") == ADC_RESOURCE
            and (supported.get("group") or ADDON_GROUP) == ADDON_GROUP
        ):
            default = supported.get("defaultConfig") or {}
            if default.get("name"):
                return str(default.get("namespace") or ""), str(default["name"])
    return None


def parse_deploy_config(obj: Mapping[str, Any]) -> ProxySettings:
    spec = obj.get("spec") or {}
    proxy = spec.get("proxyConfig") or {}
    placement = spec.get("nodePlacement") or {}
    problems: list[str] = []
    ca_pem = ""
    if proxy.get("caBundle"):
        try:
            ca_pem = base64.b64decode(str(proxy["caBundle"]), validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            problems.append("spec.proxyConfig.caBundle is not base64 of a PEM bundle; ignored")
        else:
            if "-----BEGIN CERTIFICATE-----" not in ca_pem:
                problems.append("spec.proxyConfig.caBundle holds no PEM certificate; ignored")
                ca_pem = ""
    install_namespace = _str(spec.get("agentInstallNamespace"))
    if install_namespace == ADDON_DEFAULT_INSTALL_NAMESPACE:
        install_namespace = ""
    return ProxySettings(
        http_proxy=_str(proxy.get("httpProxy")),
        https_proxy=_str(proxy.get("httpsProxy")),
        no_proxy=_str(proxy.get("noProxy")),
        ca_bundle_pem=ca_pem,
        node_selector=tuple(
            sorted((str(k), str(v)) for k, v in (placement.get("nodeSelector") or {}).items())
        ),
        tolerations=tuple(t for t in placement.get("tolerations") or [] if isinstance(t, Mapping)),
        registries=tuple(
            (str(r.get("source") or ""), str(r["mirror"]))
            for r in spec.get("registries") or []
            if isinstance(r, Mapping) and r.get("mirror")
        ),
        install_namespace=install_namespace,
        problems=tuple(problems),
    )


def agent_namespace(addon: Mapping[str, Any], settings: ProxySettings | None) -> str:
    """The addon's spec.installNamespace when it was set to something other than OCM's default,
    else the AddOnDeploymentConfig's agentInstallNamespace (same rule), else
    ``open-cluster-management-cluster-proxy``."""
    own = _str(_dig(addon, "spec", "installNamespace"))
    if own and own != ADDON_DEFAULT_INSTALL_NAMESPACE:
        return own
    if settings is not None and settings.install_namespace:
        return settings.install_namespace
    return AGENT_NAMESPACE
