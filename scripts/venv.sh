# Sourced by demo.sh and test.sh: create or update the project's virtualenv in .venv.
# $1: the pip extras to install ("" for the runtime only, "[dev]" for the tests).
PY="${PYTHON:-python3}"
if [[ ! -x .venv/bin/python ]]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".${1:-}"
