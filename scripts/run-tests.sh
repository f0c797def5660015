#!/usr/bin/env bash
# Runs the whole suite; pytest's "no tests collected" (exit 5) counts as a failure.
set -uo pipefail
.venv/bin/pytest -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
