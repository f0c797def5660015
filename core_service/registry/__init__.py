"""Membership registry of the ElasWave Core: one interface, an in-memory and an etcd v3 backend.

See ``base`` for the interface and the key layout, ``factory.open_registry`` for URLs.
"""

from __future__ import annotations

from core_service.registry.base import (
    BackendUnavailable,
    KVEvent,
    LeaseNotFound,
    Registry,
    RegistryError,
    WatchCallback,
    WatchHandle,
)
from core_service.registry.election import LeaderElection
from core_service.registry.etcd import EtcdEndpoint, EtcdRegistry
from core_service.registry.factory import open_registry
from core_service.registry.memory import MemoryRegistry
from core_service.registry.plans import PlanStore, StaleEpoch

__all__ = [
    "BackendUnavailable",
    "EtcdEndpoint",
    "EtcdRegistry",
    "KVEvent",
    "LeaderElection",
    "LeaseNotFound",
    "MemoryRegistry",
    "PlanStore",
    "Registry",
    "RegistryError",
    "StaleEpoch",
    "WatchCallback",
    "WatchHandle",
    "open_registry",
]
