"""gputopo-agent as the kubelet's device plugin for whole GPUs (kubelet device plugin API v1beta1).

The generated `api_pb2*` modules come from the vendored `api.proto` (scripts/gen_protos.sh).
"""
