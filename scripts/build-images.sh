#!/usr/bin/env bash
# `make images`: builds the ElasWave images with podman from this checkout, on the base
# scripts/build-base-image.sh picks (the official Python image, else the local Debian one):
#   localhost/elaswave-core:VERSION        the Core, no torch
#   localhost/elaswave-core-store:VERSION  the Core with the CPU torch (hosts `run --core` stores)
#   localhost/elaswave-worker:VERSION      a worker node (launcher, agent, executor, examples)
#   localhost/elaswave-etcd:3.4            etcd from Debian's packages (no registry serves quay.io)
# torch: where pip's configured find-links hold the CPU wheel of the pinned release for Python
# 3.11 (or ELASWAVE_TORCH_WHEEL names one), it is mounted into the build (TORCH_WHEELS); else
# the images take torch from its CPU index, as a user's build does. Each step's time and each
# image's size are printed. Needs root (rootful podman).
set -euo pipefail
# shellcheck source=scripts/containers/env.sh
source "$(dirname "$0")/containers/env.sh"
cd "$REPO_ROOT"
lock_images
# The exact torch the tests run on: the pin of the constraints file (pyproject.toml only declares a range).
TORCH_VERSION=$(sed -n 's/^torch==\([^ #]*\).*$/\1/p' requirements/constraints.txt | head -n1)
[ -n "$TORCH_VERSION" ] || { echo "build-images: no torch==X pin in requirements/constraints.txt" >&2; exit 1; }

torch_wheel() {
  if [ -n "${ELASWAVE_TORCH_WHEEL:-}" ]; then
    [ -f "$ELASWAVE_TORCH_WHEEL" ] || { echo "ELASWAVE_TORCH_WHEEL=$ELASWAVE_TORCH_WHEEL: no such file" >&2; exit 1; }
    echo "$ELASWAVE_TORCH_WHEEL"
    return
  fi
  local dir
  for dir in $(python3 -m pip config list 2>/dev/null | sed -n "s/^[^=]*find-links='\(.*\)'$/\1/p" | tr ' ' '\n' | sort -u); do
    dir=${dir#file://}
    compgen -G "$dir/torch-$TORCH_VERSION+cpu-cp311-cp311-*linux*_x86_64.whl" | head -n1 && return
  done
  return 0
}


started=$SECONDS
base=$(bash scripts/build-base-image.sh)
echo "images: base $base ready after $((SECONDS - started)) s" >&2
wheel=$(torch_wheel)
# --format docker: HEALTHCHECK is not part of the OCI image format (podman drops it there).
common=(--network host --layers --format docker --build-arg "BASE_IMAGE=$base"
  -v "$CA_BUNDLE:/etc/ssl/certs/ca-certificates.crt:ro")
if [ -n "$wheel" ]; then
  echo "images: torch from $wheel (mounted at build time)" >&2
  common+=(-v "$wheel:/wheels/$(basename "$wheel"):ro" --build-arg TORCH_WHEELS=/wheels)
else
  echo "images: torch $TORCH_VERSION from its CPU index (no local CPU wheel found)" >&2
fi
build() {  # build TAG DOCKERFILE [ARGS...]: its log in build/images/, its time on stderr
  local tag=$1 file=$2 log="build/images/${1##*/}.log" step_started=$SECONDS
  shift 2
  if ! nice -n 10 podman build "${common[@]}" "$@" -f "$file" -t "$tag" . >"$log" 2>&1; then
    echo "images: building $tag failed; the end of $log:" >&2
    tail -n 40 "$log" >&2
    exit 1
  fi
  echo "images: $tag built in $((SECONDS - step_started)) s" >&2
}
mkdir -p build/images
build "localhost/elaswave-core:$ELASWAVE_VERSION" docker/core.Dockerfile --target core
build "localhost/elaswave-core-store:$ELASWAVE_VERSION" docker/core.Dockerfile --target core-store
build "localhost/elaswave-worker:$ELASWAVE_VERSION" docker/worker.Dockerfile --build-arg "PYTHON_IMAGE=$base"
build "localhost/elaswave-etcd:3.4" docker/etcd.Dockerfile
echo "images: all built in $((SECONDS - started)) s" >&2
podman images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '/elaswave-' >&2
