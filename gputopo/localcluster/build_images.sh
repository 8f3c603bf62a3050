#!/usr/bin/env bash
# Builds, without any registry, the container images a local containerd node runs
# (gputopo.localcluster.containerd), as OCI archives for `ctr images import`:
#
#   localhost/python:3.11-slim      a Debian bookworm base (mmdebstrap, the machine's own apt sources)
#                                   standing in for python:3.11-slim; not an archive of its own
#   localhost/gputopo:<appVersion>  the repository's Dockerfile as it is, built by buildah with
#                                   --build-arg PYTHON_IMAGE=localhost/python:3.11-slim
#   localhost/kube-scheduler:v<X>   the base + the kube-scheduler binary of each bin dir given
#   localhost/pause:3.10            a static pod-sandbox pause process (C source below)
#   localhost/curl:bookworm         the base + curl: the chart's `helm test` image (tests.image)
#
# Each archive is cached under $GPUTOPO_CACHE/images (default ~/.cache/gputopo/images), named by a
# hash of its inputs, and rebuilt only when they change (the gputopo image: the Dockerfile and every
# file its COPY lines take). Prints the path of a manifest (JSON: ref, archive, bytes per image) on
# stdout; sizes and the build time go to stderr.
#
#   build_images.sh [BIN_DIR...]          build what is missing; one kube-scheduler image per BIN_DIR
#   build_images.sh --check [BIN_DIR...]  build nothing: print the manifest path, exit 0 if complete, else 3
#
# Needs root (mmdebstrap, buildah with chroot isolation) and the Debian packages mmdebstrap, buildah,
# gcc and libc6-dev; as root it installs them when missing, with the runtime packages the
# containerd node needs (containerd, runc, containernetworking-plugins, iproute2). Concurrent runs
# wait for each other (flock).
set -euo pipefail

SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CACHE="${GPUTOPO_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gputopo}/images"
SUITE=bookworm
BASE_PACKAGES=python3,python3-venv,python3-pip,python-is-python3,passwd,ca-certificates,netbase
# Bump when the base recipe below changes in a way the package list does not show.
BASE_REV=1
BASE_REF=localhost/python:3.11-slim
PAUSE_REF=localhost/pause:3.10
CURL_REF=localhost/curl:bookworm
APP_VERSION=$(awk -F'"' '/^appVersion:/ {print $2}' "$SRC/charts/gputopo/Chart.yaml")
GPUTOPO_REF="localhost/gputopo:${APP_VERSION:?no appVersion in charts/gputopo/Chart.yaml}"

CHECK=0
if [[ "${1:-}" == "--check" ]]; then CHECK=1; shift; fi
BIN_DIRS=("$@")

log() { echo "[build-images] $*" >&2; }

# The pod sandbox's pause process: PID 1 of each pod, reaps zombies, exits on SIGINT/SIGTERM, as
# Kubernetes' build/pause does.
pause_source() {
  cat <<'C'
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_term(int sig) {
  (void)sig;
  _exit(0);
}

static void on_child(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "-v") == 0) {
    puts("pause (gputopo build_images.sh)");
    return 0;
  }
  struct sigaction term = {.sa_handler = on_term};
  struct sigaction child = {.sa_handler = on_child, .sa_flags = SA_NOCLDSTOP | SA_RESTART};
  if (sigaction(SIGINT, &term, NULL) || sigaction(SIGTERM, &term, NULL) || sigaction(SIGCHLD, &child, NULL)) {
    perror("sigaction");
    return 1;
  }
  for (;;) pause();
}
C
}
sha() { sha256sum | cut -c1-16; }

# What the Dockerfile's COPY lines take (and .dockerignore leaves out), as a sorted list of files.
context_files() {
  (cd "$SRC" && find Dockerfile .dockerignore pyproject.toml README.md gputopo \
    \( -name __pycache__ -o -name '*.egg-info' -o -path gputopo/localcluster \) -prune -o -type f ! -name '*.pyc' -print | LC_ALL=C sort)
}

base_key=$(printf '%s\n' "$SUITE" "$BASE_PACKAGES" "$BASE_REV" | sha)
gputopo_key=$( (echo "$base_key"; cd "$SRC" && context_files | xargs -d '\n' sha256sum) | sha)
pause_key=$( (echo "$BASE_REV"; pause_source) | sha)
curl_key=$( (echo "$base_key"; echo curl) | sha)

# name|ref|archive|key|builder ; the kube-scheduler entries follow, one per bin dir.
IMAGES=(
  "gputopo|$GPUTOPO_REF|$CACHE/gputopo-$gputopo_key.oci.tar|$gputopo_key|build_gputopo"
  "pause|$PAUSE_REF|$CACHE/pause-$pause_key.oci.tar|$pause_key|build_pause"
  "curl|$CURL_REF|$CACHE/curl-$curl_key.oci.tar|$curl_key|build_curl"
)
for d in "${BIN_DIRS[@]}"; do
  exe="$d/kube-scheduler"
  [[ -x "$exe" ]] || { log "$exe is missing (build it with gputopo/localcluster/build_binaries.sh)"; exit 1; }
  ver=$("$exe" --version | grep -oE 'v[0-9]+\.[0-9]+\.[0-9]+' | head -1)
  [[ -n "$ver" ]] || { log "$exe --version printed no version"; exit 1; }
  k=$( (echo "$base_key"; sha256sum < "$exe") | sha)
  IMAGES+=("kube-scheduler|localhost/kube-scheduler:$ver|$CACHE/kube-scheduler-$ver-$k.oci.tar|$k|build_scheduler $exe")
done

all_key=$(printf '%s\n' "${IMAGES[@]}" | sha)
MANIFEST="$CACHE/manifest-$all_key.json"

complete() {
  local e a
  for e in "${IMAGES[@]}"; do IFS='|' read -r _ _ a _ _ <<< "$e"; [[ -f "$a" ]] || return 1; done
}

# The manifest: what to import, and the figures the issue asks for. Cheap, so written whenever the
# archives are all there (any subset of kube-scheduler versions gets a manifest of its own).
write_manifest() {
  local e name ref archive sep=""
  {
    echo '{"images": ['
    for e in "${IMAGES[@]}"; do
      IFS='|' read -r name ref archive _ _ <<< "$e"
      printf '%s  {"name": "%s", "ref": "%s", "archive": "%s", "bytes": %d}' \
        "$sep" "$name" "$ref" "$archive" "$(stat -c %s "$archive")"
      sep=$',\n'
    done
    printf '\n]}\n'
  } > "$MANIFEST.$$"
  mv "$MANIFEST.$$" "$MANIFEST"
  for e in "${IMAGES[@]}"; do
    IFS='|' read -r _ ref archive _ _ <<< "$e"
    log "$(awk -v r="$ref" -v b="$(stat -c %s "$archive")" -v a="$archive" \
      'BEGIN {printf "%-34s %7.1f MB compressed  %s", r, b / 1e6, a}')"
  done
}

if complete; then write_manifest; echo "$MANIFEST"; exit 0; fi
if ((CHECK)); then echo "$MANIFEST"; exit 3; fi
[[ $(id -u) -eq 0 ]] || { log "building the images needs root (mmdebstrap and buildah's chroot isolation)"; exit 1; }
mkdir -p "$CACHE"
exec 9>"$CACHE/.build.lock"
if ! flock -n 9; then log "another image build is running; waiting for it"; flock 9; fi
if complete; then write_manifest; echo "$MANIFEST"; exit 0; fi

t0=$(date +%s)
step() { log "[$(( $(date +%s) - t0 ))s] $*"; }

# What this build needs, and what the containerd node that runs the images needs
# (gputopo.localcluster.containerd.RUNTIME_PACKAGES): installed together, once per machine.
PACKAGES=(mmdebstrap buildah gcc libc6-dev containerd runc containernetworking-plugins iproute2)
need=()
for tool in mmdebstrap buildah gcc containerd runc ip /usr/lib/cni/bridge; do
  command -v "$tool" >/dev/null || [[ -x "$tool" ]] || need+=("$tool")
done
if ((${#need[@]})); then
  step "apt-get install ${PACKAGES[*]} (missing: ${need[*]})"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
fi

WORK=$(mktemp -d "$CACHE/work-XXXXXX")
B=(buildah --root "$WORK/storage" --runroot "$WORK/runroot" --storage-driver vfs)
cleanup() {
  # buildah's vfs storage holds full copies of every layer; nothing in it is kept.
  "${B[@]}" rm --all >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT

# Where TLS to the package index goes through a local CA, only the host's bundle verifies it; a
# build-time volume is not committed into the image.
CA_VOLUME=()
[[ -f /etc/ssl/certs/ca-certificates.crt ]] &&
  CA_VOLUME=(-v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)
# The machine's own apt sources (deb822 first, then the one-line file); never written into an image.
SOURCES=$(ls /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1 || true)
[[ -n "$SOURCES" ]] || SOURCES=/etc/apt/sources.list

base_loaded=0
load_base() {
  ((base_loaded)) && return 0
  local tar="$CACHE/base-$base_key.rootfs.tar"
  if [[ ! -f "$tar" ]]; then
    step "base root filesystem: mmdebstrap $SUITE minbase + $BASE_PACKAGES"
    mmdebstrap --quiet --variant=minbase --include="$BASE_PACKAGES" \
      --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
      --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
      --customize-hook='rm -f "$1"/etc/apt/sources.list "$1"/etc/apt/sources.list.d/*; rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
      --format=tar "$SUITE" "${tar%.tar}.tmp.tar" "$SOURCES"
    rm -rf "$tar"  # whatever an interrupted run left there
    mv -T "${tar%.tar}.tmp.tar" "$tar"
  fi
  step "import the base as $BASE_REF"
  local c
  c=$("${B[@]}" from scratch)
  "${B[@]}" add "$c" "$tar" / >/dev/null
  "${B[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd '["python3"]' "$c"
  "${B[@]}" commit -q --rm "$c" "$BASE_REF" >/dev/null
  base_loaded=1
}

# $1 ref, $2 archive: write the OCI archive (gzip layers) next to its final name, then move it there.
export_archive() {
  "${B[@]}" push -q "$1" "oci-archive:$2.tmp:$1"
  mv "$2.tmp" "$2"
}

build_gputopo() {
  local ref=$1 archive=$2
  load_base
  # The build context is a copy of the files the Dockerfile takes, so nothing is written into the
  # checkout and nothing else in it (other engineers' scratch files) can reach the image.
  local ctx="$WORK/context"
  mkdir -p "$ctx"
  (cd "$SRC" && context_files | tar -cf - -T -) | tar -C "$ctx" -xf -
  step "buildah bud Dockerfile -> $ref (PYTHON_IMAGE=$BASE_REF)"
  "${B[@]}" bud --quiet --isolation chroot --pull-never --layers=false "${CA_VOLUME[@]}" \
    --build-arg PYTHON_IMAGE="$BASE_REF" -t "$ref" -f "$ctx/Dockerfile" "$ctx" >/dev/null
  # The chart runs it as 65532 (the scheduler pod) with a read-only root filesystem: check both
  # entry points that way before anything uses the image.
  local c
  c=$("${B[@]}" from --pull-never "$ref")
  for cmd in gputopo-extender gputopo-agent; do
    "${B[@]}" run --isolation chroot --user 65532:65532 "$c" "$cmd" --help >/dev/null
  done
  "${B[@]}" rm "$c" >/dev/null
  export_archive "$ref" "$archive"
}

build_scheduler() {
  local ref=$1 archive=$2 exe=$3
  load_base
  step "$ref from $exe"
  local c
  c=$("${B[@]}" from --pull-never "$BASE_REF")
  "${B[@]}" copy --chmod 0755 "$c" "$exe" /usr/local/bin/kube-scheduler >/dev/null
  "${B[@]}" config --user 65532:65532 --cmd '["kube-scheduler"]' "$c"
  "${B[@]}" run --isolation chroot "$c" kube-scheduler --version >/dev/null
  "${B[@]}" commit -q --rm "$c" "$ref" >/dev/null
  export_archive "$ref" "$archive"
}

build_curl() {
  local ref=$1 archive=$2
  load_base
  step "$ref: the base + curl (apt, with the machine's sources mounted for this step only)"
  local c
  c=$("${B[@]}" from --pull-never "$BASE_REF")
  "${B[@]}" run --isolation chroot "${CA_VOLUME[@]}" -v "$SOURCES:/etc/apt/sources.list.d/host.sources:ro" "$c" \
    sh -ec 'apt-get -qq -o APT::Sandbox::User=root update
            DEBIAN_FRONTEND=noninteractive apt-get -qq -o APT::Sandbox::User=root install -y --no-install-recommends curl >/dev/null 2>&1
            rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log'
  # The mount point buildah created for the sources file stays empty; remove it.
  "${B[@]}" run --isolation chroot "$c" rm -f /etc/apt/sources.list.d/host.sources 2>/dev/null || true
  "${B[@]}" config --user 65532:65532 --cmd '["curl", "--version"]' "$c"
  "${B[@]}" commit -q --rm "$c" "$ref" >/dev/null
  export_archive "$ref" "$archive"
}

build_pause() {
  local ref=$1 archive=$2
  step "$ref: static pause process"
  pause_source > "$WORK/pause.c"
  gcc -Os -static -o "$WORK/pause" "$WORK/pause.c"
  strip "$WORK/pause"
  local c
  c=$("${B[@]}" from scratch)
  "${B[@]}" copy --chmod 0755 "$c" "$WORK/pause" /pause >/dev/null
  "${B[@]}" config --entrypoint '["/pause"]' --cmd '[]' --user 65535:65535 "$c"
  "${B[@]}" commit -q --rm "$c" "$ref" >/dev/null
  export_archive "$ref" "$archive"
}

for e in "${IMAGES[@]}"; do
  IFS='|' read -r name ref archive key builder <<< "$e"
  [[ -f "$archive" ]] && continue
  read -r -a fn <<< "$builder"
  s=$(date +%s)
  "${fn[0]}" "$ref" "$archive" "${fn[@]:1}"
  step "$name built in $(( $(date +%s) - s ))s"
  # Earlier builds of the same image (older inputs) go: the cache holds one of each.
  prefix=${archive%-"$key".oci.tar}
  for old in "$prefix"-*.oci.tar; do
    [[ "$old" == "$archive" || ! -f "$old" ]] && continue
    # kube-scheduler-v1.34.4-<key> must not take kube-scheduler-v1.34.40-<key> with it.
    [[ "${old#"$prefix"-}" == */* || "${old#"$prefix"-}" == *-* ]] && continue
    rm -f "$old"
  done
done

write_manifest
step "images ready ($MANIFEST)"
echo "$MANIFEST"
exit 0
