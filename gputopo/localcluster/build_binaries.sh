#!/usr/bin/env bash
# Builds the pinned upstream control-plane binaries (kube-apiserver, kube-scheduler,
# kube-controller-manager, kubectl, etcd, helm), the kubelet and `fakecri` (Kubernetes' own fake
# CRI runtime, k8s.io/cri-client/pkg/fake, served on a unix socket so that the kubelet runs without
# a container engine) from the Go module proxy into a cache outside the repository, keyed by version.
# A second run with the binaries present does nothing. Prints the bin directory on stdout;
# progress goes to stderr.
#
#   build_binaries.sh           build what is missing (once per machine and version), print the dir
#   build_binaries.sh --check   build nothing: print the dir and exit 0 if complete, else exit 3
#
# Environment: GPUTOPO_CACHE (cache root, default ${XDG_CACHE_HOME:-~/.cache}/gputopo),
# GPUTOPO_K8S_VERSION, GPUTOPO_ETCD_VERSION, GPUTOPO_HELM_VERSION (pins; each set is its own
# cache key: GPUTOPO_K8S_VERSION=1.37.2 builds next to the default 1.34.4, both stay usable),
# GPUTOPO_GOTOOLCHAIN (a Go toolchain for the Kubernetes build, e.g. go1.27.3; default: the local Go,
# or the oldest the release's go.mod accepts when the local one is older). Concurrent runs for the
# same key wait for each other (flock), never build twice.
set -euo pipefail

K8S_VERSION="${GPUTOPO_K8S_VERSION:-1.34.4}"
ETCD_VERSION="${GPUTOPO_ETCD_VERSION:-3.6.13}"
HELM_VERSION="${GPUTOPO_HELM_VERSION:-3.22.0}"
CACHE_ROOT="${GPUTOPO_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gputopo}"
KEY="k8s-v${K8S_VERSION}_etcd-v${ETCD_VERSION}_helm-v${HELM_VERSION}"
BIN="$CACHE_ROOT/$KEY/bin"
WORK="$CACHE_ROOT/$KEY/src"
K8S_CMDS=(kube-apiserver kube-scheduler kube-controller-manager kubectl kubelet)
NEEDED=("${K8S_CMDS[@]}" fakecri etcd helm)

log() { echo "[build-binaries] $*" >&2; }

have_all() { for b in "${NEEDED[@]}"; do [[ -x "$BIN/$b" ]] || return 1; done; }
# True when one of the binaries built from the Kubernetes wrapper module is missing.
k8s_missing() { for b in "${K8S_CMDS[@]}" fakecri; do [[ -x "$BIN/$b" ]] || return 0; done; return 1; }

if have_all; then echo "$BIN"; exit 0; fi
if [[ "${1:-}" == "--check" ]]; then echo "$BIN"; exit 3; fi
mkdir -p "$CACHE_ROOT/$KEY"
if command -v flock >/dev/null; then
  exec 9>"$CACHE_ROOT/$KEY/.build.lock"
  if ! flock -n 9; then
    log "another build of $KEY is running; waiting for it"
    flock 9
  fi
  if have_all; then echo "$BIN"; exit 0; fi
fi
command -v go >/dev/null || { log "Go toolchain not found on PATH; install Go >= 1.24"; exit 1; }
mkdir -p "$BIN" "$WORK"
export GOFLAGS="${GOFLAGS:-} -mod=mod"

minor="${K8S_VERSION#*.}"; minor="${minor%%.*}"; patch="${K8S_VERSION##*.}"
staging="v0.${minor}.${patch}"

if k8s_missing; then
  log "kubernetes v$K8S_VERSION: wrapper module (staging modules pinned to $staging)"
  d="$WORK/k8s"; mkdir -p "$d"; cd "$d"
  [[ -f go.mod ]] || go mod init gputopo.local/k8sbin >/dev/null 2>&1
  # The release's go.mod names the oldest Go that builds it (1.34: 1.24, 1.37: 1.26, 1.38: 1.27). An
  # older local Go answers with an error but still names the downloaded go.mod; then the matching
  # toolchain comes through the Go module proxy (GOTOOLCHAIN), for this build only.
  meta=$(go mod download -json "k8s.io/kubernetes@v$K8S_VERSION" || true)
  gomod=$(python3 -c 'import json,sys;print(json.loads(sys.argv[1]).get("GoMod",""))' "$meta")
  [[ -f "$gomod" ]] || { log "cannot download k8s.io/kubernetes@v$K8S_VERSION: $meta"; exit 1; }
  need_go=$(awk '$1 == "go" {print $2; exit}' "$gomod")
  have_go=$(go env GOVERSION); have_go="${have_go#go}"
  if [[ -n "${GPUTOPO_GOTOOLCHAIN:-}" ]]; then
    export GOTOOLCHAIN="$GPUTOPO_GOTOOLCHAIN"
  elif [[ "$(printf '%s\n%s\n' "$need_go" "$have_go" | sort -V | tail -1)" != "$have_go" ]]; then
    export GOTOOLCHAIN="go$need_go"
    log "kubernetes v$K8S_VERSION needs Go >= $need_go (have $have_go): using toolchain $GOTOOLCHAIN"
  fi
  # The release's own go.mod names every staging module it maps to ./staging; pin each to v0.X.Y.
  for m in $(grep -oE '^\s*k8s\.io/[a-z0-9-]+ => \./staging' "$gomod" | awk '{print $1}' | sort -u); do
    go mod edit -replace="$m=$m@$staging"
  done
  go mod edit -require="k8s.io/kubernetes@v$K8S_VERSION"
  cat > tools.go <<'GO'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
GO
  # fakecri: the fake CRI runtime kubelet's own tests use, on a unix socket. Its defaults make a
  # real kubelet fail; each setting below answers one of them.
  mkdir -p fakecri
  cat > fakecri/main.go <<'GO'
// Command fakecri serves k8s.io/cri-client/pkg/fake (runtime and image service) on a unix socket
// so that a real kubelet runs pods without a container engine: nothing is executed.
package main

import (
	"flag"
	"log"
	"os"
	"os/signal"
	"syscall"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"k8s.io/cri-client/pkg/fake"
)

func main() {
	endpoint := flag.String("endpoint", "", "CRI endpoint, unix:///path/to.sock")
	imagefs := flag.String("imagefs", "", "existing directory reported as the image filesystem")
	flag.Parse()
	if *endpoint == "" || *imagefs == "" {
		log.Fatal("-endpoint and -imagefs are required")
	}
	f := fake.NewFakeRemoteRuntime()
	if err := f.Start(*endpoint); err != nil {
		log.Fatalf("start: %v", err)
	}
	// The kubelet asks the runtime for its cgroup driver.
	f.RuntimeService.FakeLinuxConfiguration = &runtimeapi.LinuxRuntimeConfiguration{
		CgroupDriver: runtimeapi.CgroupDriver_CGROUPFS,
	}
	// The eviction manager and image GC stat the image filesystem's mountpoint.
	f.ImageService.FakeFilesystemUsage = []*runtimeapi.FilesystemUsage{{
		Timestamp: 1,
		FsId:      &runtimeapi.FilesystemIdentifier{Mountpoint: *imagefs},
		UsedBytes: &runtimeapi.UInt64Value{Value: 0}, InodesUsed: &runtimeapi.UInt64Value{Value: 0},
	}}
	// With size 0 the kubelet fails every pod: ImageInspectError "Id or size of image ... is not set".
	f.ImageService.FakeImageSize = 1024
	log.Printf("fake CRI serving on %s", *endpoint)
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGTERM, syscall.SIGINT)
	<-ch
	f.Stop()
}
GO
  log "go mod tidy (downloads modules once per machine)"
  go mod tidy >&2
  ld="-s -w -X k8s.io/component-base/version.gitVersion=v$K8S_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/client-go/pkg/version.gitVersion=v$K8S_VERSION -X k8s.io/client-go/pkg/version.gitMajor=1 -X k8s.io/client-go/pkg/version.gitMinor=$minor"
  for c in "${K8S_CMDS[@]}"; do
    if [[ ! -x "$BIN/$c" ]]; then
      log "building $c v$K8S_VERSION (several minutes on 2 cores)"
      go build -trimpath -ldflags "$ld" -o "$BIN/$c.tmp" "k8s.io/kubernetes/cmd/$c" >&2
      mv "$BIN/$c.tmp" "$BIN/$c"
    fi
  done
  if [[ ! -x "$BIN/fakecri" ]]; then
    log "building fakecri (k8s.io/cri-client/pkg/fake $staging)"
    go build -trimpath -ldflags "-s -w" -o "$BIN/fakecri.tmp" ./fakecri >&2
    mv "$BIN/fakecri.tmp" "$BIN/fakecri"
  fi
fi

if [[ ! -x "$BIN/etcd" ]]; then
  log "etcd v$ETCD_VERSION: wrapper module"
  d="$WORK/etcd"; mkdir -p "$d"; cd "$d"
  [[ -f go.mod ]] || go mod init gputopo.local/etcdbin >/dev/null 2>&1
  cat > main.go <<'GO'
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
GO
  go mod edit -require="go.etcd.io/etcd/server/v3@v$ETCD_VERSION"
  go mod tidy >&2
  log "building etcd"
  go build -trimpath -ldflags "-s -w" -o "$BIN/etcd.tmp" . >&2
  mv "$BIN/etcd.tmp" "$BIN/etcd"
fi

if [[ ! -x "$BIN/helm" ]]; then
  log "helm v$HELM_VERSION"
  d="$WORK/helm"; mkdir -p "$d"; cd "$d"
  [[ -f go.mod ]] || go mod init gputopo.local/helmbin >/dev/null 2>&1
  go mod edit -require="helm.sh/helm/v3@v$HELM_VERSION"
  cat > tools.go <<'GO'
//go:build tools

package tools

import _ "helm.sh/helm/v3/cmd/helm"
GO
  go mod tidy >&2
  log "building helm"
  go build -trimpath -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=v$HELM_VERSION" -o "$BIN/helm.tmp" helm.sh/helm/v3/cmd/helm >&2
  mv "$BIN/helm.tmp" "$BIN/helm"
fi

have_all || { log "some binaries are missing in $BIN"; exit 1; }
log "binaries ready in $BIN"
echo "$BIN"
