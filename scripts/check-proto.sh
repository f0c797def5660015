#!/usr/bin/env bash
# Regenerates the gRPC stubs into a scratch dir and fails when the committed ones differ.
set -euo pipefail
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
.venv/bin/python -m grpc_tools.protoc -I proto --python_out="$tmp" --pyi_out="$tmp" --grpc_python_out="$tmp" proto/wire/v1/*.proto
if ! diff -ru "$tmp/wire/v1" wire/v1 -x __init__.py -x __pycache__ >/dev/null; then
  echo "generated stubs in wire/v1 are stale: run 'make proto' and commit" >&2
  diff -ru "$tmp/wire/v1" wire/v1 -x __init__.py -x __pycache__ | head -n 40 >&2
  exit 1
fi
echo "proto stubs up to date"
