#!/usr/bin/env bash
# Sets up everything the tests need on a fresh machine, then runs lint, types and every test
# (unit once, and e2e against real upstream etcd, kube-apiserver and kube-scheduler once per
# Kubernetes version). Re-runs reuse the virtualenv and the cached control-plane binaries.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/venv.sh '[dev]'

# The e2e suite runs once per Kubernetes release here: the oldest supported minor and the newest
# served one (GPUTOPO_E2E_K8S_VERSIONS overrides the list, e.g. one version for a quick run).
read -r -a K8S_VERSIONS <<< "${GPUTOPO_E2E_K8S_VERSIONS:-1.34.4 1.37.2}"

# The real job controllers the e2e suite runs (JobSet, LeaderWorkerSet, Kueue, Kubeflow Trainer), pinned
# and cached like the binaries: about 12 minutes on two cores the first time, nothing after. Built in
# the background while the binaries build (the Go builds' serial steps overlap), waited for below.
CONTROLLERS_LOG="$(mktemp)"
bash gputopo/localcluster/build_controllers.sh > "$CONTROLLERS_LOG.out" 2> "$CONTROLLERS_LOG" &
CONTROLLERS_PID=$!
declare -A BINS
echo "== control-plane binaries (built once per machine and version from the Go module proxy, then cached)"
for v in "${K8S_VERSIONS[@]}"; do
  BINS[$v]="$(GPUTOPO_K8S_VERSION="$v" bash e2e/build_binaries.sh)"
  echo "   $v: ${BINS[$v]}"
done

echo "== job controllers (built once per machine from the Go module proxy, then cached)"
if ! wait "$CONTROLLERS_PID"; then cat "$CONTROLLERS_LOG" >&2; echo "building the job controllers failed" >&2; exit 1; fi
grep '^\[build-controllers\] built' "$CONTROLLERS_LOG" | sed 's/^/   /' || true
CONTROLLERS_DIR="$(cat "$CONTROLLERS_LOG.out")"
rm -f "$CONTROLLERS_LOG" "$CONTROLLERS_LOG.out"
echo "   $CONTROLLERS_DIR"

# As root, the images e2e/test_installed.py runs on a containerd node (cached like the binaries; the
# script also installs the Debian packages it and that node need). Without root those tests skip.
if [[ $(id -u) -eq 0 ]]; then echo "== images"; bash gputopo/localcluster/build_images.sh "${BINS[@]}" >/dev/null; fi

echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== import contracts (layers, no I/O in the engine, one Kubernetes layer)"
.venv/bin/lint-imports
echo "== mypy --strict"
.venv/bin/mypy gputopo tests e2e bench
.venv/bin/mypy conftest.py  # alone: it shares its module name with e2e/conftest.py
# Unit tests once; the e2e suite once per version, each against its own binaries. Exit status 5
# (nothing collected, e.g. a -k that matches only one layer) fails only when every run had it.
set +e
echo "== pytest (unit)"
.venv/bin/pytest -m "not e2e" "$@"
rcs=($?)
for v in "${K8S_VERSIONS[@]}"; do
  echo "== pytest (e2e, Kubernetes $v)"
  GPUTOPO_K8S_VERSION="$v" GPUTOPO_BIN_DIR="${BINS[$v]}" GPUTOPO_CONTROLLERS_DIR="$CONTROLLERS_DIR" \
    .venv/bin/pytest --e2e -m e2e "$@"
  rcs+=($?)
done
set -e
rc=0
collected=0
for r in "${rcs[@]}"; do
  [[ $r -eq 5 ]] && continue
  collected=1
  [[ $r -ne 0 && $rc -eq 0 ]] && rc=$r
done
if [[ $collected -eq 0 ]]; then
  echo "pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit $rc
