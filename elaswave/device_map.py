"""The launcher's device mapping: one accelerator per local rank of every node (docs/accelerators.md).

A pure function of the node's worker count, `--devices-per-node` and the node's visibility list
(`CUDA_VISIBLE_DEVICES` / `ASCEND_RT_VISIBLE_DEVICES`): local rank i of a node gets device
ordinal i as its process sees it, which is the i-th entry of the visibility list (the worker
inherits the list, so ordinal i names that physical device). A node with more workers than
devices is refused with the ranks left without one, unless sharing is asked for: then local rank
i takes ordinal i mod n and the job's collectives run over gloo (NCCL cannot put two ranks of one
communicator on one GPU).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from wire.worker_env import DEVICE_INDEX_ENV, DEVICE_SHARED_ENV, HOST_THREADS_ENV, VISIBLE_ENV


class DeviceMapError(ValueError):
    """The node cannot give every one of its ranks a device; the message says which and why."""


@dataclass(frozen=True)
class DeviceSlot:
    """Where one rank runs: its node, local rank, device ordinal in its process and the
    physical device id that ordinal names on the node."""

    rank: int
    node: int
    local_rank: int
    index: int
    physical: str
    shared: bool


def parse_visible(value: str | None) -> tuple[str, ...] | None:
    """The ids a visibility variable lists (None: the variable is unset, every device visible)."""
    if value is None:
        return None
    ids = tuple(v.strip() for v in value.split(",") if v.strip())
    if len(set(ids)) != len(ids):
        raise DeviceMapError(f"the visible-device list {value!r} names a device twice")
    return ids


def node_device_count(devices_per_node: int | None, visible: tuple[str, ...] | None, var: str) -> int:
    """How many devices one node offers: `--devices-per-node`, checked against the visible list."""
    if devices_per_node is not None and devices_per_node < 1:
        raise DeviceMapError(f"--devices-per-node must be >= 1, got {devices_per_node}")
    if visible is not None and devices_per_node is not None and devices_per_node > len(visible):
        raise DeviceMapError(
            f"--devices-per-node {devices_per_node}, but ${var}={','.join(visible)!r} makes only "
            f"{len(visible)} visible"
        )
    if devices_per_node is not None:
        return devices_per_node
    if visible is None:
        raise DeviceMapError(f"say how many devices each node has: --devices-per-node N (or set ${var})")
    if not visible:
        raise DeviceMapError(f"${var} is empty: this node shows no device")
    return len(visible)


def map_devices(
    nodes: Mapping[int, Sequence[int]],
    devices_per_node: int | None,
    visible: str | None,
    var: str = "CUDA_VISIBLE_DEVICES",
    share: bool = False,
) -> dict[int, DeviceSlot]:
    """rank -> its device, for every node's ranks (`nodes`: node -> its ranks in local order).

    Every node is assumed to have the same `devices_per_node` and visibility list (what one
    `elaswave run` command line and environment say for all of them). Raises DeviceMapError
    naming the node and the ranks that would have no device."""
    ids = parse_visible(visible)
    count = node_device_count(devices_per_node, ids, var)
    out: dict[int, DeviceSlot] = {}
    for node, ranks in sorted(nodes.items()):
        shared = len(ranks) > count
        if shared and not share:
            homeless = ", ".join(str(r) for r in ranks[count:])
            raise DeviceMapError(
                f"node {node}: ranks {homeless} have no device: {len(ranks)} workers, {count} "
                f"device(s)"
                + (f" (${var}={visible!r})" if visible is not None else "")
                + "; lower --nproc-per-node, raise --devices-per-node, or --share-devices (gloo)"
            )
        for local, rank in enumerate(ranks):
            index = local % count
            physical = ids[index] if ids is not None else str(index)
            out[rank] = DeviceSlot(rank, node, local, index, physical, shared)
    return out


def visibility_variable(environ: Mapping[str, str]) -> str:
    """The variable that lists this node's devices: Ascend's when only it is set, else CUDA's."""
    cuda, npu = VISIBLE_ENV["cuda"], VISIBLE_ENV["npu"]
    return npu if environ.get(npu) is not None and environ.get(cuda) is None else cuda


def node_cpus() -> int:
    """The CPUs this process may run on (its affinity where the platform has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def host_threads(cpus: int, ranks_on_node: int) -> int:
    """torch intra-op threads for each of a node's ranks: its `cpus` split evenly, at least one."""
    return max(1, cpus // max(1, ranks_on_node))


def worker_device_env(
    nodes: Mapping[int, Sequence[int]],
    devices_per_node: int | None,
    environ: Mapping[str, str],
    share: bool = False,
    cpus: int | None = None,
) -> dict[int, dict[str, str]]:
    """rank -> the variables that put its worker on its device ($ELASWAVE_DEVICE_INDEX, and
    $ELASWAVE_DEVICE_SHARED when ranks share one) and give it its share of the node's `cpus`
    (default: the CPUs this process may run on) as torch threads ($ELASWAVE_HOST_THREADS, unless
    `environ` sets it). Empty when nothing says the node has devices (no --devices-per-node, no
    visibility variable): a CPU job, whose workers keep one thread each."""
    var = visibility_variable(environ)
    visible = environ.get(var)
    if devices_per_node is None and visible is None and not share:
        return {}
    slots = map_devices(nodes, devices_per_node, visible, var, share)
    cpus = node_cpus() if cpus is None else cpus
    threads = {node: host_threads(cpus, len(ranks)) for node, ranks in nodes.items()}
    chosen = environ.get(HOST_THREADS_ENV, "").strip() or None
    if chosen is not None and (not chosen.isdigit() or int(chosen) < 1):
        raise DeviceMapError(f"${HOST_THREADS_ENV} must be a thread count >= 1, got {chosen!r}")
    return {
        rank: {DEVICE_INDEX_ENV: str(slot.index), HOST_THREADS_ENV: chosen or str(threads[slot.node])}
        | ({DEVICE_SHARED_ENV: "1"} if slot.shared else {})
        for rank, slot in slots.items()
    }
