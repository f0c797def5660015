#!/usr/bin/env bash
# Runs the whole suite; pytest's "no tests collected" (exit 5) counts as a failure.
#
# With no arguments (`make test`, CI): every test not marked `serial` runs first on
# $ELASWAVE_TEST_WORKERS pytest workers (default 2, one per core of the CI machine: the
# multi-process tests wait on their processes much of the time; 3 workers on 2 loaded cores pushed
# the slowest end-to-end tests past their timeouts), then the `serial` tests run alone (they load the
# machine on purpose or assert a detection time). Each test's ports come from the kernel (port 0)
# and its files from tmp_path, so tests on different workers cannot collide; every worker starts
# its own etcd. With arguments, pytest runs them in this process, e.g. one file while you work.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTEST=.venv/bin/pytest

fail_if_empty() {
  if [ "$1" -eq 5 ]; then
    echo "pytest collected no tests ($2): failing" >&2
    return 1
  fi
  return "$1"
}

if [ "$#" -gt 0 ]; then
  "$PYTEST" -q "$@"
  fail_if_empty $? "$*"
  exit $?
fi

start=$(date +%s)
# Every test starts dozens of Python processes (Cores, agents, stores, workers). Where the
# environment sets PYTHONDONTWRITEBYTECODE (this machine kind does), none of them caches its compiled
# modules, and each compiles the project's sources again at start: compile them once here.
PYTHONDONTWRITEBYTECODE= .venv/bin/python -m compileall -q -j 0 \
  elaswave wire harness core_service agent executor planners simulator bench examples tests >/dev/null
# The slowest tests are listed at the end: the suite must stay under ~12 min on 2 cores.
"$PYTEST" -q -n "${ELASWAVE_TEST_WORKERS:-2}" --dist worksteal -m "not serial" --durations=60
fail_if_empty $? "parallel part"
parallel_rc=$?
"$PYTEST" -q -m serial --durations=10
fail_if_empty $? "serial part"
serial_rc=$?
echo "suite: $(($(date +%s) - start)) s wall (parallel part rc=$parallel_rc, serial part rc=$serial_rc)"
[ "$parallel_rc" -eq 0 ] && [ "$serial_rc" -eq 0 ]
