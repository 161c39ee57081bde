"""The images' Debian release is named in one file (deploy/images/base.env) and every default that
must follow it agrees. The root filesystem recipes (scripts/compose.sh's base image, bench/python_root.sh) take their
Debian mirror from the machine's apt sources (scripts/apt-mirror.sh), never from a host written in the
repository."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPES = (REPO / "scripts" / "compose.sh", REPO / "bench" / "python_root.sh")


def _sources(apt: Path, suite: str) -> list[str]:
    done = subprocess.run(
        [
            "bash",
            "-c",
            'source "$0" && debian_sources "$1" "$2"',
            REPO / "scripts" / "apt-mirror.sh",
            suite,
            apt,
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_deb822_and_one_line_sources_become_the_other_release(tmp_path: Path) -> None:
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\n# a comment\nURIs: http://mirror.internal/debian\nSuites: bookworm bookworm-updates\n"
        "Components: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n"
        "Types: deb-src\nURIs: http://mirror.internal/debian\nSuites: bookworm\nComponents: main\n\n"
        "Types: deb\nURIs: http://mirror.internal/debian-security\nSuites: bookworm-security\n"
        "Components: main contrib\n"
    )
    (tmp_path / "sources.list").write_text(
        "# deb http://commented.out/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/k.gpg] http://proxy.internal:3142/debian bookworm main\n"
        "deb http://ppa.internal/ubuntu jammy main\n"
    )
    assert _sources(tmp_path, "trixie") == [
        "deb http://proxy.internal:3142/debian trixie main",
        "deb http://mirror.internal/debian trixie main",
        "deb http://mirror.internal/debian trixie-updates main",
        "deb http://mirror.internal/debian-security trixie-security main contrib",
    ]


def test_a_machine_without_debian_sources_gives_nothing(tmp_path: Path) -> None:
    assert _sources(tmp_path, "trixie") == []


def test_no_mirror_host_is_written_in_the_recipes() -> None:
    for recipe in RECIPES:
        text = recipe.read_text()
        assert "debian_sources" in text, recipe
        assert not re.search(r"(https?|ftp)://[^\s\"']*(debian|ubuntu)", text), recipe


def test_every_default_names_the_release_of_base_env() -> None:
    suite = next(
        line.split("=", 1)[1].strip()
        for line in (REPO / "deploy" / "images" / "base.env").read_text().splitlines()
        if line.startswith("BASE_SUITE=")
    )
    followers = [
        REPO / "deploy" / "images" / "Dockerfile",
        REPO / "deploy" / "compose" / "toolbox" / "Dockerfile",
        REPO / "deploy" / "compose" / "network-peers" / "Dockerfile",
        REPO / "compose.yaml",
        REPO / "tests" / "compose" / "stack.py",
    ]
    for follower in followers:
        named = set(re.findall(r"cluster-proxy/python-base:([\w.-]+)", follower.read_text()))
        assert named == {suite}, (follower, named)
