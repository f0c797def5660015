#!/usr/bin/env bash
# Installs what `make images` and `make compose-test` need, when missing: podman (rootful, runc)
# and mmdebstrap (the local Debian base) from Debian's packages; podman-compose comes with the
# venv's dev extra (pyproject.toml).
set -euo pipefail
need=()
for pkg in podman buildah runc uidmap fuse-overlayfs slirp4netns containernetworking-plugins catatonit \
  mmdebstrap; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need+=("$pkg")
done
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
if [ ${#need[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
