# syntax=docker/dockerfile:1
# The ElasWave Core: control plane only. Build from the repository root:
#   docker build -f docker/core.Dockerfile -t elaswave-core:0.1.0 .
# Target `core` (the default, last stage) carries no torch: the Core and its planners need numpy
# and scipy only. Target `core-store` adds the CPU torch wheel, for a Core that hosts the
# rendezvous store of jobs formed by `elaswave run --core` (core_service/job_store.py starts one
# `executor.store_server` child per job, and that child imports torch):
#   docker build -f docker/core.Dockerfile --target core-store -t elaswave-core-store:0.1.0 .
# BASE_IMAGE: any Debian-like image with Python 3.11 and its venv module, wherever the interpreter
# lives (`python3` on the PATH): the official image by default; CI builds a local Debian one
# (scripts/build-base-image.sh) and, with no route to the torch index, passes TORCH_WHEELS (a
# directory of wheels mounted into the build, docker/install-torch.sh).
ARG BASE_IMAGE=python:3.11.14-slim-bookworm

FROM ${BASE_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY requirements/core.txt /src/requirements/core.txt
# Every dependency pinned and hash-checked from the checked-in lock file (uv pip compile).
RUN python3 -m venv /opt/elaswave \
 && /opt/elaswave/bin/pip install --require-hashes --no-deps -r requirements/core.txt
COPY pyproject.toml README.md /src/
COPY elaswave /src/elaswave
COPY wire /src/wire
COPY core_service /src/core_service
COPY planners /src/planners
COPY agent /src/agent
COPY executor /src/executor
COPY harness /src/harness
COPY simulator /src/simulator
# The project itself without resolving its dependencies again (the lock file has them; torch,
# a dependency of the training side, is left out on purpose).
RUN /opt/elaswave/bin/pip install --no-deps /src

FROM ${BASE_IMAGE} AS core-store
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_WHEELS=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=build /opt/elaswave /opt/elaswave
COPY docker/healthcheck.py /usr/local/lib/elaswave/healthcheck.py
COPY docker/install-torch.sh /usr/local/lib/elaswave/install-torch.sh
RUN /usr/local/lib/elaswave/install-torch.sh /opt/elaswave/bin/pip "${TORCH_VERSION}" "${TORCH_INDEX_URL}" "${TORCH_WHEELS}" \
 && useradd --system --uid 10001 --home-dir /var/lib/elaswave --create-home elaswave
ENV PATH=/opt/elaswave/bin:$PATH ELASWAVE_GRPC_HOST=0.0.0.0 ELASWAVE_HTTP_HOST=0.0.0.0 \
    ELASWAVE_GRPC_PORT=50051 ELASWAVE_HTTP_PORT=8080 PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /var/lib/elaswave
EXPOSE 50051 8080
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
  CMD ["/opt/elaswave/bin/python", "/usr/local/lib/elaswave/healthcheck.py", "core"]
ENTRYPOINT ["elaswave", "core"]

FROM ${BASE_IMAGE} AS core
COPY --from=build /opt/elaswave /opt/elaswave
COPY docker/healthcheck.py /usr/local/lib/elaswave/healthcheck.py
RUN useradd --system --uid 10001 --home-dir /var/lib/elaswave --create-home elaswave
ENV PATH=/opt/elaswave/bin:$PATH ELASWAVE_GRPC_HOST=0.0.0.0 ELASWAVE_HTTP_HOST=0.0.0.0 \
    ELASWAVE_GRPC_PORT=50051 ELASWAVE_HTTP_PORT=8080 PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /var/lib/elaswave
EXPOSE 50051 8080
# Liveness: /healthz and a gRPC health answer (a standby answers NOT_SERVING and is healthy).
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
  CMD ["/opt/elaswave/bin/python", "/usr/local/lib/elaswave/healthcheck.py", "core"]
ENTRYPOINT ["elaswave", "core"]
