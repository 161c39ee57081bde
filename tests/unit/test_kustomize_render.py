"""The kustomize overlays render into Deployments whose containers the real programs accept.

``kubectl kustomize`` renders each overlay as ``kubectl apply -k`` would send it. For every container
of every rendered Deployment the test plays the kubelet just far enough to run the program's own
argument parsing: the environment is resolved from the rendered ConfigMaps and Secrets, ``$(VAR)``
is expanded as the kubelet expands it, each volume becomes a folder filled from the rendered objects,
the init containers run, and the container's command and arguments (paths moved into those folders)
go through the service's real parser with that environment and nothing else. A misspelt flag, a
missing required one, a value the program refuses, an env var from a key nobody renders: each
fails here, before anything is applied to a cluster. Every image named is one of the project's own.
"""

from __future__ import annotations

import base64
import importlib
import importlib.metadata
import os
import re
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from clusterproxy_protocol.config import parse_args_or_exit
from tests.support.kustomize import (
    KUSTOMIZE,
    MY_CLUSTER_KUSTOMIZATION,
    MY_HUB_KUSTOMIZATION,
    NAMESPACE,
    deployments,
    key_of,
    own_overlay,
    render,
)
from tests.support.netpol import ANYWHERE, IN_CLUSTER, IN_NAMESPACE, ingress_by_pod

#: the overlays that run something (a Deployment each)
OVERLAYS = ("hub", "managed")
#: every overlay shipped: the hub's declared configuration (no Deployment) too
ALL_OVERLAYS = ("hub", "hub-configuration", "managed")

# The project's images (the compose issue builds them) and the one console script each may run.
PROJECT_IMAGES = {
    "cluster-proxy/proxy-server": "cluster-proxy-server",
    "cluster-proxy/proxy-agent": "cluster-proxy-agent",
    "cluster-proxy/cert-signer": "cluster-proxy-cert-signer",
    "cluster-proxy/addon-manager": "cluster-proxy-addon-manager",
    "cluster-proxy/health-collector": "cluster-proxy-health-collector",
}
IMAGE_TAG = "dev"


# --- playing the kubelet -----------------------------------------------------------------------------

_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' expansion of ``$(VAR)`` in command, args and env values: a defined variable is
    replaced, an undefined one stays as written, ``$$`` is a literal ``$``."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)

    return _REFERENCE.sub(one, text)


@dataclass
class Pod:
    """One replica of a rendered Deployment, its volumes as folders under ``root``."""

    name: str
    namespace: str
    spec: Mapping[str, Any]
    objects: Mapping[tuple[str, str, str], Mapping[str, Any]]
    root: Path

    def data_of(self, kind: str, name: str) -> dict[str, bytes]:
        obj = self.objects.get((kind, self.namespace, name))
        assert obj is not None, f"the pod refers to {kind} {self.namespace}/{name}, which is not rendered"
        data: dict[str, bytes] = {}
        for key, value in (obj.get("data") or {}).items():
            data[key] = base64.b64decode(value) if kind == "Secret" else str(value).encode()
        for key, value in (obj.get("stringData") or {}).items():
            data[key] = str(value).encode()
        for key, value in (obj.get("binaryData") or {}).items():
            data[key] = base64.b64decode(value)
        return data

    def volume_dirs(self) -> dict[str, Path]:
        """Every volume of the pod as a folder: Secret and ConfigMap volumes hold their keys as files,
        emptyDir volumes start empty (and are shared by the pod's containers)."""
        dirs: dict[str, Path] = {}
        for volume in self.spec.get("volumes") or []:
            folder = self.root / "volumes" / volume["name"]
            folder.mkdir(parents=True, exist_ok=True)
            if "secret" in volume or "configMap" in volume:
                kind, source = (
                    ("Secret", volume["secret"]) if "secret" in volume else ("ConfigMap", volume["configMap"])
                )
                name = source.get("secretName") or source.get("name")
                data = self.data_of(kind, name)
                items = source.get("items")
                wanted = [(i["key"], i["path"]) for i in items] if items else [(k, k) for k in data]
                for key, path in wanted:
                    assert key in data, f"volume {volume['name']}: {kind} {name} has no key {key!r}"
                    (folder / path).parent.mkdir(parents=True, exist_ok=True)
                    (folder / path).write_bytes(data[key])
            else:
                assert "emptyDir" in volume, (
                    f"volume {volume['name']}: only Secret, ConfigMap and emptyDir are played"
                )
            dirs[volume["name"]] = folder
        return dirs

    def environment(self, container: Mapping[str, Any]) -> dict[str, str]:
        """The container's environment as the kubelet builds it (``env`` in order; ``envFrom``)."""
        env: dict[str, str] = {}
        for source in container.get("envFrom") or []:
            prefix = source.get("prefix", "")
            if "configMapRef" in source:
                data = self.data_of("ConfigMap", source["configMapRef"]["name"])
            else:
                data = self.data_of("Secret", source["secretRef"]["name"])
            env.update({prefix + k: v.decode() for k, v in data.items()})
        for var in container.get("env") or []:
            if "value" in var:
                env[var["name"]] = expand(str(var["value"]), env)
                continue
            source = var["valueFrom"]
            if "configMapKeyRef" in source or "secretKeyRef" in source:
                kind, ref = (
                    ("ConfigMap", source["configMapKeyRef"])
                    if "configMapKeyRef" in source
                    else ("Secret", source["secretKeyRef"])
                )
                data = self.data_of(kind, ref["name"])
                assert ref["key"] in data, (
                    f"env {var['name']}: {kind} {ref['name']} has no key {ref['key']!r}"
                )
                env[var["name"]] = data[ref["key"]].decode()
            elif "fieldRef" in source:
                field_path = source["fieldRef"]["fieldPath"]
                known = {"metadata.name": self.name, "metadata.namespace": self.namespace}
                assert field_path in known, f"env {var['name']}: fieldRef {field_path} is not played"
                env[var["name"]] = known[field_path]
            else:
                raise AssertionError(f"env {var['name']}: valueFrom {sorted(source)} is not played")
        return env

    def argv(
        self, container: Mapping[str, Any], volumes: Mapping[str, Path]
    ) -> tuple[list[str], dict[str, str]]:
        """Command plus args, expanded, with every mount path moved to its volume's folder."""
        env = self.environment(container)
        mounts: dict[str, Path] = {}
        for mount in container.get("volumeMounts") or []:
            assert mount["name"] in volumes, (
                f"container {container['name']} mounts the unknown volume {mount['name']!r}"
            )
            mounts[mount["mountPath"].rstrip("/")] = volumes[mount["name"]]
        assert container.get("command"), (
            f"container {container['name']} has no command: it must name the console script it runs "
            "(the images' entrypoints are not part of the manifests)"
        )
        words = [expand(str(w), env) for w in [*container["command"], *(container.get("args") or [])]]
        if mounts:
            pattern = re.compile(
                "|".join(re.escape(p) + r"(?=/|\s|$)" for p in sorted(mounts, key=len, reverse=True))
            )
            words = [pattern.sub(lambda m: str(mounts[m.group(0)]), w) for w in words]
        return words, env


def pod_of(deployment: Mapping[str, Any], objects: Sequence[Mapping[str, Any]], root: Path) -> Pod:
    """A replica of ``deployment``, its references resolved among ``objects`` (rendered, or read
    back from an API server)."""
    name = deployment["metadata"]["name"]
    return Pod(
        name=f"{name}-7d4b9c-x2x5q",
        namespace=deployment["metadata"].get("namespace", "default"),
        spec=deployment["spec"]["template"]["spec"],
        objects={key_of(o): o for o in objects},
        root=root / name,
    )


def pods_of(objects: Sequence[Mapping[str, Any]], root: Path) -> Iterator[tuple[Mapping[str, Any], Pod]]:
    for deployment in deployments(objects):
        yield deployment, pod_of(deployment, objects, root)


# --- the programs' own parsers ------------------------------------------------------------------------------


def console_script_module(script: str) -> Any:
    """The module behind an installed console script (``cluster-proxy-agent`` -> ``clusterproxy_agent.main``)."""
    found = importlib.metadata.entry_points(group="console_scripts", name=script)
    assert found, f"{script!r} is not a console script of any installed package of the project"
    (entry,) = tuple(found)
    return importlib.import_module(entry.value.split(":", 1)[0])


def parse_with_program(script: str, argv: Sequence[str], env: Mapping[str, str]) -> None:
    """Run ``argv`` through the real program's parser with exactly ``env`` as its environment; a
    refusal fails the test with the program's own message. Where the service validates the parsed
    flags further (``parse_settings``), that runs too."""
    module = console_script_module(script)
    try:
        if hasattr(module, "parse_settings"):
            module.parse_settings(list(argv), environ=dict(env))
        else:
            parse_args_or_exit(module.build_parser(), list(argv), environ=dict(env))
    except SystemExit as exc:
        raise AssertionError(f"{script} refuses {list(argv)} (exit {exc.code})") from None


@dataclass
class Command:
    """A main container as the kubelet would start it: the program, its argv and its environment."""

    container: str
    script: str
    argv: list[str]
    env: dict[str, str]


def start_pod(pod: Pod) -> list[Command]:
    """Fill the pod's volumes, run its init containers (for real: they prepare files the main
    containers read) and return each main container's command line, after checking that every
    image is one of the project's and runs that image's program."""
    volumes = pod.volume_dirs()
    for container in pod.spec.get("initContainers") or []:
        image_checked(container)
        argv, env = pod.argv(container, volumes)
        done = subprocess.run(argv, env={"PATH": os.environ["PATH"], **env}, capture_output=True, text=True)
        assert done.returncode == 0, f"init container {container['name']} failed: {argv}\n{done.stderr}"
    commands = []
    for container in pod.spec["containers"]:
        script = image_checked(container)
        argv, env = pod.argv(container, volumes)
        assert Path(argv[0]).name == script, (
            f"container {container['name']} runs {argv[0]!r}, but image {container['image']} ships {script!r}"
        )
        commands.append(Command(container["name"], script, argv, env))
    return commands


def run_pod(pod: Pod) -> list[Command]:
    """:func:`start_pod`, then every main container's command line through its program's parser."""
    commands = start_pod(pod)
    for command in commands:
        parse_with_program(command.script, command.argv[1:], command.env)
    return commands


def image_checked(container: Mapping[str, Any]) -> str:
    """The console script of the container's image, after checking the image is the project's own."""
    repository, _, tag = container["image"].rpartition(":")
    assert repository in PROJECT_IMAGES, (
        f"container {container['name']}: {container['image']} is not a project image"
    )
    assert tag == IMAGE_TAG, f"container {container['name']}: {container['image']} is not tagged {IMAGE_TAG}"
    return PROJECT_IMAGES[repository]


# --- tests -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(KUSTOMIZE / "overlays" / request.param)


def test_every_deployment_container_is_accepted_by_its_program(
    overlay: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    name, objects = overlay
    assert deployments(objects), f"overlay {name} renders no Deployment"
    for deployment, pod in pods_of(objects, tmp_path):
        checked = run_pod(pod)
        names = [c["name"] for c in pod.spec["containers"]]
        assert [c.container for c in checked] == names, deployment["metadata"]["name"]


def test_a_misspelt_flag_is_caught(overlay: tuple[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    """The check above is not vacuous: the same Deployment with one flag misspelt fails it."""
    _, objects = overlay
    for deployment, pod in pods_of(objects, tmp_path):
        container = pod.spec["containers"][0]
        words = [*(container.get("args") or [])]
        flag_at = next(i for i, w in enumerate(words) if w.startswith("--"))
        words[flag_at] = "--misspelt-" + words[flag_at][2:]
        broken = {**container, "args": words}
        spec = {**pod.spec, "containers": [broken, *pod.spec["containers"][1:]]}
        with pytest.raises(AssertionError, match="refuses"):
            run_pod(
                Pod(
                    pod.name,
                    pod.namespace,
                    spec,
                    pod.objects,
                    tmp_path / "broken" / deployment["metadata"]["name"],
                )
            )


@pytest.fixture(scope="module", params=ALL_OVERLAYS)
def any_overlay(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(KUSTOMIZE / "overlays" / request.param)


def test_every_object_carries_the_project_labels(any_overlay: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = any_overlay
    for obj in objects:
        labels = obj["metadata"].get("labels") or {}
        assert labels.get("app.kubernetes.io/part-of") == "cluster-proxy", key_of(obj)
        assert labels.get("app.kubernetes.io/managed-by") == "kustomize", key_of(obj)
    for deployment in deployments(objects):
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert pod_labels.get("app.kubernetes.io/part-of") == "cluster-proxy"
        # labels were added to templates, never to the immutable selector
        assert "app.kubernetes.io/part-of" not in deployment["spec"]["selector"]["matchLabels"]


#: who may reach each named port of each overlay's pods (the kubelet's probes come from the pod's own
#: node, which no NetworkPolicy restricts): the manager's metrics from the cluster's pods (Prometheus),
#: the collector's page and JSON (every cluster, in plain HTTP) from its own namespace only (people use
#: `kubectl port-forward`), the gateway from anywhere (the kube-apiserver's aggregator is often not a
#: pod), the agent's admin port from the cluster's pods and nothing else.
INGRESS = {
    "hub": {
        "cluster-proxy-addon-manager": {"admin": IN_CLUSTER},
        "cluster-proxy-health-collector": {"http": IN_NAMESPACE},
    },
    "hub-gateway": {"cluster-proxy-cluster-gateway": {"https": ANYWHERE, "service-proxy": ANYWHERE}},
    "managed": {"cluster-proxy-proxy-agent": {"admin": IN_CLUSTER}},
}


@pytest.mark.parametrize("name", sorted(INGRESS))
def test_each_pod_accepts_its_own_ports_only(name: str) -> None:
    """Every overlay that runs pods ships a NetworkPolicy per pod whose selector matches the pod
    template's labels, opening exactly the ports the pod declares, by name, each from where it is
    needed (tests.support.netpol)."""
    assert ingress_by_pod(render(KUSTOMIZE / "overlays" / name)) == INGRESS[name]


def test_every_overlay_with_pods_is_policed() -> None:
    shipped = {d.name for d in (KUSTOMIZE / "overlays").iterdir() if d.is_dir()}
    with_pods = {name for name in shipped if deployments(render(KUSTOMIZE / "overlays" / name))}
    assert with_pods == set(INGRESS)


def test_no_overlay_holds_an_object_of_a_crd_it_installs(
    any_overlay: tuple[str, list[dict[str, Any]]],
) -> None:
    """kubectl maps every object of one apply to its API before it creates any: an object whose kind
    comes from a CRD in the same apply fails on a fresh cluster ("ensure CRDs are installed first").
    So the hub overlay installs in one command, and the configuration is an overlay of its own."""
    name, objects = any_overlay
    installed = {
        (o["spec"]["group"], o["spec"]["names"]["kind"])
        for o in objects
        if o["kind"] == "CustomResourceDefinition"
    }
    for obj in objects:
        group = obj["apiVersion"].rpartition("/")[0]
        assert (group, obj["kind"]) not in installed, (
            f"overlay {name}: {key_of(obj)} needs a CRD of the same apply"
        )


def test_the_hub_installs_the_crd_and_the_configuration_needs_it() -> None:
    hub = render(KUSTOMIZE / "overlays" / "hub")
    crd = only(hub, "CustomResourceDefinition", "managedproxyconfigurations.proxy.open-cluster-management.io")
    configuration = render(KUSTOMIZE / "overlays" / "hub-configuration")
    assert [o["kind"] for o in configuration] == ["ManagedProxyConfiguration"]
    assert crd["spec"]["names"]["kind"] == "ManagedProxyConfiguration"
    assert crd["spec"]["group"] == configuration[0]["apiVersion"].split("/")[0]


def test_the_configuration_names_only_project_images(
    any_overlay: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """Images outside containers too: the ManagedProxyConfiguration names what the manager deploys,
    and the manager's --cert-signer-image the signer it deploys."""
    _, objects = any_overlay
    for obj in objects:
        if obj["kind"] == "ManagedProxyConfiguration":
            for part, repository in (
                ("proxyServer", "cluster-proxy/proxy-server"),
                ("proxyAgent", "cluster-proxy/proxy-agent"),
            ):
                assert obj["spec"][part]["image"] == f"{repository}:{IMAGE_TAG}"
    for _, pod in pods_of(objects, tmp_path):
        for command in start_pod(pod):
            for word in command.argv:
                if word.startswith("--cert-signer-image="):
                    assert word == f"--cert-signer-image=cluster-proxy/cert-signer:{IMAGE_TAG}"


# --- overlays of your own (docs/kubernetes.md) ----------------------------------------------------------


MANAGER = "cluster-proxy-addon-manager"  # the hub overlay also holds the health-collector's objects


def only(objects: Sequence[Mapping[str, Any]], kind: str, name: str | None = None) -> Mapping[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    return found


def test_images_of_your_own_reach_every_image_field(tmp_path: Path) -> None:
    """`images:` in one's own overlay renames container images, the cert-signer image the manager is
    told (an env value) and the images in the ManagedProxyConfiguration the manager deploys."""
    images = [
        {"name": f"cluster-proxy/{part}", "newName": f"registry.example/cp/{part}", "newTag": "v9"}
        for part in ("proxy-server", "proxy-agent", "cert-signer", "addon-manager")
    ]
    hub = render(own_overlay(tmp_path / "hub", "hub", {"images": images}, {}))
    manager = only(hub, "Deployment", MANAGER)["spec"]["template"]["spec"]["containers"][0]
    assert manager["image"] == "registry.example/cp/addon-manager:v9"
    env = {e["name"]: e.get("value") for e in manager["env"]}
    assert env["CERT_SIGNER_IMAGE"] == "registry.example/cp/cert-signer:v9"
    configuration = render(
        own_overlay(tmp_path / "configuration", "hub-configuration", {"images": images}, {})
    )
    mpc = only(configuration, "ManagedProxyConfiguration")["spec"]
    assert mpc["proxyServer"]["image"] == "registry.example/cp/proxy-server:v9"
    assert mpc["proxyAgent"]["image"] == "registry.example/cp/proxy-agent:v9"
    managed = render(own_overlay(tmp_path / "managed", "managed", {"images": images}, {}))
    pod = only(managed, "Deployment")["spec"]["template"]["spec"]
    assert {c["image"] for c in [*pod["initContainers"], *pod["containers"]]} == {
        "registry.example/cp/proxy-agent:v9"
    }


MY_CLUSTER = {
    "agent.env": "cluster=prod-east-1\nhub-agent-address=proxy.hub.corp.example:443\n"
    "hub-signer-url=https://signer.hub.corp.example:8443\n",
    "ca.crt": (KUSTOMIZE / "overlays" / "managed" / "example" / "ca.crt").read_text(),
    "bootstrap-token": "0123456789ab.abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQ\n",
}


def test_a_managed_overlay_of_your_own_replaces_settings_and_credentials(tmp_path: Path) -> None:
    objects = render(own_overlay(tmp_path / "mine", "managed", MY_CLUSTER_KUSTOMIZATION, MY_CLUSTER))
    assert len([o for o in objects if o["kind"] == "ConfigMap"]) == 1
    assert len([o for o in objects if o["kind"] == "Secret"]) == 1
    pod = pod_of(only(objects, "Deployment"), objects, tmp_path / "pods")
    (command,) = run_pod(pod)
    assert "--cluster=prod-east-1" in command.argv
    assert "--server=proxy.hub.corp.example:443" in command.argv
    assert "--signer=https://signer.hub.corp.example:8443" in command.argv
    assert command.env["CLUSTER_PROXY_AGENT_BOOTSTRAP_TOKEN"] == MY_CLUSTER["bootstrap-token"]
    seeded = pod.root / "volumes" / "credentials" / "ca.crt"
    assert seeded.read_text() == MY_CLUSTER["ca.crt"], "the init container did not seed the CA bundle"


def test_the_hub_overlay_writes_nothing_the_addon_manager_writes() -> None:
    """The manager server-side applies its hub objects and the ClusterManagementAddOn with force: an
    object in the overlay too would flip between the two writers on every apply."""
    from clusterproxy_addon_manager import (
        render_hub as manager_render_hub,
        render_registration as manager_render_registration,
    )
    from clusterproxy_addon_manager.config import parse_mpc
    from clusterproxy_addon_manager.main import parse_settings as manager_settings

    objects = render(KUSTOMIZE / "overlays" / "hub")
    configuration = render(KUSTOMIZE / "overlays" / "hub-configuration")
    deployment = only(objects, "Deployment", MANAGER)
    pod = pod_of(deployment, objects, Path("/nonexistent"))
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = pod.environment(container)
    settings = manager_settings([expand(a, env) for a in container["args"]], environ=env)
    mpc = only(configuration, "ManagedProxyConfiguration")
    assert mpc["metadata"]["name"] == settings.mpc_name
    cfg = parse_mpc(mpc, default_namespace=settings.namespace)
    theirs = manager_render_hub.hub_objects(
        manager_render_hub.HubInputs(
            cfg=cfg,
            endpoints=None,
            ca_bundle_pem="",
            server_token="",
            store_prefix=settings.store_prefix,
            signer_image=settings.cert_signer_image,
        )
    )
    theirs.append(manager_render_registration.cluster_management_addon(settings.mpc_name))
    assert {key_of(o) for o in theirs}.isdisjoint({key_of(o) for o in objects})
    for obj in objects:  # nor a Secret of the cert-signer's store, which the manager's signer writes
        assert not (
            obj["kind"] == "Secret" and obj["metadata"]["name"].startswith(settings.store_prefix + "-")
        )


def test_the_manager_can_take_over_an_agent_installed_by_hand() -> None:
    """Same Deployment, namespace and selector as the agent the addon-manager writes into a
    ManifestWork: enabling the addon for a cluster installed by hand updates the agent in place (a
    Deployment's selector cannot change)."""
    from clusterproxy_addon_manager import render as manager_render, render_agent as manager_render_agent

    objects = render(KUSTOMIZE / "overlays" / "managed")
    ours = only(objects, "Deployment")
    assert ours["metadata"]["name"] == manager_render.AGENT_DEPLOYMENT
    assert ours["metadata"]["namespace"] == NAMESPACE
    assert ours["spec"]["selector"] == {"matchLabels": manager_render.pod_selector("proxy-agent")}
    assert ours["spec"]["template"]["spec"]["serviceAccountName"] == manager_render.AGENT_SERVICE_ACCOUNT
    # and its NetworkPolicy: the same object, so the ManifestWork's replaces it in place
    policy = only(objects, "NetworkPolicy")
    theirs = manager_render_agent.agent_network_policy(NAMESPACE)
    assert key_of(policy) == key_of(theirs)
    assert policy["spec"] == theirs["spec"]


def test_a_hub_overlay_of_your_own_sets_the_entrypoint(tmp_path: Path) -> None:
    from clusterproxy_addon_manager.config import parse_mpc

    objects = render(own_overlay(tmp_path / "my-hub", "hub-configuration", MY_HUB_KUSTOMIZATION, {}))
    cfg = parse_mpc(
        only(objects, "ManagedProxyConfiguration"), default_namespace="open-cluster-management-addon"
    )
    assert (cfg.entrypoint.type, cfg.entrypoint.hostname, cfg.server_replicas) == (
        "Hostname",
        "proxy.hub.example.com",
        2,
    )
    assert cfg.server_image == "cluster-proxy/proxy-server:dev"


# What docs/kubernetes.md shows for an agent behind a forward proxy, with one more egress rule.
EXTRA_AGENT_ARGS = {
    "patches": [
        {
            "target": {"kind": "Deployment", "name": "cluster-proxy-proxy-agent"},
            "patch": yaml.safe_dump(
                [
                    {
                        "op": "add",
                        "path": "/spec/template/spec/containers/0/args/-",
                        "value": "--proxy-url=http://proxy.corp.example:3128",
                    },
                    {
                        "op": "add",
                        "path": "/spec/template/spec/containers/0/args/-",
                        "value": "--allow=10.0.0.0/8:443",
                    },
                ]
            ),
        }
    ],
}


def test_agent_flags_added_by_a_patch_reach_the_agent(tmp_path: Path) -> None:
    kustomization = {**MY_CLUSTER_KUSTOMIZATION, **EXTRA_AGENT_ARGS}
    objects = render(own_overlay(tmp_path / "mine", "managed", kustomization, MY_CLUSTER))
    (command,) = run_pod(pod_of(only(objects, "Deployment"), objects, tmp_path / "pods"))
    assert command.argv[-2:] == ["--proxy-url=http://proxy.corp.example:3128", "--allow=10.0.0.0/8:443"]


def test_a_namespace_of_your_own_moves_the_manager_and_its_bindings(tmp_path: Path) -> None:
    """`namespace:` in one's own hub overlay moves the manager, its identity and what binds it; the
    manager's --namespace (where it deploys the hub side) follows its pod's namespace."""
    objects = render(own_overlay(tmp_path / "my-hub", "hub", {"namespace": "my-namespace"}, {}))
    assert only(objects, "Namespace")["metadata"]["name"] == "my-namespace"
    for kind in ("ServiceAccount", "Deployment", "Role", "RoleBinding"):
        assert only(objects, kind, MANAGER)["metadata"]["namespace"] == "my-namespace", kind
    for kind in ("RoleBinding", "ClusterRoleBinding"):
        (subject,) = only(objects, kind, MANAGER)["subjects"]
        assert (subject["name"], subject["namespace"]) == ("cluster-proxy-addon-manager", "my-namespace"), (
            kind
        )
    deployment = only(objects, "Deployment", MANAGER)
    (command,) = run_pod(pod_of(deployment, objects, tmp_path / "pods"))
    assert "--namespace=my-namespace" in command.argv


# What docs/kubernetes.md shows to keep the manager from creating the default configuration.
NO_DEFAULT_CONFIGURATION = {
    "patches": [
        {
            "target": {"kind": "Deployment", "name": "cluster-proxy-addon-manager"},
            "patch": yaml.safe_dump(
                [
                    {
                        "op": "add",
                        "path": "/spec/template/spec/containers/0/args/-",
                        "value": "--no-create-default-configuration",
                    }
                ]
            ),
        }
    ],
}


def test_the_manager_creates_the_default_configuration_unless_a_patch_says_not_to(tmp_path: Path) -> None:
    from clusterproxy_addon_manager.main import parse_settings as manager_settings

    def settings_of(objects: list[dict[str, Any]], root: Path) -> Any:
        (command,) = run_pod(pod_of(only(objects, "Deployment", MANAGER), objects, root))
        return manager_settings(command.argv[1:], environ=command.env)

    shipped = render(KUSTOMIZE / "overlays" / "hub")
    assert settings_of(shipped, tmp_path / "shipped").create_default_configuration is True
    mine = render(own_overlay(tmp_path / "my-hub", "hub", NO_DEFAULT_CONFIGURATION, {}))
    assert settings_of(mine, tmp_path / "mine").create_default_configuration is False


# --- production settings a real node checks ------------------------------------------------------------

#: every overlay that runs a pod, the gateway's too
POD_OVERLAYS = ("hub", "hub-gateway", "managed")


def image_user() -> tuple[int, int]:
    """The numeric user and group every project image runs as (its recipe's ``USER``)."""
    recipe = (KUSTOMIZE.parents[1] / "deploy" / "images" / "Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\d+):(\d+)\s*$", recipe, re.M)
    assert len(users) == 1, users
    return int(users[0][0]), int(users[0][1])


@pytest.mark.parametrize("name", POD_OVERLAYS)
def test_every_container_has_resources_probes_and_a_locked_down_security_context(name: str) -> None:
    """What a kubelet enforces and the emulation does not: runAsNonRoot against the image's numeric
    user, a read-only root filesystem with a writable volume for every folder the program writes, no
    privilege escalation or capability, the runtime's seccomp profile; requests and limits (a quota or
    LimitRange finds them); probes on a port the container declares."""
    uid, gid = image_user()
    for deployment in deployments(render(KUSTOMIZE / "overlays" / name)):
        where = f"{name}: {deployment['metadata']['name']}"
        pod = deployment["spec"]["template"]["spec"]
        security = pod["securityContext"]
        assert security["runAsNonRoot"] is True, where
        assert (security["runAsUser"], security["runAsGroup"]) == (uid, gid), where
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}, where
        writable = {v["name"] for v in pod.get("volumes", []) if "emptyDir" in v}
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (where, c["name"])
            assert sc["readOnlyRootFilesystem"] is True, (where, c["name"])
            assert sc["capabilities"] == {"drop": ["ALL"]}, (where, c["name"])
            for mount in c.get("volumeMounts", []):
                if not mount.get("readOnly"):
                    assert mount["name"] in writable, (where, c["name"], mount)
            for half in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][half]), (where, c["name"], half)
        for c in pod["containers"]:
            ports = {p["name"] for p in c["ports"]}
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                assert c[probe]["httpGet"]["port"] in ports, (where, c["name"], probe)
                assert c[probe]["timeoutSeconds"] >= 5, (where, c["name"], probe)
            startup = c["startupProbe"]
            assert startup["httpGet"] == c["livenessProbe"]["httpGet"], (where, c["name"])
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 120, (where, c["name"])


def test_resources_of_your_own_replace_the_overlays(tmp_path: Path) -> None:
    """The overlay's resources.yaml is a patch like any: one of your own over it wins, field by field."""
    patch = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "cluster-proxy-addon-manager", "namespace": "open-cluster-management-addon"},
        "spec": {
            "template": {
                "spec": {
                    "containers": [{"name": "addon-manager", "resources": {"limits": {"memory": "4Gi"}}}]
                }
            }
        },
    }
    mine = own_overlay(tmp_path / "my-hub", "hub", {"patches": [{"patch": yaml.safe_dump(patch)}]}, {})
    manager = next(
        d for d in deployments(render(mine)) if d["metadata"]["name"] == "cluster-proxy-addon-manager"
    )
    (c,) = manager["spec"]["template"]["spec"]["containers"]
    assert c["resources"] == {
        "requests": {"cpu": "100m", "memory": "128Mi"},
        "limits": {"cpu": "1", "memory": "4Gi"},
    }


def test_the_declared_configuration_states_the_crds_resources() -> None:
    """overlays/hub-configuration spells out the CRD's defaults, so editing it starts from them."""
    crd = only(
        render(KUSTOMIZE / "overlays" / "hub"),
        "CustomResourceDefinition",
        "managedproxyconfigurations.proxy.open-cluster-management.io",
    )
    (version,) = crd["spec"]["versions"]
    spec_schema = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    mpc = only(render(KUSTOMIZE / "overlays" / "hub-configuration"), "ManagedProxyConfiguration")
    for part in ("proxyServer", "proxyAgent"):
        halves = spec_schema[part]["properties"]["resources"]["properties"]
        assert mpc["spec"][part]["resources"] == {h: halves[h]["default"] for h in ("requests", "limits")}, (
            part
        )
