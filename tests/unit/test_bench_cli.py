"""bench's --ours-build: ours from another build (another python3's virtualenv, the wrappers of
bench/python_root.sh) measured as a system of its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.cli import SYSTEMS, known_systems
from bench.pki import BenchPKI
from bench.systems import Env


def test_each_build_is_a_system_running_its_own_programs(tmp_path: Path) -> None:
    builds = tmp_path / "trixie.bin"
    builds.mkdir()
    known = known_systems([f"trixie={builds}"])
    assert set(known) - set(SYSTEMS) == {"ours-trixie"}
    pki = BenchPKI(tmp_path / "pki")
    env = Env(tmp_path / "loadgen", tmp_path / "run", pki, pki.server(), pki.client(), target_port=1)
    system = known["ours-trixie"](env)
    assert (system.name, system.server_bin, system.agent_bin) == (
        "ours-trixie",
        builds / "cluster-proxy-server",
        builds / "cluster-proxy-agent",
    )
    assert known["ours"](env).server_bin == env.venv_bin / "cluster-proxy-server"


@pytest.mark.parametrize("given", ["trixie", "=/tmp", "trixie=/no/such/folder", "w2=."])
def test_a_bad_build_is_named(given: str) -> None:
    with pytest.raises(ValueError, match=f"--ours-build '{given}'"):
        known_systems([given])
