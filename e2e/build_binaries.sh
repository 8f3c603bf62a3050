#!/usr/bin/env bash
exec bash "$(dirname "${BASH_SOURCE[0]}")/../gputopo/localcluster/build_binaries.sh" "$@"
