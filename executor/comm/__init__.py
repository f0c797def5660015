"""Dynamic communicator: per-logical-group gloo groups edited in place (ElasWave §6.1)."""

from __future__ import annotations

from executor.comm.communicator import Communicator, EditReport, RebuildMode
from executor.comm.errors import Interrupted, MembershipError, PeerFailure, StoreLost
from executor.comm.groups import dp_group_name, groups_for_stages, pp_group_name

__all__ = [
    "Communicator",
    "EditReport",
    "MembershipError",
    "PeerFailure",
    "Interrupted",
    "StoreLost",
    "RebuildMode",
    "dp_group_name",
    "groups_for_stages",
    "pp_group_name",
]
