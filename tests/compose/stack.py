"""``compose.yaml`` brought up for a test module (testcontainers' compose module), and what the tests
ask of it: a service's container (Docker SDK, for kill, pause and exec), commands run inside one, its
address on a network, the health-collector's document on its published port."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
from testcontainers.compose import DockerCompose

from tests.support.waiting import poll_until

ROOT = Path(__file__).resolve().parents[2]
TAG = os.environ.get("CLUSTER_PROXY_TAG", "dev")
BASE_IMAGE = os.environ.get("PYTHON_BASE", "cluster-proxy/python-base:trixie")
SERVICE_IMAGES = (
    "proxy-server",
    "proxy-agent",
    "cert-signer",
    "addon-manager",
    "health-collector",
    "cluster-gateway",
)
IMAGES = (*SERVICE_IMAGES, "toolbox", "network-peers")
CLUSTERS = ("cluster1", "cluster2")
REPLICAS = ("proxy-server-1", "proxy-server-2")
POLL = 0.5
PROJECT_PREFIX = "cptest"  # + the test session's pid

T = TypeVar("T")


def image(name: str) -> str:
    return f"cluster-proxy/{name}:{TAG}"


def docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, check=False).returncode == 0


def images_ready() -> bool:
    return all(
        subprocess.run(["docker", "image", "inspect", image(name)], capture_output=True).returncode == 0
        for name in IMAGES
    )


def wait_for(what: str, check: Callable[[], T | None], timeout: float) -> tuple[T, float]:
    """Poll ``check`` until it returns something other than None; that value and the seconds it took.
    AssertionError naming ``what`` (and the last value seen) after ``timeout`` seconds."""
    started = time.monotonic()
    (value,) = poll_until(  # in a tuple: a falsy value other than None counts
        lambda: None if (seen := check()) is None else (seen,),
        timeout=timeout,
        interval=POLL,
        message=f"not within {timeout:g}s: {what}",
    )
    return value, time.monotonic() - started


@dataclass
class Exec:
    exit_code: int
    stdout: str
    stderr: str


@dataclass
class ComposeStack:
    compose: DockerCompose
    client: Any  # docker.DockerClient
    project: str
    health_port: int = 0  # the health page's host port (Docker picks it)
    up_seconds: float = 0.0  # `docker compose up --wait`

    def container(self, service: str) -> Any:
        """The Docker SDK container of ``service`` (its one replica), stopped ones included."""
        found = self.client.containers.list(
            all=True,
            filters={
                "label": [
                    f"com.docker.compose.project={self.project}",
                    f"com.docker.compose.service={service}",
                ]
            },
        )
        assert len(found) == 1, f"{service}: {len(found)} containers in project {self.project}"
        return found[0]

    def exec(self, service: str, command: Sequence[str], timeout: float = 120) -> Exec:
        """Run ``command`` in ``service``'s container (as its user, in its working folder)."""
        done = subprocess.run(
            ["docker", "exec", self.container(service).id, *command],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        return Exec(done.returncode, done.stdout, done.stderr)

    def python(self, service: str, code: str, *args: str, timeout: float = 120) -> Exec:
        return self.exec(service, ["python3", "-c", code, *args], timeout=timeout)

    def address(self, service: str, network: str) -> str:
        """``service``'s IPv4 address on the project's ``network``."""
        container = self.container(service)
        container.reload()
        networks = container.attrs["NetworkSettings"]["Networks"]
        return networks[f"{self.project}_{network}"]["IPAddress"]

    def networks(self, service: str) -> set[str]:
        """The project networks ``service`` is attached to (without the project prefix)."""
        container = self.container(service)
        container.reload()
        prefix = f"{self.project}_"
        return {name.removeprefix(prefix) for name in container.attrs["NetworkSettings"]["Networks"]}

    def logs(self, service: str) -> str:
        return self.container(service).logs(stdout=True, stderr=True).decode(errors="replace")

    def logs_tail(self, lines: int) -> str:
        parts = []
        for container in self.client.containers.list(
            all=True, filters={"label": f"com.docker.compose.project={self.project}"}
        ):
            tail = container.logs(tail=lines).decode(errors="replace")
            parts.append(f"--- {container.name} ({container.status})\n{tail}")
        return "\n".join(parts)

    @property
    def health_url(self) -> str:
        return f"http://127.0.0.1:{self.health_port}"

    def clusters(self) -> dict[str, dict[str, Any]]:
        """The health-collector's /api/v1/clusters through its published port: name -> row."""
        answer = httpx.get(f"{self.health_url}/api/v1/clusters", timeout=5)
        answer.raise_for_status()
        return {row["name"]: row for row in answer.json()["clusters"]}

    def agent_replicas(self, cluster: str) -> set[str]:
        """The replicas the cluster's agent holds a tunnel to, as the collector saw them last."""
        row = self.clusters().get(cluster, {})
        return {replica for agent in row.get("agents") or [] for replica in agent.get("replicas", [])}

    def wait_all_tunnels(self, timeout: float = 90) -> float:
        """Until every cluster's agent holds a tunnel to every replica and every probe succeeds."""

        def settled() -> bool | None:
            try:
                rows = self.clusters()
            except httpx.HTTPError:
                return None
            for cluster in CLUSTERS:
                row = rows.get(cluster, {})
                replicas = {r for agent in row.get("agents") or [] for r in agent.get("replicas", [])}
                if replicas != set(REPLICAS) or not row.get("healthy"):
                    return None
            return True

        return wait_for("every agent holds a tunnel to both replicas, every probe healthy", settled, timeout)[
            1
        ]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_stacks(client: Any) -> list[str]:
    """Take down the stacks of earlier test sessions whose process is gone (a killed session leaves its
    containers running); the projects removed."""
    label = "com.docker.compose.project"
    projects = {c.labels.get(label, "") for c in client.containers.list(all=True, filters={"label": label})}
    stale = [
        project
        for project in sorted(projects)
        if project.startswith(PROJECT_PREFIX)
        and project[len(PROJECT_PREFIX) :].isdigit()
        and not _alive(int(project[len(PROJECT_PREFIX) :]))
    ]
    for project in stale:
        subprocess.run(
            [
                "docker",
                "compose",
                "-f",
                str(ROOT / "compose.yaml"),
                "-p",
                project,
                "down",
                "--volumes",
                "--timeout",
                "1",
            ],
            capture_output=True,
            check=False,
        )
    return stale


@contextlib.contextmanager
def start_stack(client: Any, folder: Path) -> Iterator[ComposeStack]:
    """``compose.yaml`` up, every service healthy (``--wait``), under a project of its own; down with
    its volumes afterwards (also when the start fails)."""
    remove_stale_stacks(client)
    project = f"{PROJECT_PREFIX}{os.getpid()}"
    env_file = folder / "compose.env"
    # the health page on a port Docker picks when it publishes it: a port chosen here ahead could be
    # taken by another process before the collector starts
    env_file.write_text(f"COMPOSE_PROJECT_NAME={project}\nCLUSTER_PROXY_HEALTH_PORT=\n")
    os.environ["COMPOSE_BAKE"] = "false"
    compose = DockerCompose(
        ROOT, compose_file_name="compose.yaml", env_file=str(env_file), wait=True, build=False, pull=False
    )
    stack = ComposeStack(compose, client, project)
    started = time.monotonic()
    try:
        compose.start()
    except subprocess.CalledProcessError as exc:
        logs = stack.logs_tail(30)
        with contextlib.suppress(Exception):
            compose.stop()
        raise AssertionError(
            f"docker compose up --wait failed (exit {exc.returncode}):\n{exc.stderr.decode(errors='replace')[-3000:]}\n{logs}"
        ) from None
    stack.up_seconds = time.monotonic() - started
    collector = stack.container("health-collector")
    stack.health_port = int(collector.attrs["NetworkSettings"]["Ports"]["8080/tcp"][0]["HostPort"])
    try:
        yield stack
    finally:
        compose.stop()
