"""The lowest layer: what crosses a process boundary, shared by every part above it.

- `wire.v1`: the gRPC messages and services generated from `proto/wire/v1/*.proto` (`make proto`;
  the services keep their `elaswave.v1` package name on the wire).
- `wire.worker_env`: what a launcher tells a training process through its environment, and the
  model description the process writes back.
- `wire.local_protocol`: the worker <-> agent channels on one host (control file, step metrics,
  exit statuses and the finished marker).

Nothing here imports another part of the project (`docs/architecture.md`, "Layers"): the engine
(`executor`), the control plane (`core_service`, `agent`) and the public package (`elaswave`) all
build on it.
"""
