"""Ours on the container images' runtime (issue 36, point 4): the system ``ours-<release>`` every goal
run has, the Debian release the images are made from (``deploy/images/base.env``) as a root filesystem
with this commit's server and agent installed in its python3 (``bench/python_root.sh``), run through
chroot. The root filesystem is kept in the tool cache outside the repository; the commit is installed
again on every run that builds (``--no-build`` uses what is there)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASE_ENV = REPO / "deploy" / "images" / "base.env"
SCRIPT = REPO / "bench" / "python_root.sh"


def image_suite() -> str:
    """The release ``deploy/images/base.env`` names (``BASE_SUITE=``)."""
    for line in BASE_ENV.read_text().splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "BASE_SUITE":
            return value.strip().strip('"')
    raise ValueError(f"{BASE_ENV}: no BASE_SUITE=")


def system_name() -> str:
    return f"ours-{image_suite()}"


def root_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cluster-proxy"
    return cache / "bench-roots" / image_suite()


def prepare(build: bool) -> tuple[Path | None, str]:
    """The folder with the build's ``cluster-proxy-server`` and ``cluster-proxy-agent``, made or
    refreshed with this commit by python_root.sh (only mounted again when ``build`` is False), or
    (None, why not)."""
    if os.geteuid() != 0:
        return None, "needs root (mmdebstrap, chroot, bind mounts)"
    root = root_dir()
    root.parent.mkdir(parents=True, exist_ok=True)
    argv = [image_suite(), str(root)] if build else ["--mount", str(root)]
    done = subprocess.run(["bash", str(SCRIPT), *argv], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return None, f"bench/python_root.sh {' '.join(argv)}: {done.stderr.strip()[-800:]}"
    return Path(done.stdout.strip().splitlines()[-1]), ""


def release() -> None:
    """Undo python_root.sh's bind mounts (the root filesystem stays in the tool cache)."""
    if root_dir().exists():
        subprocess.run(["bash", str(SCRIPT), "--unmount", str(root_dir())], capture_output=True, check=False)
