"""NCCL and HCCL groups under failure (docs/architecture.md ("What is proven where")).

A collective whose peer died must end within the job's bound instead of hanging in the device
library. Three pieces, all inert on gloo:

- every group is built with the job's timeout (`engine_comm.make_group` puts it in the backend's
  options), and the communicator's own waits are bounded by it too;
- the backend's asynchronous error handling is on, in the mode that aborts the broken
  communicator and raises in the worker instead of killing the process
  (TORCH_NCCL_ASYNC_ERROR_HANDLING=2, "clean up only"; HCCL_ASYNC_ERROR_HANDLING=1), so a
  survivor can still take part in the plan-epoch edit; a value the user set is kept;
- at the edit, every group the new membership drops (it held a lost rank, or ops left half
  matched) is aborted: its device communicator and buffers are freed before the replacement is
  built, so device memory does not grow edit after edit (gloo's groups are parked instead:
  destroying one with an abandoned op blocks until its timeout).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

ASYNC_ERROR_ENV: dict[str, dict[str, str]] = {
    "nccl": {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"},
    "hccl": {"HCCL_ASYNC_ERROR_HANDLING": "1"},
}


def apply_error_handling_env(backend: str, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Turn the backend's async error handling on (before its first group); returns what was set."""
    env = os.environ if environ is None else environ
    applied = {}
    for key, value in ASYNC_ERROR_ENV.get(backend, {}).items():
        if key not in env:
            env[key] = value
            applied[key] = value
    return applied


def abort_group(pg: object) -> str:
    """Abort a device group's communicator (pending ops fail at once, its memory is freed);
    returns how, or why not (an object without an abort: gloo, or an older build)."""
    for name in ("abort", "_abort", "shutdown"):
        fn = getattr(pg, name, None)
        if callable(fn):
            fn()
            return name
    return "no abort on this process group"
