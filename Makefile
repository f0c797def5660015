# ElasWave — one entry point for a fresh machine. `make demo` and `make test` install what they need.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROTOS := $(wildcard proto/wire/v1/*.proto)

.PHONY: install system-deps container-deps images compose-test demo test test-fast proto proto-check lint bench chaos soak soak-short gpu-check gpu-wheels clean

CONSTRAINTS := requirements/constraints.txt

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, at the CPU build the constraints pin, so nothing pulls a CUDA build; the
	# project then installs under the same constraints (pyproject only declares a torch range).
	$(BIN)/pip install -q -c $(CONSTRAINTS) torch
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# Debian packages the tests need (a real etcd server). Needs root, as on CI.
system-deps:
	bash scripts/install-system-deps.sh

# podman and mmdebstrap from Debian's packages (`make images`, `make compose-test`). Needs root.
container-deps:
	bash scripts/install-container-deps.sh

# The Core, Core-with-torch, worker and etcd images, built with podman on the official Python base
# where a registry serves it, else on a Debian base made locally (cached in /var/cache/elaswave-images).
images: install container-deps
	bash scripts/build-images.sh

# Builds the images, runs deploy/compose with them (a job through a preemption, a lost node and a
# Core failover, checked against the one-process run), then removes every container and image.
compose-test: install container-deps
	bash scripts/compose-test.sh

demo: install
	$(BIN)/elaswave demo

test: install system-deps proto-check
	bash scripts/run-tests.sh

test-fast: install
	$(BIN)/pytest -q -x -m "not etcd and not multiproc"

proto: install
	$(BIN)/python -m grpc_tools.protoc -I proto --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)

proto-check: install
	bash scripts/check-proto.sh

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: install system-deps
	$(BIN)/python -m bench.run_all

# The long chaos run (not in CI): seeded random kills until 100 ranks died, every run checked.
chaos: install system-deps
	$(BIN)/python -m bench.chaos_long --kills 100

# The soak (bench/soak.py): a 2-node `elaswave run --core` job on etcd with two Cores under random
# faults (worker, node, store, leading Core, preemption, join) until it finishes, checked against
# the fault-free run. CI runs the 3-minute version with a fixed seed after `make test`.
SOAK_MINUTES ?= 30
soak: install system-deps
	$(BIN)/python -m bench.soak --minutes $(SOAK_MINUTES) --seed $${SOAK_SEED:-0}

soak-short: install system-deps
	$(BIN)/python -m bench.soak --minutes 3 --seed 7

# On a GPU machine (not in CI): checks (a)-(e) of docs/accelerators.md, bounded to 8 minutes, one
# line per check and PASS/FAIL last. Runs with the python (PY=...) whose torch is installed there,
# not the CPU venv; without a CUDA device it says so and exits 2.
gpu-check:
	$(PY) scripts/gpu_check.py --budget-s 480

# Here, with network: wheels of the pinned dependencies (torch left out) for a GPU machine with
# its own torch and no package index; SKIP='numpy|scipy' leaves out what it has (docs/accelerators.md).
gpu-wheels:
	PY=$(PY) SKIP='$(SKIP)' PYTHON_VERSION='$(PYTHON_VERSION)' bash scripts/gpu-wheels.sh .whl

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
