"""Membership registry of the ElasWave Core: one interface, an in-memory and an etcd v3 backend.

See ``base`` for the interface and the key layout, ``factory.open_registry`` for URLs.
"""

from __future__ import annotations

from core_service.registry.base import (
    BackendUnavailable,
    Fence,
    FenceLost,
    KVEvent,
    LeaseNotFound,
    Registry,
    RegistryError,
    TxnResult,
    TxnWrite,
    WatchCallback,
    WatchHandle,
)
from core_service.registry.election import LeaderElection, holder_of
from core_service.registry.etcd import EtcdEndpoint, EtcdRegistry, EtcdSecurity
from core_service.registry.factory import open_registry
from core_service.registry.memory import MemoryRegistry
from core_service.registry.plans import PlanStore, StaleEpoch

__all__ = [
    "BackendUnavailable",
    "EtcdEndpoint",
    "EtcdRegistry",
    "Fence",
    "FenceLost",
    "KVEvent",
    "LeaderElection",
    "LeaseNotFound",
    "MemoryRegistry",
    "PlanStore",
    "Registry",
    "RegistryError",
    "StaleEpoch",
    "holder_of",
    "TxnResult",
    "TxnWrite",
    "WatchCallback",
    "WatchHandle",
    "open_registry",
    "EtcdSecurity",
]
