#!/usr/bin/env bash
# Regenerate services/proxy-server/src/clusterproxy_server/frontends/konnectivity_pb2.py from
# services/proxy-server/proto/konnectivity_client.proto with protoc from PyPI's grpcio-tools, installed
# into a throw-away venv in the tool cache (it is only needed here, never at run time: the server needs
# only the protobuf runtime). The generated file is checked in.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/cluster-proxy/protoc-venv"
GRPCIO_TOOLS_VERSION="${GRPCIO_TOOLS_VERSION:-1.76.0}"
if [[ ! -x "$CACHE/bin/python" ]] || ! "$CACHE/bin/python" -c "import grpc_tools" 2>/dev/null; then
    python3 -m venv "$CACHE"
    "$CACHE/bin/pip" install -q "grpcio-tools==$GRPCIO_TOOLS_VERSION"
fi
OUT="$ROOT/services/proxy-server/src/clusterproxy_server/frontends"
"$CACHE/bin/python" -m grpc_tools.protoc -I "$ROOT/services/proxy-server/proto" \
    --python_out="$OUT" --pyi_out="$OUT" "$ROOT/services/proxy-server/proto/konnectivity_client.proto"
mv "$OUT/konnectivity_client_pb2.py" "$OUT/konnectivity_pb2.py"
mv "$OUT/konnectivity_client_pb2.pyi" "$OUT/konnectivity_pb2.pyi"
echo "generated $OUT/konnectivity_pb2.py with grpcio-tools $GRPCIO_TOOLS_VERSION" >&2
