"""The communication surface the training engine needs, and a static implementation of it.

The engine talks only to *logical groups* by name — `"dp/<s>"` (stage s's DP group, in DP order)
and `"pp/<s>-<s+1>"` (the ranks of two adjacent stages) — and to workers by their stable global
rank. `EngineComm` is the subset of `executor.comm.Communicator` (the dynamic communicator, which
adds failure detection and in-place edits) that the engine uses, so either can drive a trainer.
`StaticComm` builds the same groups once, directly over a `PrefixStore` (no `init_process_group`,
no world group), for fault-free runs and tests: gloo on CPU, NCCL on CUDA, HCCL through
`torch_npu` (imported only when that backend is asked for).

Every op is bounded: groups are created with a timeout and each wait passes it again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol, TypeVar, cast

import torch
from torch.distributed import AllToAllOptions, PrefixStore, ProcessGroup, ProcessGroupGloo, Store

from executor.staging import Staging

T = TypeVar("T")


def dp_group_name(stage: int) -> str:
    return f"dp/{stage}"


def pp_group_name(stage: int) -> str:
    """Group of stage `stage` and stage `stage + 1`."""
    return f"pp/{stage}-{stage + 1}"


def groups_for_stage_ranks(
    stage_ranks: Sequence[Sequence[int]], world: bool = False
) -> dict[str, tuple[int, ...]]:
    """Every logical group of a job whose stage p is served by `stage_ranks[p]` (DP order), and
    with `world` the group of every rank ("world", for the global gradient norm)."""
    groups: dict[str, tuple[int, ...]] = {}
    for s, ranks in enumerate(stage_ranks):
        groups[dp_group_name(s)] = tuple(ranks)
        if s + 1 < len(stage_ranks):
            groups[pp_group_name(s)] = tuple(ranks) + tuple(stage_ranks[s + 1])
    if world:
        groups["world"] = tuple(r for ranks in stage_ranks for r in ranks)
    return groups


class EngineComm(Protocol):
    """What the trainer calls; `executor.comm.Communicator` satisfies it."""

    worker: int

    def group(self, name: str) -> ProcessGroup: ...

    def workers(self, name: str) -> tuple[int, ...]: ...

    def group_rank(self, name: str, worker: int | None = None) -> int: ...

    def send(self, name: str, tensor: torch.Tensor, dst_worker: int, tag: int = 0) -> None: ...

    def recv(self, name: str, tensor: torch.Tensor, src_worker: int, tag: int = 0) -> None: ...

    def all_gather(self, name: str, outputs: Sequence[torch.Tensor], tensor: torch.Tensor) -> None: ...

    def issue(self, name: str, op: Callable[[ProcessGroup], T]) -> T:
        """`op(group(name))`, an op waited for later by `wait(name, ..., issued=n)`."""
        ...

    def wait(self, name: str, work: object, has_future: bool = True, issued: int = 0) -> None: ...

    def post_exchange(
        self,
        sends: Sequence[tuple[str, torch.Tensor, int, int]],
        recvs: Sequence[tuple[str, torch.Tensor, int, int]],
    ) -> Any:
        """Issue (group, tensor, peer worker, tag) sends and receives without waiting; returns a
        handle for `complete`."""
        ...

    def complete(self, ops: Any) -> None:
        """Wait (bounded) for every op of a `post_exchange` handle."""
        ...


def p2p_channel(comm: EngineComm, name: str, peer: int) -> tuple[str, ProcessGroup, int]:
    """(group name, process group, peer's rank in it) carrying point-to-point traffic with `peer`
    inside logical group `name`. A communicator that serves pipeline pairs by per-link groups says
    so through its own `p2p_group(name, peer)`; otherwise the logical group itself carries it.
    For inspecting the backend (e.g. whether it matches by tag); issue ops via `post_exchange`."""
    resolve = getattr(comm, "p2p_group", None)
    if resolve is not None:
        return resolve(name, peer)
    return name, comm.group(name), comm.group_rank(name, peer)


BACKENDS: tuple[str, ...] = ("gloo", "nccl", "hccl")


def make_group(backend: str, store: Store, rank: int, size: int, timeout: timedelta) -> ProcessGroup:
    """One process group of `backend` built directly over `store` (which should be prefixed)."""
    if backend == "gloo":
        # A c10d backend object used as a ProcessGroup (torch's stubs keep the two types apart).
        return cast(ProcessGroup, ProcessGroupGloo(store, rank, size, timeout))
    if backend == "nccl":
        if not (torch.cuda.is_available() and torch.distributed.is_nccl_available()):
            raise RuntimeError("backend 'nccl' needs CUDA and a torch build with NCCL")
        from torch.distributed import ProcessGroupNCCL  # noqa: PLC0415 - absent from CPU builds

        nccl_opts = ProcessGroupNCCL.Options()
        nccl_opts._timeout = timeout
        return cast(ProcessGroup, ProcessGroupNCCL(store, rank, size, nccl_opts))
    if backend == "hccl":
        try:
            import torch_npu  # noqa: F401, PLC0415 - optional extra `elaswave[npu]`
            from torch_npu._C._distributed_c10d import ProcessGroupHCCL  # noqa: PLC0415
        except ImportError as e:
            raise RuntimeError(f"backend 'hccl' needs torch_npu (pip install 'elaswave[npu]'): {e}") from None
        hccl_opts = ProcessGroupHCCL.Options()
        hccl_opts._timeout = timeout
        return ProcessGroupHCCL(store, rank, size, hccl_opts)
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


class StaticComm:
    """Fixed logical groups built once over `store`; see the module docstring."""

    def __init__(
        self,
        store: Store,
        worker: int,
        membership: dict[str, tuple[int, ...]],
        timeout_s: float = 30.0,
        namespace: str = "static",
        backend: str = "gloo",
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.worker, self.backend = worker, backend
        self.timeout = timedelta(seconds=timeout_s)
        self._members = {name: tuple(ws) for name, ws in membership.items() if worker in ws}
        if not self._members:
            raise ValueError(f"worker {worker} is in no group of {membership}")
        # Build in sorted-name order on every worker so the rendezvous never interleaves badly.
        self._groups: dict[str, ProcessGroup] = {}
        for name in sorted(self._members):
            ws = self._members[name]
            self._groups[name] = make_group(
                backend, PrefixStore(f"{namespace}/{name}", store), ws.index(worker), len(ws), self.timeout
            )

    def group(self, name: str) -> ProcessGroup:
        if name not in self._groups:
            raise KeyError(f"worker {self.worker} has no group {name!r} (has {sorted(self._groups)})")
        return self._groups[name]

    def workers(self, name: str) -> tuple[int, ...]:
        self.group(name)
        return self._members[name]

    def group_rank(self, name: str, worker: int | None = None) -> int:
        ws = self.workers(name)
        w = self.worker if worker is None else worker
        if w not in ws:
            raise ValueError(f"worker {w} is not in group {name!r} {ws}")
        return ws.index(w)

    def send(self, name: str, tensor: torch.Tensor, dst_worker: int, tag: int = 0) -> None:
        self.complete(self.post_exchange([(name, tensor, dst_worker, tag)], []))

    def recv(self, name: str, tensor: torch.Tensor, src_worker: int, tag: int = 0) -> None:
        self.complete(self.post_exchange([], [(name, tensor, src_worker, tag)]))

    def all_gather(self, name: str, outputs: Sequence[torch.Tensor], tensor: torch.Tensor) -> None:
        self.group(name).allgather([list(outputs)], [tensor]).wait(self.timeout)

    def issue(self, name: str, op: Callable[[ProcessGroup], T]) -> T:
        return op(self.group(name))

    def wait(self, name: str, work: object, has_future: bool = True, issued: int = 0) -> None:
        work.wait(self.timeout)  # type: ignore[attr-defined]

    def post_exchange(
        self,
        sends: Sequence[tuple[str, torch.Tensor, int, int]],
        recvs: Sequence[tuple[str, torch.Tensor, int, int]],
    ) -> list[object]:
        staging = Staging(self.backend)  # executor.staging: a no-op for CPU tensors on gloo
        works: list[object] = [
            self.group(n).send([staging.send(t)], self.group_rank(n, peer), tag) for n, t, peer, tag in sends
        ]
        works += [
            self.group(n).recv([staging.recv(t)], self.group_rank(n, peer), tag) for n, t, peer, tag in recvs
        ]
        return works + [staging] if staging.copy_back else works

    def complete(self, ops: list[object]) -> None:
        for work in ops:
            work.wait(self.timeout)  # type: ignore[attr-defined]


class WorkSet:
    """Several works issued on one group (`comm.issue`), waited for as one guarded op:
    `comm.wait(name, WorkSet(works), issued=len(works))` (the per-bucket exchanges of a ZeRO-1
    step are one reduce-scatter and one all-gather to failure detection)."""

    def __init__(self, works: Sequence[Any]) -> None:
        self.works = list(works)

    def get_future(self) -> torch.futures.Future[Any]:
        return torch.futures.collect_all([w.get_future() for w in self.works])

    def wait(self, timeout: timedelta | None = None) -> bool:
        for work in self.works:
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout)
        return True


def all_to_all_v(
    comm: EngineComm, name: str, inputs: Sequence[torch.Tensor], output_sizes: Sequence[int]
) -> list[torch.Tensor]:
    """Personalised exchange in group `name`: `inputs[k]` goes to group rank k; returns the piece
    received from each group rank (sizes `output_sizes`). 1-D float tensors, uneven sizes allowed."""
    send = torch.cat([t.reshape(-1) for t in inputs]) if inputs else torch.empty(0)
    recv = torch.empty(sum(output_sizes), dtype=send.dtype, device=send.device)
    if len(inputs) == 1:  # a group of one: nothing to exchange
        recv.copy_(send)
    else:
        sizes = [t.numel() for t in inputs]
        work = comm.issue(
            name, lambda pg: pg.alltoall_base(recv, send, list(output_sizes), sizes, AllToAllOptions())
        )
        comm.wait(name, work, issued=1)
    return list(recv.split(list(output_sizes)))
