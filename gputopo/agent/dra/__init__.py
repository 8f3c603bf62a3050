"""gputopo-agent as the kubelet's DRA driver `gpu.gputopo.io` (kubelet DRA plugin API v1 and v1beta1).

`plugin.DraPlugin` ties it together: `server` (the DRA and registration sockets), `service` (their
gRPC services), `driver` (NodePrepareResources / NodeUnprepareResources), `checkpoint` (prepared
claims survive restarts), `cdi` (the CDI specs the runtime reads) and `slices` (the node's
ResourceSlice). The generated `api/*_pb2*` modules come from the vendored protos (scripts/gen_protos.sh).
"""
