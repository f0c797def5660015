#!/usr/bin/env bash
# Prints the base image `make images` builds on: the official Python image where a registry
# serves it, else a local Debian bookworm base made from Debian's packages with mmdebstrap
# (minbase + python3, pip, venv, CA certificates; Python 3.11 in /usr/bin), imported into podman.
# The local base is cached as a tarball in $ELASWAVE_IMAGE_CACHE, keyed by its inputs (package
# list, apt sources, this script): later runs on the same machine import it in seconds.
# Needs root (mmdebstrap --mode=root, rootful podman). Progress goes to stderr.
set -euo pipefail
# shellcheck source=scripts/containers/env.sh
source "$(dirname "$0")/containers/env.sh"
OFFICIAL="${ELASWAVE_OFFICIAL_BASE:-docker.io/library/python:3.11.14-slim-bookworm}"
PACKAGES="python3,python3-pip,python3-venv,ca-certificates"
SUITE=bookworm

if podman image exists "$OFFICIAL" || timeout 120 podman pull -q "$OFFICIAL" >/dev/null 2>&1; then
  echo "base: $OFFICIAL (from a registry)" >&2
  echo "$OFFICIAL"
  exit 0
fi

# The machine's own apt sources (deb822 or one-line), so the base comes from the same mirror.
sources=()
for f in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list; do
  [ -s "$f" ] && grep -q '^[^#]' "$f" && sources+=("$f")
done
key=$(
  {
    echo "$SUITE $PACKAGES"
    cat "${sources[@]}" 2>/dev/null
    cat "$0"
  } | sha256sum | cut -c1-16
)
if [ "$(podman image inspect --format '{{index .Labels "org.elaswave.base-key"}}' "$ELASWAVE_BASE_IMAGE" 2>/dev/null)" = "$key" ]; then
  echo "base: $ELASWAVE_BASE_IMAGE (present, key $key)" >&2
  echo "$ELASWAVE_BASE_IMAGE"
  exit 0
fi
mkdir -p "$ELASWAVE_IMAGE_CACHE"
tarball="$ELASWAVE_IMAGE_CACHE/base-$SUITE-$key.tar"
if [ ! -s "$tarball" ]; then
  echo "base: no registry; building $tarball with mmdebstrap (Debian $SUITE)" >&2
  started=$SECONDS
  rm -f "$ELASWAVE_IMAGE_CACHE"/base-"$SUITE"-*.tar  # older keys: one cached base at a time
  # No manuals, translations or docs (copyrights kept), as Debian's slim images: about 45 MiB less.
  # The rules stay in the base's dpkg configuration, so packages installed on it skip them too.
  nice -n 10 mmdebstrap --quiet --variant=minbase --mode=root --format=tar --include="$PACKAGES" \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/locale/locale.alias' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    "$SUITE" "$tarball.partial" "${sources[@]}" >&2
  mv "$tarball.partial" "$tarball"
  echo "base: mmdebstrap took $((SECONDS - started)) s, $(du -m "$tarball" | cut -f1) MiB" >&2
fi
# Debian's Python is externally managed: the images install into their own venv, but a bare
# `pip install` in a derived image should work as it does on the official base.
podman import --quiet \
  --change 'ENV PIP_BREAK_SYSTEM_PACKAGES=1' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' \
  --change "LABEL org.elaswave.base-key=$key" \
  "$tarball" "$ELASWAVE_BASE_IMAGE" >/dev/null
echo "base: imported $ELASWAVE_BASE_IMAGE (key $key)" >&2
echo "$ELASWAVE_BASE_IMAGE"
