"""Kubelet PodResources v1 API: vendored proto, generated stubs (scripts/gen_protos.sh), client."""
