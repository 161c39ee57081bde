"""The images on their own: each service's image runs its console script (``docker run IMAGE --help``),
as a non-root user, holds only its own packages, and carries a health check; the sizes are printed
(``pytest -s``) for docs/containers.md."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.compose.stack import BASE_IMAGE, IMAGES, SERVICE_IMAGES, image

CONSOLE_SCRIPT = {
    "proxy-server": "cluster-proxy-server",
    "proxy-agent": "cluster-proxy-agent",
    "cert-signer": "cluster-proxy-cert-signer",
    "addon-manager": "cluster-proxy-addon-manager",
    "health-collector": "cluster-proxy-health-collector",
    "cluster-gateway": "cluster-proxy-cluster-gateway",
    "toolbox": "cluster-proxy",
}

# Python distributions of this project each image must hold, exactly (a service image holds its own
# package and the libraries it imports, never another service's or the CLI).
OWN_PACKAGES = {
    "proxy-server": {"cluster-proxy-protocol", "cluster-proxy-server"},
    "proxy-agent": {"cluster-proxy-protocol", "cluster-proxy-agent"},
    "cert-signer": {"cluster-proxy-protocol", "cluster-proxy-castore", "cluster-proxy-cert-signer"},
    "addon-manager": {"cluster-proxy-protocol", "cluster-proxy-castore", "cluster-proxy-addon-manager"},
    "health-collector": {"cluster-proxy-protocol", "cluster-proxy-sdk", "cluster-proxy-health-collector"},
    "cluster-gateway": {"cluster-proxy-protocol", "cluster-proxy-sdk", "cluster-proxy-cluster-gateway"},
    "toolbox": {"cluster-proxy-protocol", "cluster-proxy-sdk", "cluster-proxy-cli"},
}

LIST_DISTRIBUTIONS = (
    "import importlib.metadata as m, json; "
    "print(json.dumps(sorted({d.metadata['Name'] for d in m.distributions()})))"
)
BUILD_TOOLS = ("pip", "setuptools", "wheel", "gcc", "cc", "make")


def run(client: Any, name: str, command: list[str], entrypoint: list[str] | str | None = None) -> str:
    """Output of a throw-away container of ``name``'s image (removed afterwards)."""
    output = client.containers.run(
        image(name), command, entrypoint=entrypoint, remove=True, stdout=True, stderr=True
    )
    return output.decode(errors="replace")


@pytest.mark.parametrize("name", [*SERVICE_IMAGES, "toolbox"])
def test_help_runs_as_non_root(docker_client: Any, name: str) -> None:
    config = docker_client.images.get(image(name)).attrs["Config"]
    assert config["User"] == "65532:65532"
    if name == "toolbox":
        assert config["Entrypoint"] == [CONSOLE_SCRIPT[name]]
    else:  # deploy/images/Dockerfile: its entrypoint runs the COMMAND of the service's image.conf
        assert config["Entrypoint"] == ["/opt/cluster-proxy/libexec/entrypoint"]
        assert config["Healthcheck"]["Test"], f"{name} has no HEALTHCHECK"
        conf = run(docker_client, name, ["/opt/cluster-proxy/image.conf"], "cat")
        assert f"COMMAND={CONSOLE_SCRIPT[name]}\n" in conf, conf

    usage = run(docker_client, name, ["--help"])
    assert usage.startswith(f"usage: {CONSOLE_SCRIPT[name]} "), usage[:300]

    ids = run(
        docker_client, name, ["-c", "id -u; id -g; test -w /var/lib/cluster-proxy && echo writable"], "sh"
    )
    assert ids.split() == ["65532", "65532", "writable"]


@pytest.mark.parametrize("name", [*SERVICE_IMAGES, "toolbox"])
def test_only_its_own_packages_and_no_build_tools(docker_client: Any, name: str) -> None:
    names = set(json.loads(run(docker_client, name, ["-c", LIST_DISTRIBUTIONS], "python3")))
    ours = {n for n in names if n.startswith("cluster-proxy-")}
    assert ours == OWN_PACKAGES[name]
    assert not names & {"pip", "setuptools", "wheel"}, names
    found = run(
        docker_client, name, ["-c", f"for t in {' '.join(BUILD_TOOLS)}; do command -v $t; done; true"], "sh"
    )
    assert found.strip() == "", f"build tools in {name}: {found}"


def test_sizes(docker_client: Any) -> None:
    sizes = {name: docker_client.images.get(image(name)).attrs["Size"] / 1e6 for name in IMAGES}
    base = docker_client.images.get(BASE_IMAGE).attrs["Size"] / 1e6
    print(f"\nimage sizes (MB): base {base:.1f}, " + ", ".join(f"{n} {s:.1f}" for n, s in sizes.items()))
    # the base is most of each image: a service adds its venv only (the Kubernetes client is ~130 MB
    # of it for the three that use it)
    for name, size in sizes.items():
        assert base <= size < base + 250, f"{name}: {size:.0f} MB over a base of {base:.0f} MB"
