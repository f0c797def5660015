# syntax=docker/dockerfile:1
# etcd from Debian's packages, for a host that cannot pull quay.io/coreos/etcd (CI builds it on its
# local Debian base, scripts/build-images.sh; deploy/compose takes it through ETCD_IMAGE):
#   docker build -f docker/etcd.Dockerfile -t elaswave-etcd:3.4.23 .
# Debian bookworm ships etcd 3.4, whose flags and `etcdctl endpoint health` the compose file uses.
ARG BASE_IMAGE=debian:bookworm-20250520-slim
FROM ${BASE_IMAGE}
# The release's own package (security updates change the exact version: not pinned on purpose).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends etcd-server etcd-client \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --home-dir /etcd-data --no-create-home elaswave \
 && install -d -o 10001 -g 10001 -m 0700 /etcd-data
USER 10001:10001
EXPOSE 2379 2380
HEALTHCHECK --interval=5s --timeout=3s --retries=10 \
  CMD ["etcdctl", "--endpoints=http://127.0.0.1:2379", "endpoint", "health"]
CMD ["etcd"]
