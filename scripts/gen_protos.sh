#!/usr/bin/env bash
# Regenerate the Python stubs of the vendored kubelet APIs: PodResources v1 (agent/podresources)
# and the device plugin v1beta1 (agent/deviceplugin).
#
#   scripts/gen_protos.sh            # uses .venv/bin/python
#   PYTHON=python3 scripts/gen_protos.sh
#
# Needs grpcio-tools (the project's `dev` extra). The generated files are committed; rerun this after
# changing an api.proto or the grpcio-tools version, and commit the result. Running it from the
# repository root with `-I.` makes each generated grpc module import `agent.<api>.api_pb2` as a
# package import, so no post-editing is needed.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"

for api in podresources deviceplugin; do
  "$PYTHON" -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. "agent/$api/api.proto"
  # protoc's stub uses a bare `Mapping` in __init__ signatures; mypy reads stubs even for modules set
  # to follow_imports=skip, so tell it to accept that one construct rather than editing the types.
  STUB="agent/$api/api_pb2.pyi"
  { echo '# mypy: disable-error-code="type-arg"'; cat "$STUB"; } > "$STUB.tmp" && mv "$STUB.tmp" "$STUB"
done

# The stubs check these at import time: the runtime needs protobuf and grpcio at least this new.
"$PYTHON" - <<'PY'
from importlib.metadata import version
print("generated with grpcio-tools", version("grpcio-tools"), "| needs at runtime grpcio >=", version("grpcio-tools"),
      "and protobuf >= the 'Protobuf Python Version' in agent/*/api_pb2.py")
PY
