#!/bin/sh
# Installs torch into the image's virtual environment, from one of two places:
# - TORCH_WHEELS set: a directory of wheels mounted into the build (`podman build -v DIR:/wheels:ro
#   --build-arg TORCH_WHEELS=/wheels`, as scripts/build-images.sh does where a CPU wheel lies on the
#   machine's disk and the accelerator's index is not reachable). torch itself comes from there
#   only (--no-index: never a CUDA build from PyPI); its own dependencies from the package index.
# - otherwise: the accelerator's index (TORCH_INDEX_URL, the CPU one by default), as users build.
# usage: install-torch.sh PIP TORCH_VERSION TORCH_INDEX_URL [TORCH_WHEELS]
set -eu
pip=$1 version=$2 index_url=$3 wheels=${4:-}
if [ -n "$wheels" ]; then
  "$pip" install --no-index --no-deps --find-links "$wheels" "torch==$version"
  "$pip" install "torch==$version"  # satisfied already: resolves its dependencies only
else
  "$pip" install "torch==$version" --index-url "$index_url"
fi
