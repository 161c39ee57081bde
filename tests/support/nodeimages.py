"""Container images for the real nodes, made here without Docker or a registry: OCI archives of one
layer each (an image index whose manifest names the image in ``io.containerd.image.name``), imported
with ``ctr -n k8s.io images import`` into each node's containerd.

- ``PAUSE_IMAGE``: the static pause program, each pod sandbox's PID 1;
- ``BUSYBOX_IMAGE``: Debian's static busybox (a shell, ``httpd``, ``wget``, ``nslookup``) as the user
  65532, the test pods' image;
- ``COREDNS_IMAGE``: CoreDNS, the cluster's DNS.

The archives are built into the tool cache, named by the digest of what they hold, so they are made
once per content.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

from tests.support import kubebuild
from tests.support.kubeapi import _build_lock

PAUSE_IMAGE = "localhost/cluster-proxy-test/pause:1"
BUSYBOX_IMAGE = "localhost/cluster-proxy-test/busybox:1"
COREDNS_IMAGE = "localhost/cluster-proxy-test/coredns:" + kubebuild.COREDNS_VERSION
NONROOT = 65532
REPO = Path(__file__).resolve().parents[2]
BUSYBOX_APPLETS = ("sh", "cat", "echo", "id", "stat", "ls", "sleep", "httpd", "wget", "nslookup", "nc", "env")


@dataclass(frozen=True)
class _File:
    path: str  # inside the image, no leading slash
    source: Path | None = None  # a file's content, or None for a symlink
    target: str = ""  # a symlink's target
    mode: int = 0o755


def _layer(files: list[_File]) -> bytes:
    """A deterministic tar (fixed times and owners: the same files give the same digest)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        folders = sorted({str(Path(f.path).parent) for f in files} - {"."})
        for folder in folders:
            info = tarfile.TarInfo(folder)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for item in files:
            info = tarfile.TarInfo(item.path)
            info.mode = item.mode
            if item.source is None:
                info.type, info.linkname = tarfile.SYMTYPE, item.target
                tar.addfile(info)
            else:
                data = item.source.read_bytes()
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return raw.getvalue()


def _blob(blobs: dict[str, bytes], data: bytes) -> dict[str, object]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blobs[digest] = data
    return {"digest": digest, "size": len(data)}


def _archive(name: str, files: list[_File], config: dict[str, object]) -> Path:
    """The OCI archive of an image of one layer holding ``files``, its ``config`` the runtime part of
    the image configuration (Entrypoint, User, ...). Named by what goes in (compressing CoreDNS
    takes seconds: a warm run only looks the archive up)."""
    key = hashlib.sha256(json.dumps([name, config], sort_keys=True).encode())
    for item in files:
        stat = item.source.stat() if item.source else None
        key.update(
            f"{item.path}\0{item.target}\0{item.mode}\0{stat and (stat.st_size, stat.st_mtime_ns)}".encode()
        )
    stem = name.rsplit("/", 1)[-1].replace(":", "-")
    archive = kubebuild.kube_cache() / "images" / f"{stem}-{key.hexdigest()[:16]}.tar"
    if archive.exists():
        return archive
    layer = _layer(files)
    blobs: dict[str, bytes] = {}
    compressed = gzip.compress(layer, mtime=0)
    image_config = {
        "architecture": "amd64",
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()]},
    }
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            **_blob(blobs, json.dumps(image_config, sort_keys=True).encode()),
        },
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **_blob(blobs, compressed)}],
    }
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                **_blob(blobs, json.dumps(manifest, sort_keys=True).encode()),
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": name},
            }
        ],
    }
    index_bytes = json.dumps(index, sort_keys=True).encode()
    with _build_lock(archive):
        if not archive.exists():
            partial = archive.with_suffix(".partial")
            with tarfile.open(partial, "w") as tar:
                entries = {"oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode()}
                entries["index.json"] = index_bytes
                for blob_digest, data in blobs.items():
                    entries["blobs/sha256/" + blob_digest.removeprefix("sha256:")] = data
                for path, data in entries.items():
                    info = tarfile.TarInfo(path)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
            partial.replace(archive)
    return archive


def pause_image() -> Path:
    return _archive(
        PAUSE_IMAGE, [_File("pause", kubebuild.pause_binary())], {"Entrypoint": ["/pause"], "User": "65535"}
    )


def busybox_image() -> Path:
    box = kubebuild.busybox()
    files = [_File("bin/busybox", box)]
    files += [_File(f"bin/{applet}", target="busybox") for applet in BUSYBOX_APPLETS]
    return _archive(BUSYBOX_IMAGE, files, {"Entrypoint": ["/bin/sh"], "User": f"{NONROOT}:{NONROOT}"})


def coredns_image() -> Path:
    return _archive(
        COREDNS_IMAGE,
        [_File("coredns", kubebuild.coredns_binary())],
        {"Entrypoint": ["/coredns"], "User": f"{NONROOT}:{NONROOT}"},
    )


def all_images() -> list[Path]:
    """Every archive a node imports (built on first use)."""
    return [pause_image(), busybox_image(), coredns_image()]


# --- the project's images ------------------------------------------------------------------------

# What the compose layer builds (``scripts/compose.sh images``) and the overlays name, at the tag the
# overlays set (deploy/kustomize/base/common): the hub runs all but the agent, a managed cluster only
# the agent.
PROJECT_TAG = "dev"
HUB_IMAGES = ("proxy-server", "cert-signer", "addon-manager", "health-collector", "cluster-gateway")
AGENT_IMAGES = ("proxy-agent",)


def project_image(name: str) -> str:
    return f"cluster-proxy/{name}:{PROJECT_TAG}"


def project_images_archive(names: tuple[str, ...]) -> Path:
    """One ``docker save`` archive of the project's images ``names`` (the layers they share stored
    once), cached in the tool cache under the images' IDs: a rebuilt image gives a new archive.
    containerd imports Docker's archive format and names each image as kubelet looks it up
    (``docker.io/cluster-proxy/<name>:dev``), so the overlays' Deployments run them unchanged."""
    refs = [project_image(n) for n in names]
    inspected = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Id}}", *refs], capture_output=True, text=True
    )
    assert inspected.returncode == 0, (
        f"the project's images are missing (build them: bash scripts/compose.sh images):\n{inspected.stderr}"
    )
    key = hashlib.sha256("\0".join([*refs, *inspected.stdout.split()]).encode()).hexdigest()[:16]
    stem = "project-" + "+".join(names)  # whole names: one set's stem is no prefix of another's
    archive = kubebuild.kube_cache() / "images" / f"{stem}-{key}.tar"
    if archive.exists():
        return archive
    archive.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(archive):
        if not archive.exists():
            for stale in archive.parent.glob(f"{stem}-{'?' * len(key)}.tar"):
                stale.unlink()  # an older build of the same images: hundreds of MB each
            partial = archive.with_suffix(".partial")
            saved = subprocess.run(
                ["docker", "save", "-o", str(partial), *refs], capture_output=True, text=True
            )
            assert saved.returncode == 0, f"docker save {' '.join(refs)}:\n{saved.stderr}"
            partial.replace(archive)
    return archive


def build_project_images(log_path: Path) -> str | None:
    """``scripts/compose.sh images`` (it installs and starts Docker when missing, makes the base and
    builds every image), its output in ``log_path``; why it failed (the log's tail), or None."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        done = subprocess.run(
            ["bash", str(REPO / "scripts" / "compose.sh"), "images"],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    if done.returncode == 0:
        return None
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
    return f"scripts/compose.sh images failed (exit {done.returncode}, log {log_path}):\n{tail}"
