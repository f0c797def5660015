"""The cluster harness: real Cores, stores, agents and workers on loopback, for `elaswave demo`
and the end-to-end tests (it is neither the public API nor part of the `elaswave` package)."""
