#!/usr/bin/env bash
# Build the benchmark client/target (bench/loadgen) into the cache folder:
#   ${XDG_CACHE_HOME:-$HOME/.cache}/cluster-proxy/loadgen/bin/loadgen
# Prints the binary's path on stdout. Skipped when the sources did not change.
# Its only dependencies are konnectivity-client v0.36.0 (the benchmarks' upstream version) and
# gRPC, for the --konnectivity mode; go.sum is checked in, so the build fetches exactly those
# versions from the Go module registry (GOPROXY) on a fresh machine and fails on any mismatch.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${CLUSTER_PROXY_BENCH_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cluster-proxy}"
OUT="$CACHE/loadgen/bin/loadgen"
command -v go >/dev/null 2>&1 || { echo "loadgen-build: error: go is not installed" >&2; exit 1; }
stamp="$( { go version; cat "$HERE"/go.mod "$HERE"/go.sum "$HERE"/*.go; } | sha256sum | cut -d' ' -f1)"
if [[ -x "$OUT" && "$(cat "$OUT.stamp" 2>/dev/null || true)" == "$stamp" ]]; then
    echo "$OUT"
    exit 0
fi
mkdir -p "$(dirname "$OUT")"
cd "$HERE"
export GOFLAGS="${GOFLAGS:-} -mod=readonly"
go vet . >&2
go build -trimpath -o "$OUT.new" . >&2
mv -f "$OUT.new" "$OUT" # a loadgen already running keeps its own file
echo "$stamp" >"$OUT.stamp"
echo "loadgen-build: built $OUT" >&2
echo "$OUT"
