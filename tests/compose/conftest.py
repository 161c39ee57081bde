"""The compose layer: the images and ``compose.yaml`` on a real Docker engine, driven by testcontainers.

Before the first test runs (outside any test's timeout: a cold build takes minutes), the session runs
``scripts/compose.sh images``: under ``CI=true`` always (it installs and starts the Docker engine and
Compose v2 when missing, makes the base image, builds every image), elsewhere only when a Docker
daemon already answers. Without one the tests skip on a laptop and fail under ``CI=true``, as every
missing prerequisite does. Every test here is ``slow`` and ``docker`` (``-m docker`` selects them).

Fixtures:

- ``docker_client``: the Docker SDK client (API version negotiated: Debian's engine speaks 1.41);
- ``compose_stack`` (module scope): ``compose.yaml`` up (``docker compose up --wait``) under a
  project name of its own and a free host port for the health page, torn down with its volumes.
  When a test fails, the tail of every service's log is attached to its report.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.compose.stack import ComposeStack, docker_answers, images_ready, start_stack
from tests.support import nodeimages, require

# beside the script's own logs (dockerd's, each image's build)
TOOL_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cluster-proxy" / "docker"
PREPARE_LOG = "compose-images.log"
PREPARED = pytest.StashKey[str | None]()  # None: ready; else why not
LOG_SECTION_LINES = 25

os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")  # Ryuk's image cannot be pulled here


def _under_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def _is_compose_test(item: pytest.Item) -> bool:
    return Path(str(item.fspath)).parent == Path(__file__).parent


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _is_compose_test(item):
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.docker)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build what the tests need (engine, Compose, base image, images) before the first test."""
    if not any(_is_compose_test(item) for item in session.items):
        return
    if not _under_ci() and not docker_answers():
        session.config.stash[PREPARED] = (
            "no Docker daemon answers (`./scripts/task compose` installs and starts one, as root)"
        )
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    log_path = TOOL_CACHE / PREPARE_LOG
    started = time.monotonic()
    session.config.stash[PREPARED] = nodeimages.build_project_images(log_path)
    took = time.monotonic() - started
    if reporter is not None:
        reporter.write_line(f"compose: engine, base image and images ready in {took:.0f}s (log {log_path})")


@pytest.fixture(scope="session")
def compose_ready(request: pytest.FixtureRequest) -> None:
    problem = request.config.stash.get(PREPARED, "the images were not prepared (no compose test collected?)")
    if problem is not None and problem.startswith("scripts/compose.sh"):
        pytest.fail(problem)  # a real failure wherever it happens
    require(problem is None, problem or "")
    require(images_ready(), "the cluster-proxy images (./scripts/task images)")


@pytest.fixture(scope="session")
def docker_client(compose_ready: None):  # -> docker.DockerClient
    import docker

    client = docker.from_env(version="auto")
    yield client
    client.close()


@pytest.fixture(scope="module")
def compose_stack(
    compose_ready: None, docker_client, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ComposeStack]:
    with start_stack(docker_client, tmp_path_factory.mktemp("compose")) as stack:
        yield stack


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    report = yield
    if report.failed and _is_compose_test(item):
        stack = getattr(item, "funcargs", {}).get("compose_stack")
        if isinstance(stack, ComposeStack):
            report.sections.append(("compose logs", stack.logs_tail(LOG_SECTION_LINES)))
    return report
