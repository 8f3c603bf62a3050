#!/usr/bin/env bash
# Renders manifests/gputopo.yaml from charts/gputopo with the default values, for users who do
# not use Helm. The output is deterministic: the defaults leave the webhook off, so the chart
# generates no TLS material (a new CA per render); the "helm test" hooks are left out, and so is the
# post-delete cleanup Job (kubectl would run it at once; docs/install.md, "Uninstall").
# tests/chart/test_manifests_in_sync.py fails when manifests/ is out of date.
#
#   scripts/render-manifests.sh           rewrite manifests/gputopo.yaml
#   scripts/render-manifests.sh --stdout  print the rendering instead
#
# helm: $GPUTOPO_HELM, else $GPUTOPO_BIN_DIR/helm, else the pinned build
# (gputopo/localcluster/build_binaries.sh --check), else helm on PATH.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RELEASE=gputopo
NAMESPACE=gputopo-system
KUBE_VERSION=1.34.4
OUT="$ROOT/manifests/gputopo.yaml"

find_helm() {
  if [[ -n "${GPUTOPO_HELM:-}" ]]; then echo "$GPUTOPO_HELM"; return; fi
  if [[ -n "${GPUTOPO_BIN_DIR:-}" && -x "$GPUTOPO_BIN_DIR/helm" ]]; then echo "$GPUTOPO_BIN_DIR/helm"; return; fi
  local check="$ROOT/gputopo/localcluster/build_binaries.sh" dir
  if [[ -f "$check" ]] && dir="$(bash "$check" --check 2>/dev/null)" && [[ -x "$dir/helm" ]]; then
    echo "$dir/helm"; return
  fi
  if command -v helm >/dev/null; then command -v helm; return; fi
  echo "render-manifests: no helm found (set GPUTOPO_HELM or build the pinned binaries)" >&2
  exit 1
}

render() {
  local helm
  helm="$(find_helm)"
  cat <<HEADER
# gputopo: plain manifests rendered from charts/gputopo with default values by
# scripts/render-manifests.sh (release "$RELEASE", namespace "$NAMESPACE"). Do not edit; re-render.
#
# The mutating webhook is off (it needs TLS material: install with Helm for it). To apply:
#   kubectl create namespace $NAMESPACE
#   kubectl apply -f manifests/gputopo.yaml
HEADER
  "$helm" template "$RELEASE" "$ROOT/charts/gputopo" \
    --namespace "$NAMESPACE" \
    --kube-version "$KUBE_VERSION" \
    --set cleanup.enabled=false \
    --skip-tests
}

if [[ "${1:-}" == "--stdout" ]]; then
  render
else
  mkdir -p "$(dirname "$OUT")"
  render > "$OUT.tmp"
  mv "$OUT.tmp" "$OUT"
  echo "wrote ${OUT#"$ROOT"/}" >&2
fi
