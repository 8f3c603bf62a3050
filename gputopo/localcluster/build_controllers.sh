#!/usr/bin/env bash
# Builds the pinned job controllers the e2e suite runs for real (JobSet, LeaderWorkerSet, Kueue,
# Kubeflow Trainer) from their Go modules, into a cache outside the repository keyed by their
# versions. Each is built from a writable copy of its own module source with its own go.mod and
# go.sum, so the binary is what the project releases; the copy stays in the cache because the local
# control plane applies the CRDs, webhook configurations and RBAC from it. A second run with
# everything present does nothing. Prints the cache directory on stdout; progress goes to stderr.
#
#   build_controllers.sh [NAME...]           build what is missing (all four, or the NAMEs of
#                                            jobset, lws, kueue, trainer), print the dir
#   build_controllers.sh --check [NAME...]   build nothing: print the dir; exit 0 if those are
#                                            complete, else 3
#
# Environment: GPUTOPO_CACHE (cache root, as build_binaries.sh), GPUTOPO_JOBSET_VERSION,
# GPUTOPO_LWS_VERSION, GPUTOPO_KUEUE_VERSION, GPUTOPO_TRAINER_VERSION (pins; each set is its own
# cache key). Concurrent runs for the same key wait for each other (flock).
set -euo pipefail

JOBSET_VERSION="${GPUTOPO_JOBSET_VERSION:-0.12.0}"
LWS_VERSION="${GPUTOPO_LWS_VERSION:-0.9.0}"
KUEUE_VERSION="${GPUTOPO_KUEUE_VERSION:-0.19.2}"
TRAINER_VERSION="${GPUTOPO_TRAINER_VERSION:-2.3.0}"
CACHE_ROOT="${GPUTOPO_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gputopo}"
KEY="controllers_jobset-v${JOBSET_VERSION}_lws-v${LWS_VERSION}_kueue-v${KUEUE_VERSION}_trainer-v${TRAINER_VERSION}"
DIR="$CACHE_ROOT/$KEY"
# name|module@version|main package inside the module
SPECS=(
  "jobset|sigs.k8s.io/jobset@v$JOBSET_VERSION|."
  "lws|sigs.k8s.io/lws@v$LWS_VERSION|./cmd"
  "kueue|sigs.k8s.io/kueue@v$KUEUE_VERSION|./cmd/kueue"
  "trainer|github.com/kubeflow/trainer/v2@v$TRAINER_VERSION|./cmd/trainer-controller-manager"
)

log() { echo "[build-controllers] $*" >&2; }

CHECK=0
if [[ "${1:-}" == "--check" ]]; then CHECK=1; shift; fi
if [[ $# -gt 0 ]]; then
  wanted=()
  for name in "$@"; do
    hit=""
    for s in "${SPECS[@]}"; do [[ "${s%%|*}" == "$name" ]] && hit="$s"; done
    [[ -n "$hit" ]] || { log "unknown controller '$name' (jobset, lws, kueue, trainer)"; exit 2; }
    wanted+=("$hit")
  done
  SPECS=("${wanted[@]}")
fi
have_all() {
  for s in "${SPECS[@]}"; do [[ -x "$DIR/bin/${s%%|*}" && -d "$DIR/src/${s%%|*}" ]] || return 1; done
}

if have_all; then echo "$DIR"; exit 0; fi
if [[ $CHECK -eq 1 ]]; then echo "$DIR"; exit 3; fi
mkdir -p "$DIR/bin" "$DIR/src"
if command -v flock >/dev/null; then
  exec 9>"$DIR/.build.lock"
  if ! flock -n 9; then log "another build of $KEY is running; waiting for it"; flock 9; fi
  if have_all; then echo "$DIR"; exit 0; fi
fi
command -v go >/dev/null || { log "Go toolchain not found on PATH"; exit 1; }

for s in "${SPECS[@]}"; do
  IFS='|' read -r name mod pkg <<<"$s"
  [[ -x "$DIR/bin/$name" && -d "$DIR/src/$name" ]] && continue
  meta=$(GOFLAGS=-mod=mod go mod download -json "$mod" || true)
  src=$(python3 -c 'import json,sys;print(json.loads(sys.argv[1]).get("Dir",""))' "$meta" 2>/dev/null || true)
  [[ -d "$src" ]] || { log "cannot download $mod: $meta"; exit 1; }
  # The module cache is read-only; a build that writes nothing still wants its own copy so that
  # the CRDs and manifests outlive a `go clean -modcache`.
  rm -rf "$DIR/src/$name.tmp"
  cp -r "$src" "$DIR/src/$name.tmp"
  chmod -R u+w "$DIR/src/$name.tmp"
  log "building $name ($mod, several minutes on 2 cores)"
  start=$(date +%s)
  (cd "$DIR/src/$name.tmp" && GOFLAGS=-mod=mod nice go build -trimpath -ldflags "-s -w" -o "$DIR/bin/$name.tmp" "$pkg") >&2
  log "built $name in $(( $(date +%s) - start )) s"
  mv "$DIR/bin/$name.tmp" "$DIR/bin/$name"
  rm -rf "$DIR/src/$name"
  mv "$DIR/src/$name.tmp" "$DIR/src/$name"
done

have_all || { log "some controllers are missing in $DIR"; exit 1; }
log "controllers ready in $DIR"
echo "$DIR"
