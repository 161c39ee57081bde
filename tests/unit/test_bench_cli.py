"""bench's --ours-build: ours from another build (another python3's virtualenv, the wrappers of
bench/python_root.sh) measured as a system of its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import image_runtime
from bench.cli import IMAGE_SYSTEM, SYSTEMS, known_systems
from bench.pki import BenchPKI
from bench.systems import Env


def test_each_build_is_a_system_running_its_own_programs(tmp_path: Path) -> None:
    builds = tmp_path / "py312.bin"
    builds.mkdir()
    known = known_systems([f"py312={builds}"])
    assert set(known) - set(SYSTEMS) == {"ours-py312"}
    pki = BenchPKI(tmp_path / "pki")
    env = Env(tmp_path / "loadgen", tmp_path / "run", pki, pki.server(), pki.client(), target_port=1)
    system = known["ours-py312"](env)
    assert (system.name, system.server_bin, system.agent_bin) == (
        "ours-py312",
        builds / "cluster-proxy-server",
        builds / "cluster-proxy-agent",
    )
    assert known["ours"](env).server_bin == env.venv_bin / "cluster-proxy-server"


def test_every_run_has_the_images_runtime_as_a_system() -> None:
    # deploy/images/base.env names the release; a build of that name would be a second ours-<release>
    assert f"ours-{image_runtime.image_suite()}" == IMAGE_SYSTEM and IMAGE_SYSTEM in SYSTEMS
    with pytest.raises(ValueError, match="is a system already"):
        known_systems([f"{image_runtime.image_suite()}=."])


@pytest.mark.parametrize("given", ["py312", "=/tmp", "py312=/no/such/folder", "w2=."])
def test_a_bad_build_is_named(given: str) -> None:
    with pytest.raises(ValueError, match=f"--ours-build '{given}'"):
        known_systems([given])
