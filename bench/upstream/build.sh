#!/usr/bin/env bash
# Build the upstream apiserver-network-proxy ("ANP", konnectivity) proxy-server and agent that the
# benchmarks compare against, from the Go module registry, into a cache folder outside git.
#
#   bash bench/upstream/build.sh            # prints the bin folder on stdout
#   ANP_VERSION=v0.36.0 bash bench/upstream/build.sh
#
# Output (skipped when already built):
#   ${XDG_CACHE_HOME:-$HOME/.cache}/cluster-proxy/anp-<version>/bin/{proxy-server,proxy-agent,anp-multiagent}
#
# Why not `go install sigs.k8s.io/apiserver-network-proxy/cmd/server@<version>`: `go install pkg@version`
# also loads the module's version list (for deprecation notices), and the registry here refuses the
# list of this module (403) while it serves the pinned versions themselves. So the binaries are built
# from a throw-away module in the cache folder that requires the pinned version (go get + go build).
# The nested module konnectivity-client is pinned to the same tag (upstream's go.mod points it at
# ./konnectivity-client with a replace directive, which a dependency's go.mod cannot do for us).
#
# anp-multiagent is our own small program (bench/upstream/multiagent/main.go) compiled against the
# same upstream module: N upstream agents in one process, for the fan-in benchmark.
set -euo pipefail

ANP_VERSION="${ANP_VERSION:-v0.36.0}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${CLUSTER_PROXY_BENCH_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cluster-proxy}"
ROOT="$CACHE/anp-$ANP_VERSION"
BIN="$ROOT/bin"
SRC="$ROOT/src"

log() { printf 'anp-build: %s\n' "$*" >&2; }

command -v go >/dev/null 2>&1 || { log "error: go is not installed (Go >= 1.26 is needed)"; exit 1; }

stamp_want="$(
    {
        echo "$ANP_VERSION"
        go version
        cat "$HERE/multiagent/main.go" "$HERE/build.sh"
    } | sha256sum | cut -d' ' -f1
)"
if [[ -x "$BIN/proxy-server" && -x "$BIN/proxy-agent" && -x "$BIN/anp-multiagent" &&
    "$(cat "$ROOT/.stamp" 2>/dev/null || true)" == "$stamp_want" ]]; then
    log "up to date: $BIN"
    echo "$BIN"
    exit 0
fi

log "building apiserver-network-proxy $ANP_VERSION into $BIN (takes a few minutes the first time)"
mkdir -p "$SRC/multiagent" "$BIN"
cd "$SRC"
if [[ ! -f go.mod ]]; then
    go mod init anp-bench-build >/dev/null 2>&1
fi
cp "$HERE/multiagent/main.go" "$SRC/multiagent/main.go"
export GOFLAGS="${GOFLAGS:-} -mod=mod"
go get "sigs.k8s.io/apiserver-network-proxy@$ANP_VERSION" \
    "sigs.k8s.io/apiserver-network-proxy/konnectivity-client@$ANP_VERSION" >&2
go build -trimpath -o "$BIN/proxy-server" sigs.k8s.io/apiserver-network-proxy/cmd/server >&2
go build -trimpath -o "$BIN/proxy-agent" sigs.k8s.io/apiserver-network-proxy/cmd/agent >&2
go build -trimpath -o "$BIN/anp-multiagent" ./multiagent >&2
go list -m all 2>/dev/null | grep -E '^sigs.k8s.io/apiserver-network-proxy|^google.golang.org/grpc ' >"$ROOT/versions.txt" || true
echo "$stamp_want" >"$ROOT/.stamp"
log "built: $(tr '\n' ' ' <"$ROOT/versions.txt")"
echo "$BIN"
