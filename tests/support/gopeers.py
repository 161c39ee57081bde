"""Go programs used as real peers in tests, built once per source version and Go version into the tool
cache outside the repository (``${XDG_CACHE_HOME:-~/.cache}/cluster-proxy/go-peers``): our own
(tests/go) and h2spec, the HTTP/2 conformance suite, from the Go module registry."""

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


def _go(what: str) -> tuple[str, str]:
    """The go command and its version line; skip (fail under CI) without one."""
    go = shutil.which("go")
    require(go is not None, f"the go toolchain (to build {what})")
    assert go is not None
    return go, subprocess.run([go, "version"], capture_output=True, text=True, check=True).stdout


def _build(
    go: str, binary: Path, package: str, cwd: Path, *, mod: str = "readonly", ldflags: str = ""
) -> None:
    """``go build`` into ``binary`` (through a partial file, so a killed build leaves no binary), at a
    lower CPU priority: the machine's other work (and other test sessions) keeps its share."""
    binary.parent.mkdir(parents=True, exist_ok=True)
    partial = binary.with_suffix(".partial")
    build = subprocess.run(
        [go, "build", f"-mod={mod}", "-trimpath", f"-ldflags={ldflags}", "-o", str(partial), package],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "CGO_ENABLED": "0"},
        preexec_fn=lambda: os.nice(10),
    )
    assert build.returncode == 0, f"go build {package} failed:\n{build.stderr}"
    partial.replace(binary)


def go_peer(name: str, module: Path = SOURCES) -> Path:
    """The binary of ``<module>/<name>`` (``tests/go`` by default; ``tests/go-konnectivity`` builds
    against upstream's konnectivity-client, its go.sum checked in), built when its sources, its
    module's requirements or the Go version changed."""
    go, version = _go(f"the Go peer {name}")
    digest = hashlib.sha256(version.encode())
    module_files = [module / "go.mod", *([module / "go.sum"] if (module / "go.sum").exists() else [])]
    for path in sorted([*module_files, *(module / name).rglob("*.go")]):
        digest.update(path.relative_to(module).as_posix().encode() + b"\0" + path.read_bytes())
    binary = tool_cache() / "go-peers" / f"{name}-{digest.hexdigest()[:16]}"
    if not binary.exists():
        _build(go, binary, f"./{name}", module)
    return binary


KONNECTIVITY_SOURCES = SOURCES.parent / "go-konnectivity"


# h2spec v2.2.1 (its last release) has no go.mod of its own, so the registry would resolve its
# dependencies to whatever is newest; this module pins them (go.sum is filled from the registry and
# checked against the Go checksum database on first download).
H2SPEC_MODULE = """module clusterproxy.test/h2spec

go 1.26

require (
\tgithub.com/summerwind/h2spec v2.2.1+incompatible
\tgithub.com/fatih/color v1.19.0
\tgithub.com/mattn/go-colorable v0.1.14
\tgithub.com/mattn/go-isatty v0.0.20
\tgithub.com/spf13/cobra v1.10.2
\tgithub.com/spf13/pflag v1.0.9
\tgolang.org/x/net v0.62.0
\tgolang.org/x/sys v0.49.0
\tgolang.org/x/text v0.43.0
)
"""


def h2spec() -> Path:
    """The h2spec binary, built from the Go module registry at the pinned versions (about 30 s cold)."""
    go, version = _go("h2spec")
    digest = hashlib.sha256(version.encode() + b"\0" + H2SPEC_MODULE.encode()).hexdigest()[:16]
    binary = tool_cache() / "go-peers" / f"h2spec-{digest}"
    if not binary.exists():
        module = tool_cache() / "go-peers" / f"h2spec-{digest}-module"
        module.mkdir(parents=True, exist_ok=True)
        (module / "go.mod").write_text(H2SPEC_MODULE)
        _build(go, binary, "github.com/summerwind/h2spec/cmd/h2spec", module, mod="mod")
    return binary
