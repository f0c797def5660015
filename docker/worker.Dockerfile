# syntax=docker/dockerfile:1
# An ElasWave worker node: the launcher (`elaswave run`), the agent and the executor, with the
# examples. Build from the repository root:
#   docker build -f docker/worker.Dockerfile -t elaswave-worker:0.1.0 .             # CPU
# CUDA: a CUDA runtime base and torch's CUDA wheels (the base must have glibc >= 2.36, the
# Python copied in from PYTHON_IMAGE is built against Debian bookworm):
#   docker build -f docker/worker.Dockerfile \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t elaswave-worker:0.1.0-cu128 .
# Ascend: a CANN base and torch_npu (pip index and version matching the CANN release):
#   docker build -f docker/worker.Dockerfile \
#     --build-arg BASE_IMAGE=<your CANN 8 image, Ubuntu 24.04> \
#     --build-arg EXTRA_PACKAGES="torch_npu==2.13.0" -t elaswave-worker:0.1.0-npu .
# Without a registry: BASE_IMAGE and PYTHON_IMAGE both the local Debian base (its Python 3.11 is in
# /usr/bin: nothing here depends on where it lives) and TORCH_WHEELS a mounted directory of wheels
# (docker/install-torch.sh); `make images` does that (scripts/build-images.sh).
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
ARG BASE_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS python

FROM ${BASE_IMAGE} AS worker
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRA_PACKAGES=""
ARG TORCH_WHEELS=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# The interpreter comes from PYTHON_IMAGE whatever the base (a no-op on the default CPU base).
COPY --from=python /usr/local /usr/local
RUN ldconfig && python3.11 -m venv /opt/elaswave
COPY requirements/worker.txt /src/requirements/worker.txt
COPY docker/install-torch.sh /usr/local/lib/elaswave/install-torch.sh
# torch first, from the accelerator's index (or TORCH_WHEELS), pinned like the project
# (requirements/constraints.txt: torch==2.13.0); then everything else pinned and hash-checked from the lock file.
RUN /usr/local/lib/elaswave/install-torch.sh /opt/elaswave/bin/pip "${TORCH_VERSION}" "${TORCH_INDEX_URL}" "${TORCH_WHEELS}" \
 && /opt/elaswave/bin/pip install --require-hashes --no-deps -r /src/requirements/worker.txt \
 && if [ -n "${EXTRA_PACKAGES}" ]; then /opt/elaswave/bin/pip install ${EXTRA_PACKAGES}; fi
COPY pyproject.toml README.md /src/
COPY elaswave /src/elaswave
COPY wire /src/wire
COPY core_service /src/core_service
COPY planners /src/planners
COPY agent /src/agent
COPY executor /src/executor
COPY harness /src/harness
COPY simulator /src/simulator
COPY examples /opt/elaswave-examples/examples
RUN /opt/elaswave/bin/pip install --no-deps /src \
 && rm -rf /src \
 && useradd --system --uid 10001 --home-dir /var/lib/elaswave --create-home elaswave \
 && install -d -o 10001 -g 10001 /var/lib/elaswave/checkpoints /var/lib/elaswave/run
COPY docker/healthcheck.py docker/preemptible.py /usr/local/lib/elaswave/
COPY docker/find-leader.py /usr/local/bin/elaswave-find-leader
ENV PATH=/opt/elaswave/bin:$PATH PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /var/lib/elaswave
# Healthy while the launcher runs its agents (the agents report liveness to the Core themselves).
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
  CMD ["/opt/elaswave/bin/python", "/usr/local/lib/elaswave/healthcheck.py", "worker"]
# SIGTERM (docker stop, a Kubernetes eviction) preempts this node's agents, not the whole job.
ENTRYPOINT ["/opt/elaswave/bin/python", "/usr/local/lib/elaswave/preemptible.py", "elaswave"]
CMD ["run", "--help"]
