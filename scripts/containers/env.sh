# Sourced by the container scripts: podman's settings and the names they share.
# shellcheck shell=bash
CONTAINERS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$CONTAINERS_DIR/../.." && pwd)"
export CONTAINERS_CONF="$CONTAINERS_DIR/containers.conf"
# The images' tag: the project's version.
ELASWAVE_VERSION="$(sed -n 's/^version = "\(.*\)"/\1/p' "$REPO_ROOT/pyproject.toml" | head -n1)"
export ELASWAVE_VERSION
# The local Debian base (scripts/build-base-image.sh) and its cache, kept between runs.
export ELASWAVE_BASE_IMAGE="${ELASWAVE_BASE_IMAGE:-localhost/elaswave-base:bookworm}"
export ELASWAVE_IMAGE_CACHE="${ELASWAVE_IMAGE_CACHE:-/var/cache/elaswave-images}"
# Every image `make images` builds (removed again by `make compose-test`).
ELASWAVE_IMAGES=(
  "localhost/elaswave-core:$ELASWAVE_VERSION"
  "localhost/elaswave-core-store:$ELASWAVE_VERSION"
  "localhost/elaswave-worker:$ELASWAVE_VERSION"
  "localhost/elaswave-etcd:3.4"
)
# pip inside a build reaches the package index only with the host's CA bundle (an intercepting
# proxy's CA may be in it); mounted read-only, never copied into an image.
CA_BUNDLE="${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"

# One image build or compose test at a time on a machine: they share podman's storage, and one
# run's cleanup (image removal, pruning) must not pull layers from under another's build.
lock_images() {
  if [ -z "${ELASWAVE_IMAGES_LOCK_HELD:-}" ]; then
    mkdir -p "$ELASWAVE_IMAGE_CACHE"
    exec 9>"$ELASWAVE_IMAGE_CACHE/.lock"
    flock -n 9 || echo "waiting for the image lock ($ELASWAVE_IMAGE_CACHE/.lock) ..." >&2
    flock 9
    export ELASWAVE_IMAGES_LOCK_HELD=1  # children (build-images.sh) inherit the held lock
  fi
}
