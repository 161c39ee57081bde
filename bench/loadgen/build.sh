#!/usr/bin/env bash
# Build the benchmark client/target (bench/loadgen, standard library only) into the cache folder:
#   ${XDG_CACHE_HOME:-$HOME/.cache}/cluster-proxy/loadgen/bin/loadgen
# Prints the binary's path on stdout. Skipped when the sources did not change.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${CLUSTER_PROXY_BENCH_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cluster-proxy}"
OUT="$CACHE/loadgen/bin/loadgen"
command -v go >/dev/null 2>&1 || { echo "loadgen-build: error: go is not installed" >&2; exit 1; }
stamp="$( { go version; cat "$HERE"/go.mod "$HERE"/*.go; } | sha256sum | cut -d' ' -f1)"
if [[ -x "$OUT" && "$(cat "$OUT.stamp" 2>/dev/null || true)" == "$stamp" ]]; then
    echo "$OUT"
    exit 0
fi
mkdir -p "$(dirname "$OUT")"
cd "$HERE"
go vet . >&2
GOFLAGS="${GOFLAGS:-} -mod=mod" go build -trimpath -o "$OUT" . >&2
echo "$stamp" >"$OUT.stamp"
echo "loadgen-build: built $OUT" >&2
echo "$OUT"
