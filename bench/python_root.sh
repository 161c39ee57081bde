#!/usr/bin/env bash
# Ours on another python3 and OpenSSL, for `python -m bench --ours-build NAME=DIR.bin`: a Debian root
# filesystem with its own python3 (Debian builds it with PGO and LTO) and this commit's server and agent
# installed in a virtualenv there.
#
#   bash bench/python_root.sh SUITE DIR      e.g. trixie /tmp/root-trixie (Python 3.13, OpenSSL 3.5)
#   bash bench/python_root.sh --mount DIR      the mounts of a DIR made before, nothing installed
#   bash bench/python_root.sh --unmount DIR
#
# As root: makes DIR with mmdebstrap (minbase + python3-venv; the mirror from this machine's apt
# sources: scripts/apt-mirror.sh), installs `git archive HEAD` of the repository into DIR/venv,
# bind-mounts /proc, /dev, /tmp and the repository at their own paths (the bench's files live under
# --out, /tmp or the repository) and writes DIR.bin/cluster-proxy-server and
# cluster-proxy-agent, which run those programs in DIR (chroot keeps the process id, so the bench
# measures the process it started). Prints DIR.bin. A DIR that exists is reused (mounts renewed).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/apt-mirror.sh
source "$REPO/scripts/apt-mirror.sh"
die() { echo "python_root: $*" >&2; exit 1; }
MOUNTS=(/proc /dev /tmp "$REPO")

unmount() {
    local dir="$1" point
    for point in "${MOUNTS[@]}"; do
        if mountpoint -q "$dir$point"; then umount -l "$dir$point"; fi
    done
}

if [[ "${1:-}" == "--unmount" ]]; then
    [[ $# -eq 2 ]] || die "usage: bash bench/python_root.sh --unmount DIR"
    unmount "$(realpath -m "$2")"
    exit 0
fi
mount_all() {
    local dir="$1" point
    for point in "${MOUNTS[@]}"; do
        mkdir -p "$dir$point"
        if ! mountpoint -q "$dir$point"; then
            if [[ "$point" == /proc ]]; then mount -t proc proc "$dir/proc"; else mount --bind "$point" "$dir$point"; fi
        fi
    done
}

if [[ "${1:-}" == "--mount" ]]; then
    [[ $# -eq 2 ]] || die "usage: bash bench/python_root.sh --mount DIR"
    dir="$(realpath -m "$2")"
    [[ -x "$dir/venv/bin/python" && -x "$dir.bin/cluster-proxy-server" ]] || die "$dir: not made yet (bash bench/python_root.sh SUITE $dir)"
    mount_all "$dir"
    echo "$dir.bin"
    exit 0
fi
[[ $# -eq 2 ]] || die "usage: bash bench/python_root.sh SUITE DIR (e.g. trixie /tmp/root-trixie)"
[[ $EUID -eq 0 ]] || die "needs root (mmdebstrap, chroot, mount)"
suite="$1"
dir="$(realpath -m "$2")"
PATH="$PATH:/usr/sbin:/sbin" command -v mmdebstrap >/dev/null || die "mmdebstrap missing (apt-get install mmdebstrap)"

if [[ ! -x "$dir/venv/bin/python" ]]; then
    unmount "$dir"
    rm -rf "$dir"
    mapfile -t sources < <(debian_sources "$suite")
    [[ ${#sources[@]} -gt 0 ]] || die "no Debian source in this machine's apt sources (/etc/apt/sources.list*)"
    echo "python_root: mmdebstrap $suite into $dir" >&2
    mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates \
        --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
        "$suite" "$dir" "${sources[@]}"
    # this machine's CAs (a TLS-inspecting proxy in front of PyPI is one of them)
    cp /etc/ssl/certs/ca-certificates.crt "$dir/etc/ssl/certs/ca-certificates.crt"
    chroot "$dir" python3 -m venv /venv
fi
mount_all "$dir"

source_dir="$(mktemp -d "$dir/tmp/python-root-src.XXXXXX")"  # $dir/tmp is this machine's /tmp
trap 'rm -rf "$source_dir"' EXIT
git -C "$REPO" archive HEAD | tar -x -C "$source_dir"
inside="/tmp/${source_dir##*/}"
echo "python_root: installing $(git -C "$REPO" rev-parse --short HEAD) into $dir/venv" >&2
# ours again even when the version is the same (a reused DIR gets this commit), then what it needs
chroot "$dir" env PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    /venv/bin/pip install --quiet --force-reinstall --no-deps "$inside/libs/protocol" "$inside/libs/sdk" \
    "$inside/services/proxy-server" "$inside/services/proxy-agent"
chroot "$dir" env PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    /venv/bin/pip install --quiet "$inside/libs/protocol" "$inside/libs/sdk" \
    "$inside/services/proxy-server" "$inside/services/proxy-agent"

mkdir -p "$dir.bin"
for program in cluster-proxy-server cluster-proxy-agent; do
    printf '#!/bin/sh\nexec chroot %q /venv/bin/%s "$@"\n' "$dir" "$program" >"$dir.bin/$program"
    chmod 755 "$dir.bin/$program"
done
chroot "$dir" /venv/bin/python -c 'import ssl, sys; print("python_root:", sys.version.split()[0], ssl.OPENSSL_VERSION, file=sys.stderr)'
echo "$dir.bin"
