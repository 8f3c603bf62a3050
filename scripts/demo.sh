#!/usr/bin/env bash
# The main job on a fresh machine: set up, then run the local demo (a real etcd, kube-apiserver,
# kube-controller-manager and kube-scheduler with simulated GPU nodes, the real extender and agents)
# on the files in examples/.
# Extra arguments go to `gputopo demo` (for example --keep).
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/venv.sh ""  # an explicit "": sourcing without arguments would hand it ours (pip would be asked for -e .--installed)
exec .venv/bin/gputopo demo "$@"
