#!/usr/bin/env bash
# Sets up everything the tests need on a fresh machine, then runs lint, types and every test
# (unit and e2e against real upstream etcd, kube-apiserver and kube-scheduler). Re-runs reuse the
# virtualenv and the cached control-plane binaries.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/venv.sh '[dev]'

echo "== control-plane binaries (built once per machine from the Go module proxy, then cached)"
BIN="$(bash e2e/build_binaries.sh)"
export GPUTOPO_BIN_DIR="$BIN"
echo "   $BIN"

echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== mypy --strict"
.venv/bin/mypy gputopo extender agent tests e2e bench
.venv/bin/mypy conftest.py  # alone: it shares its module name with e2e/conftest.py
echo "== pytest (unit + e2e)"
set +e
.venv/bin/pytest --e2e "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  echo "pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit $rc
