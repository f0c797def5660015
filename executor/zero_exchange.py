"""The ZeRO-1 stage's gradient and parameter exchanges, one per unit (ElasWave §6.3; issue 23).

`executor.zero.ShardedOptimizer` owns the math (the DP-order sum, clipping, the update of its
slices); this module moves the bytes. Each unit of the stage has one personalised exchange
(`alltoall_base`) per direction and step:

- reduce-scatter: the unit's flat gradient goes out as it is, cut into the owners' intervals
  (interleaved and contiguous ownership both cut a unit into intervals in DP order); each owner
  receives the D contributions to its interval and adds them in DP-rank order. The exchanges
  start along one fixed order, on every rank the same (the stage's units in reverse), either
  during the step's last backward as autograd finishes each unit (`executor.grad_overlap`) or
  after it;
- all-gather: posted right after the owner updated the unit's slice (so it overlaps the next
  unit's update), received straight into the unit's flat parameter buffer.

Each direction is waited for as one guarded op (`engine_comm.WorkSet`): to the communicator's
ledger and failure detection a step still has one reduce-scatter and one all-gather.

A unit without a flat buffer (one sharing a parameter with another unit of the stage: a tie), or
whose ownership does not follow DP order, takes the copying path: its gradient concatenated per
owner, its parameters received into a scratch buffer and copied in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed import AllToAllOptions

from executor.engine_comm import EngineComm, WorkSet
from executor.flat_units import FlatUnit, assign_flat, flat_grads, flat_params, flat_units, range_views
from executor.grad_overlap import OverlapLauncher

Interval = tuple[int, int]


def _in_dp_order(intervals: Sequence[Interval], numel: int) -> bool:
    """Whether the owners' intervals of a unit, in DP order, tile `[0, numel)` (empty ones
    anywhere): then the unit's flat vector is already the exchange's per-owner layout."""
    pos = 0
    for lo, hi in intervals:
        if hi > lo:
            if lo != pos:
                return False
            pos = hi
    return pos == numel


class UnitExchange:
    """The per-unit exchanges of one stage's DP group (module docstring)."""

    def __init__(
        self,
        comm: EngineComm,
        group: str,
        units: Mapping[str, nn.Module],
        ownership: Mapping[str, list[Interval]],
        dp_index: int,
        wire_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        flat: bool = True,
    ) -> None:
        """`flat=False` keeps every unit on the copying path (the same results; for comparisons)."""
        self.comm, self.group, self.wire_dtype = comm, group, wire_dtype
        self.device = torch.device(device)
        self.units = dict(units)
        self.ownership = {n: list(ownership[n]) for n in self.units}
        self.dp_index, self.dp_size = dp_index, len(next(iter(self.ownership.values())))
        self._numel = {n: sum(p.numel() for p in u.parameters()) for n, u in self.units.items()}
        # Parameters and gradients as views of one flat buffer per unit (executor.flat_units)
        self.flats: dict[str, FlatUnit] = flat_units(self.units) if flat else {}
        self._ordered = {n: _in_dp_order(self.ownership[n], self._numel[n]) for n in self.units}
        self._posted: dict[str, tuple[torch.Tensor, Any]] = {}
        self.launcher = OverlapLauncher(list(reversed(self.active())), self._launch)

    def zero_grads(self) -> None:
        """Before a step's backward: every flat unit's gradient buffer cleared and made its
        parameters' `.grad` (backward accumulates into it in place); other units' grads dropped.
        Forgets exchanges a failed step started and never waited for."""
        self.launcher.reset()
        self._posted = {}
        for name, unit in self.units.items():
            flat = self.flats.get(name)
            if flat is not None:
                flat.zero_grads()
            else:
                for p in unit.parameters():
                    p.grad = None

    def grad_vector(self, name: str) -> torch.Tensor:
        """The unit's flat gradient: the buffer itself for a flat unit, else a concatenated copy."""
        flat = self.flats.get(name)
        return flat.grads() if flat is not None else flat_grads(self.units[name])

    def param_vector(self, name: str) -> torch.Tensor | None:
        """The unit's flat parameters as a view (a flat unit), else None."""
        flat = self.flats.get(name)
        if flat is None:
            return None
        flat.ensure()
        return flat.flat

    def numel_of(self, name: str) -> int:
        return self._numel[name]

    def active(self) -> list[str]:
        """Units with parameters, in stage order: each has one exchange per direction."""
        return [n for n in self.units if self._numel[n] > 0]

    def overlap_backward(self) -> None:
        """Right before this step's last backward: start each flat unit's reduce-scatter as soon
        as autograd has finished its gradients (executor.grad_overlap), overlapping the rest of
        the backward. Nothing to overlap in a group of one."""
        if self.dp_size > 1:
            self.launcher.arm({n: f.params for n, f in self.flats.items() if self._ordered[n]})

    def _launch(self, name: str) -> None:
        """Post the reduce-scatter of one unit: my DP peers' intervals of its flat gradient to
        them, theirs of mine to me (summed in `reduce_scatter`)."""
        ivs, wire = self.ownership[name], self.wire_dtype
        vec = self.grad_vector(name)
        if not self._ordered[name]:
            vec = torch.cat([vec[lo:hi] for lo, hi in ivs])
        if wire != torch.float32:  # fewer bytes on the wire; the sum below stays fp32
            vec = vec.to(wire)
        mine = ivs[self.dp_index][1] - ivs[self.dp_index][0]
        if self.dp_size == 1:
            self._posted[name] = (vec[ivs[self.dp_index][0] : ivs[self.dp_index][1]], None)
            return
        recv = torch.empty(mine * self.dp_size, dtype=vec.dtype, device=vec.device)
        self._posted[name] = (
            recv,
            self._alltoall(recv, vec, [mine] * self.dp_size, [hi - lo for lo, hi in ivs]),
        )

    def reduce_scatter(self) -> dict[str, torch.Tensor]:
        """Sum of every DP rank's gradient over my owned slices, added in DP-rank order.

        One personalised exchange per unit, started along one fixed order on every rank (some
        may have started during the backward: `overlap_backward`), all posted before the first
        is waited for. A flat unit's gradient buffer is the exchange's input as it is (ownership
        cuts every unit into intervals in DP order, `_in_dp_order`): nothing is concatenated."""
        self.launcher.finish()
        posted, self._posted = self._posted, {}
        self.launcher.reset()
        works = [work for _recv, work in posted.values() if work is not None]
        if works:
            self.comm.wait(self.group, WorkSet(works))  # one guarded op, as one exchange was
        out: dict[str, torch.Tensor] = {}
        for name in self.units:
            lo, hi = self.ownership[name][self.dp_index]
            if name not in posted:
                out[name] = torch.zeros(hi - lo, device=self.device)
                continue
            recv, _work = posted[name]
            pieces = recv.split([hi - lo] * self.dp_size)
            total = pieces[0].clone() if pieces[0].dtype == torch.float32 else pieces[0].float()
            for piece in pieces[1:]:
                total += piece
            out[name] = total
        return out

    def carrier(self, extra: torch.Tensor | None) -> tuple[str | None, torch.Tensor | None]:
        """Which unit's all-gather carries `extra` (the smallest; None: a stage without
        parameters sends it alone), and `extra` itself, or (None, None) when it cannot ride
        (not 1-D, or not the parameters' dtype: the caller then gathers it itself)."""
        active = self.active()
        if extra is None or extra.dim() != 1:
            return None, None
        if not active:
            return None, extra
        carrier = min(active, key=lambda n: self._numel[n])
        dtype = next(self.units[carrier].parameters()).dtype
        return (carrier, extra) if extra.dtype == dtype else (None, None)

    def post_gather(
        self, name: str, mine: torch.Tensor, carrier: str | None, extra: torch.Tensor | None
    ) -> tuple[str, torch.Tensor, Any]:
        """Post the all-gather of one unit: my updated slice to every rank, every owner's into
        the unit's parameter buffer (a flat unit in DP order) or a scratch buffer. Returns (unit,
        or "" when written in place; the receiving tensor; the work)."""
        sizes = [hi - lo for lo, hi in self.ownership[name]]
        out = self.param_vector(name) if self._ordered[name] and name != carrier else None
        if name == carrier:
            assert extra is not None
            mine = torch.cat([mine, extra.to(mine.device)])
            sizes = [n + extra.numel() for n in sizes]
        recv = out if out is not None else torch.empty(sum(sizes), dtype=mine.dtype, device=mine.device)
        work = self._alltoall(recv, mine.repeat(self.dp_size), sizes)
        return ("" if out is not None else name), recv, work

    def finish_gather(
        self,
        updated: Mapping[str, torch.Tensor],
        posted: list[tuple[str, torch.Tensor, Any]],
        carrier: str | None,
        extra: torch.Tensor | None,
    ) -> list[torch.Tensor] | None:
        """Complete the all-gather posted unit by unit (`post_gather`; waited for as one op):
        copy what did not land in place into the parameters. Returns every rank's carried
        `extra`, in DP order (None without one)."""
        self.piggybacked: list[torch.Tensor] | None = None
        if self.dp_size == 1:
            self.write_back({n: [v] for n, v in updated.items() if self.param_vector(n) is None})
            return None if extra is None else [extra.to(self.device)]
        if extra is not None and carrier is None:  # a stage without parameters: the extra alone
            recv = torch.empty(extra.numel() * self.dp_size, dtype=extra.dtype, device=self.device)
            sent = extra.to(self.device).repeat(self.dp_size)
            posted.append(("", recv, self._alltoall(recv, sent, [extra.numel()] * self.dp_size)))
            self.piggybacked = list(recv.chunk(self.dp_size))
        if posted:
            self.comm.wait(self.group, WorkSet([work for _n, _r, work in posted]))
        received: dict[str, list[torch.Tensor]] = {}
        for name, recv, _work in posted:
            if not name:
                continue
            cut = 0 if name != carrier or extra is None else extra.numel()
            pieces = list(recv.split([hi - lo + cut for lo, hi in self.ownership[name]]))
            if cut:
                self.piggybacked = [p[p.numel() - cut :] for p in pieces]
                pieces = [p[: p.numel() - cut] for p in pieces]
            received[name] = pieces
        self.write_back(received)
        return self.piggybacked

    def _alltoall(
        self,
        out: torch.Tensor,
        sent: torch.Tensor,
        out_sizes: Sequence[int],
        sent_sizes: Sequence[int] | None = None,
    ) -> Any:
        """Post one personalised exchange on my DP group: `sent_sizes[k]` elements of `sent` (by
        default an equal share) go to rank k, `out_sizes[k]` from rank k land in `out`, in order.
        Returns the work to wait on (through `comm.wait`, which guards it)."""
        sent_sizes = [sent.numel() // self.dp_size] * self.dp_size if sent_sizes is None else sent_sizes
        return self.comm.group(self.group).alltoall_base(
            out, sent, list(out_sizes), list(sent_sizes), AllToAllOptions()
        )

    def write_back(self, received: Mapping[str, Sequence[torch.Tensor]]) -> None:
        """Owner k's slice `received[unit][k]` into its interval of the unit's parameters, for the
        units whose exchange could not write in place (owner by owner, as the stage-wide
        exchange did, which decides a parameter shared by two units on the stage)."""
        if not received:
            return
        params = {n: [p.detach() for p in self.units[n].parameters()] for n in received}
        vecs = {n: self.param_vector(n) for n in received}
        if not all(vecs[n] is not None or all(p.is_contiguous() for p in params[n]) for n in received):
            flats = {n: flat_params(self.units[n]) for n in received}
            for name, pieces in received.items():
                for (lo, hi), piece in zip(self.ownership[name], pieces, strict=True):
                    flats[name][lo:hi] = piece
                assign_flat(self.units[name], flats[name])
            return
        for k in range(self.dp_size):
            for name, pieces in received.items():
                lo, hi = self.ownership[name][k]
                vec = vecs[name]
                pos = 0
                for view in range_views([vec] if vec is not None else params[name], lo, hi):
                    view.copy_(pieces[k][pos : pos + view.numel()])
                    pos += view.numel()
