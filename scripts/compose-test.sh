#!/usr/bin/env bash
# `make compose-test` (CI, after `make test`): builds the images (scripts/build-images.sh), runs the
# compose deployment with them (tests/deploy/compose_scenario.py: a job trained through a preempted
# and a lost worker node, then a Core failover and a hung Core), and removes every container,
# volume and image it made, whatever happens (the local base stays cached as a tarball in
# $ELASWAVE_IMAGE_CACHE). Every service listens on 127.0.0.1 only. Needs root (rootful podman).
set -euo pipefail
# shellcheck source=scripts/containers/env.sh
source "$(dirname "$0")/containers/env.sh"
cd "$REPO_ROOT"
lock_images
export ELASWAVE_COMPOSE_PROJECT="elaswave-ci-$$"
# Every container's log is kept here (compose-logs/), pass or fail.
export ELASWAVE_ARTIFACT_DIR="${ELASWAVE_ARTIFACT_DIR:-$REPO_ROOT/build/compose-test}"
mkdir -p "$ELASWAVE_ARTIFACT_DIR"  # a fresh checkout has no build/

cleanup() {
  local status=$? ids
  set +e
  # shellcheck disable=SC2086 # $ids: one word per container or volume
  ids=$(podman ps --all --quiet --filter "label=com.docker.compose.project=$ELASWAVE_COMPOSE_PROJECT")
  [ -n "$ids" ] && podman rm --force --volumes --time 0 $ids >/dev/null
  ids=$(podman volume ls --quiet --filter "label=com.docker.compose.project=$ELASWAVE_COMPOSE_PROJECT")
  [ -n "$ids" ] && podman volume rm --force $ids >/dev/null
  for image in "${ELASWAVE_IMAGES[@]}" "$ELASWAVE_BASE_IMAGE"; do
    podman image exists "$image" && podman rmi --force "$image" >/dev/null
  done
  podman image prune --force >/dev/null  # the builds' untagged intermediate layers
  echo "compose-test: removed the project's containers, volumes and images" >&2
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

started=$SECONDS
bash scripts/build-images.sh
built=$SECONDS
status=0
.venv/bin/pytest -q -p no:cacheprovider --timeout 1500 -s --basetemp "$ELASWAVE_ARTIFACT_DIR/tmp" \
  tests/deploy/compose_scenario.py || status=$?
echo "compose-test: images built in $((built - started)) s, the compose scenario took $((SECONDS - built)) s;" \
  "containers' logs in $ELASWAVE_ARTIFACT_DIR/compose-logs" >&2
exit "$status"
