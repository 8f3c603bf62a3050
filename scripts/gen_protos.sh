#!/usr/bin/env bash
# Regenerate the Python stubs of the vendored kubelet APIs: PodResources v1 (gputopo/agent/podresources),
# the device plugin v1beta1 (gputopo/agent/deviceplugin), and for the DRA driver the DRA plugin API v1 and
# v1beta1 plus the plugin registration API v1 (gputopo/agent/dra/api).
#
#   scripts/gen_protos.sh            # uses .venv/bin/python
#   PYTHON=python3 scripts/gen_protos.sh
#
# Needs grpcio-tools (the project's `dev` extra). The generated files are committed; rerun this after
# changing a vendored .proto or the grpcio-tools version, and commit the result. Running it from the
# repository root with `-I.` makes each generated grpc module import its messages as a package import
# (`gputopo.agent.<api>.api_pb2`, `gputopo.agent.dra.api.dra_v1_pb2`), so no post-editing is needed.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"

PROTOS=(
  gputopo/agent/podresources/api.proto
  gputopo/agent/deviceplugin/api.proto
  gputopo/agent/dra/api/dra_v1.proto
  gputopo/agent/dra/api/dra_v1beta1.proto
  gputopo/agent/dra/api/pluginregistration.proto
)
for proto in "${PROTOS[@]}"; do
  "$PYTHON" -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. "$proto"
  # protoc's stub uses a bare `Mapping` in __init__ signatures; mypy reads stubs even for modules set
  # to follow_imports=skip, so tell it to accept that one construct rather than editing the types.
  STUB="${proto%.proto}_pb2.pyi"
  { echo '# mypy: disable-error-code="type-arg"'; cat "$STUB"; } > "$STUB.tmp" && mv "$STUB.tmp" "$STUB"
done

# The stubs check these at import time: the runtime needs protobuf and grpcio at least this new.
"$PYTHON" - <<'PY'
from importlib.metadata import version
print("generated with grpcio-tools", version("grpcio-tools"), "| needs at runtime grpcio >=", version("grpcio-tools"),
      "and protobuf >= the 'Protobuf Python Version' in the generated *_pb2.py")
PY
