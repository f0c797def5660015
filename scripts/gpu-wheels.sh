#!/usr/bin/env bash
# Wheels of the project's pinned runtime dependencies (requirements/worker.txt), torch and
# CUDA's own packages left out, for a GPU machine that has its own torch and no package index:
#
#   scripts/gpu-wheels.sh [DIR]                 # here, with network; DIR defaults to .whl
#   python3 -m pip install --no-index --no-deps --target /tmp/site DIR/*.whl   # there
#   PYTHONPATH=/tmp/site make gpu-check PY=python3
#
# PYTHON_VERSION (default 3.12) is the GPU machine's Python. SKIP names packages that machine
# already has, as an extended regex (say SKIP='numpy|scipy|matplotlib|pillow'): each wheel kept
# out keeps two versions of one package from meeting there. The wheels are manylinux x86_64.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.whl}
python_version=${PYTHON_VERSION:-3.12}
skip=${SKIP:-}
exclude='^(torch|triton|nvidia-[a-z0-9-]+|cuda-[a-z0-9-]+)=='
[ -n "$skip" ] && exclude="${exclude}|^(${skip})=="
pins=$(grep -E '^[A-Za-z0-9_.-]+==' requirements/worker.txt | sed 's/ .*//' | grep -v -i -E "$exclude" || true)
if [ -z "$pins" ]; then
  echo "gpu-wheels: nothing left to fetch after SKIP='$skip'" >&2
  exit 1
fi
mkdir -p "$out"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
PY=${PY:-.venv/bin/python}
# shellcheck disable=SC2086 # one pin per word
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$python_version" \
  --implementation cp "${platforms[@]}" -d "$out" $pins
echo "gpu-wheels: $(echo "$pins" | wc -l) packages in $out ($(du -sh "$out" | cut -f1))"
