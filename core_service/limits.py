"""Documented maxima of every input that sizes work or memory in the Core (docs/api.md, "Limits").

A value above its maximum is refused (gRPC INVALID_ARGUMENT, HTTP 413 for a body, 422 for a
field) before any work is done, so no single call can hold the event loop or grow memory
without bound. The bounds sit far above any job we plan for (FlexTrain's and ElasWave's largest
evaluated clusters have a few thousand devices).
"""

from __future__ import annotations

# Devices: in an offer, a what-if, a reclaim, a model's cluster and its `max_devices` cap.
MAX_DEVICES = 65_536
# Transformer layers of a registered model (the planner's work grows with them).
MAX_LAYERS = 4_096
# Worker ids named in one request (preemption, what-if removals) and hosts in one offer.
MAX_IDS_PER_REQUEST = 10_000
# Workers of one job when it does not say how many it expects (`expected_workers` = 0).
MAX_WORKERS_PER_JOB = 100_000
# Spare workers a job may register beyond `expected_workers`.
MAX_SPARE_WORKERS = 10_000
# Strings: names and ids are checked by pattern; these bound the free-text fields.
MAX_HOST_CHARS = 255
MAX_REASON_CHARS = 1_000
MAX_DETAIL_CHARS = 4_096  # collective error text, probe details, failure reasons
MAX_OPERATION_CHARS = 256
MAX_TOKEN_CHARS = 1_024
# REST request bodies, refused with 413 before they are parsed or authenticated.
MAX_BODY_BYTES = 4 * 1024 * 1024
# gRPC messages the Core accepts (the largest is a Register with its devices).
MAX_GRPC_MESSAGE_BYTES = 4 * 1024 * 1024
