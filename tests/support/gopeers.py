"""Go programs used as real peers in tests (tests/go), built once per source version and Go version
into the tool cache outside the repository (``${XDG_CACHE_HOME:-~/.cache}/cluster-proxy/go-peers``)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from tests.support import require

SOURCES = Path(__file__).resolve().parents[1] / "go"


def tool_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cluster-proxy"


def go_peer(name: str) -> Path:
    """The binary of ``tests/go/<name>``, built when its sources or the Go version changed."""
    go = shutil.which("go")
    require(go is not None, "the go toolchain (to build tests/go peers)")
    assert go is not None
    version = subprocess.run([go, "version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256(version.encode())
    for path in sorted([SOURCES / "go.mod", *(SOURCES / name).rglob("*.go")]):
        digest.update(path.relative_to(SOURCES).as_posix().encode() + b"\0" + path.read_bytes())
    binary = tool_cache() / "go-peers" / f"{name}-{digest.hexdigest()[:16]}"
    if not binary.exists():
        binary.parent.mkdir(parents=True, exist_ok=True)
        partial = binary.with_suffix(".partial")
        build = subprocess.run(
            [go, "build", "-o", str(partial), f"./{name}"],
            cwd=SOURCES,
            capture_output=True,
            text=True,
            env={**os.environ, "CGO_ENABLED": "0"},
        )
        assert build.returncode == 0, f"go build ./{name} failed:\n{build.stderr}"
        partial.replace(binary)
    return binary
