"""1F1B pipeline schedule with sample-range routing between stages (ElasWave §4.1).

Schedule. Stage s of P runs `min(P-s-1, M)` warm-up forwards, then alternates one forward and one
backward, then drains the backwards. Communication is plain blocking `send`/`recv` (gloo's
batched isend is fragile, docs/architecture.md ("Promises and rules")), and gloo's send is a rendezvous, so the *order* of the
communication ops must be deadlock-free by construction: when a backward is followed by a
forward, a stage receives the next forward input *before* it sends the backward gradient. Then
both ends of every stage pair see the same sequence of pair operations (`stage_program`); the
test suite checks this on a rendezvous simulator for many (P, M, DP) shapes.

Routing. Slot m covers the same global samples on every stage, but stages may split it among
different numbers of ranks. A rank sends each slice of its activations to the rank(s) of the next
stage that own those samples, and receives gradients back the same way (`routes`). Within one
pipeline operation a rank handles its peers in increasing sample order, which is the same order
on both sides, so the many-to-many exchange of a slot cannot deadlock either.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from executor.engine_comm import EngineComm, pp_group_name
from executor.units import Activation, ActivationSpec, TensorSpec, as_tuple
from planners.layout import Layout, SampleRange

OpKind = Literal["recv_f", "fwd", "send_f", "recv_b", "bwd", "send_b"]


@dataclass(frozen=True)
class Op:
    kind: OpKind
    slot: int


def compute_order(num_stages: int, stage: int, num_slots: int) -> list[tuple[str, int]]:
    """1F1B compute sequence of one stage: ("F", m) / ("B", m)."""
    warmup = min(num_stages - stage - 1, num_slots)
    seq = [("F", m) for m in range(warmup)]
    for k in range(num_slots - warmup):
        seq += [("F", warmup + k), ("B", k)]
    seq += [("B", k) for k in range(num_slots - warmup, num_slots)]
    return seq


def stage_program(num_stages: int, stage: int, num_slots: int) -> list[Op]:
    """Compute and communication ops of one stage, in the deadlock-free order (module docstring)."""
    if not 0 <= stage < num_stages or num_slots < 1:
        raise ValueError(f"no stage {stage} in a {num_stages}-stage pipeline with {num_slots} slots")
    first, last = stage == 0, stage == num_stages - 1
    seq = compute_order(num_stages, stage, num_slots)
    ops: list[Op] = []
    received: set[int] = set()
    for i, (kind, m) in enumerate(seq):
        if kind == "F":
            if not first and m not in received:
                ops.append(Op("recv_f", m))
            ops.append(Op("fwd", m))
            if not last:
                ops.append(Op("send_f", m))
            continue
        if not last:
            ops.append(Op("recv_b", m))
        ops.append(Op("bwd", m))
        nxt = seq[i + 1] if i + 1 < len(seq) else None
        if nxt is not None and nxt[0] == "F" and not first:
            ops.append(Op("recv_f", nxt[1]))  # hoisted before send_b: see module docstring
            received.add(nxt[1])
        if not first:
            ops.append(Op("send_b", m))
    return ops


@dataclass(frozen=True)
class Route:
    """`samples` (global, within the step) exchanged with `peer`; `offset` is where they start in
    this rank's own slice of the slot."""

    peer: int
    samples: SampleRange
    offset: int


def routes(layout: Layout, rank: int, slot: int, toward: Literal["next", "prev"]) -> list[Route]:
    """Peers of `rank` in the adjacent stage for slot `slot`, in increasing sample order."""
    stage = layout.stage_of_rank(rank)
    other = stage + 1 if toward == "next" else stage - 1
    if not 0 <= other < layout.num_stages:
        raise ValueError(f"stage {stage} has no {toward} stage")
    mine = layout.samples_of(rank, slot)
    out = []
    peers = layout.stages[other]
    for peer, theirs in zip(peers.ranks, peers.split_slot(layout.slot_range(slot)), strict=True):
        overlap = mine.intersect(theirs)
        if len(overlap):
            out.append(Route(peer, overlap, overlap.start - mine.start))
    return sorted(out, key=lambda r: r.samples.start)


def _empty(spec: ActivationSpec, rows: int, device: torch.device, grads_only: bool) -> list[torch.Tensor]:
    return [
        torch.empty(rows, *t.shape, dtype=t.dtype, device=device)
        for t in spec.tensors
        if t.carries_grad or not grads_only
    ]


class PipelineRunner:
    """Runs one step's 1F1B program for one rank.

    `forward(slot, inputs)` returns the stage output of the slot (`inputs` is None on the first
    stage; elsewhere the received activation, a tensor or tuple whose floating-point tensors are
    leaves that require grad); on the last stage it returns the scalar loss to backpropagate.
    The runner does the backward itself, calls `after_backward(slot)`, and sends the inputs'
    gradients upstream (floating-point tensors only; an input the stage did not use gets zeros).
    `in_spec` / `out_spec` are the activations entering and leaving the stage (None at the ends).
    A slot in which this rank has no samples is skipped without any message.
    """

    def __init__(
        self,
        comm: EngineComm,
        layout: Layout,
        rank: int,
        in_spec: ActivationSpec | None,
        out_spec: ActivationSpec | None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.comm, self.layout, self.rank = comm, layout, rank
        self.device = torch.device(device)
        self.stage = layout.stage_of_rank(rank)
        if (in_spec is None) != (self.stage == 0) or (out_spec is None) != (
            self.stage == layout.num_stages - 1
        ):
            raise ValueError(
                f"stage {self.stage} of {layout.num_stages}: activation specs must be given exactly "
                "at the stage boundaries that exist"
            )
        self.in_spec, self.out_spec = in_spec, out_spec
        self.program = stage_program(layout.num_stages, self.stage, layout.num_micro_batches)

    def _group(self, toward: Literal["next", "prev"]) -> str:
        return pp_group_name(self.stage if toward == "next" else self.stage - 1)

    def _recv(
        self, slot: int, toward: Literal["next", "prev"], spec: ActivationSpec, grads_only: bool
    ) -> list[torch.Tensor]:
        bufs = _empty(spec, len(self.layout.samples_of(self.rank, slot)), self.device, grads_only)
        for r in routes(self.layout, self.rank, slot, toward):
            for buf in bufs:
                piece = torch.empty(len(r.samples), *buf.shape[1:], dtype=buf.dtype, device=self.device)
                self.comm.recv(self._group(toward), piece, r.peer)
                buf[r.offset : r.offset + len(r.samples)] = piece
        return bufs

    def _send(self, slot: int, toward: Literal["next", "prev"], tensors: list[torch.Tensor]) -> None:
        for r in routes(self.layout, self.rank, slot, toward):
            for t in tensors:
                self.comm.send(
                    self._group(toward), t[r.offset : r.offset + len(r.samples)].contiguous(), r.peer
                )

    def _received(self, slot: int) -> Activation:
        assert self.in_spec is not None
        bufs = self._recv(slot, "prev", self.in_spec, grads_only=False)
        for buf, t in zip(bufs, self.in_spec.tensors, strict=True):
            if t.carries_grad:
                buf.requires_grad_(True)
        return tuple(bufs) if self.in_spec.is_tuple else bufs[0]

    def _outgoing(self, out: Activation) -> list[torch.Tensor]:
        assert self.out_spec is not None
        items = as_tuple(out)
        if (
            ActivationSpec(
                tuple(TensorSpec(tuple(t.shape[1:]), t.dtype) for t in items), isinstance(out, tuple)
            )
            != self.out_spec
        ):
            raise ValueError(
                f"stage {self.stage} produced {ActivationSpec.of(out)}, the dry run found "
                f"{self.out_spec}: activations must keep their per-sample shape and dtype"
            )
        return [t.detach() for t in items]

    def _backward(self, out: Activation, grads: list[torch.Tensor] | None) -> None:
        if grads is None:  # the last stage: `out` is the scalar loss
            assert isinstance(out, torch.Tensor)
            out.backward()
            return
        assert self.out_spec is not None
        floats = [
            t for t, spec in zip(as_tuple(out), self.out_spec.tensors, strict=True) if spec.carries_grad
        ]
        pairs = [(t, g) for t, g in zip(floats, grads, strict=True) if t.requires_grad]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])

    def _input_grads(self, received: Activation) -> list[torch.Tensor]:
        assert self.in_spec is not None
        return [
            t.grad if t.grad is not None else torch.zeros_like(t)
            for t, spec in zip(as_tuple(received), self.in_spec.tensors, strict=True)
            if spec.carries_grad
        ]

    def run(
        self,
        forward: Callable[[int, Activation | None], Activation],
        after_backward: Callable[[int], None] | None = None,
        before_last_backward: Callable[[], None] | None = None,
    ) -> None:
        """Run the program. `before_last_backward` is called right before this rank's last
        backward of the step (when every gradient that backward adds to is final after it)."""
        last_bwd = max(
            (
                i
                for i, op in enumerate(self.program)
                if op.kind == "bwd" and len(self.layout.samples_of(self.rank, op.slot)) > 0
            ),
            default=-1,
        )
        inputs: dict[int, Activation] = {}
        outputs: dict[int, Activation] = {}
        grads_from_next: dict[int, list[torch.Tensor]] = {}
        grads_to_prev: dict[int, list[torch.Tensor]] = {}
        for i, op in enumerate(self.program):
            m = op.slot
            if len(self.layout.samples_of(self.rank, m)) == 0:
                continue
            if op.kind == "recv_f":
                inputs[m] = self._received(m)
            elif op.kind == "fwd":
                outputs[m] = forward(m, inputs.get(m))
            elif op.kind == "send_f":
                self._send(m, "next", self._outgoing(outputs[m]))
            elif op.kind == "recv_b":
                assert self.out_spec is not None
                grads_from_next[m] = self._recv(m, "next", self.out_spec, grads_only=True)
            elif op.kind == "bwd":
                if i == last_bwd and before_last_backward is not None:
                    before_last_backward()
                self._backward(outputs.pop(m), grads_from_next.pop(m, None))
                received = inputs.pop(m, None)
                if received is not None:
                    grads_to_prev[m] = self._input_grads(received)
                if after_backward is not None:
                    after_backward(m)
            else:  # send_b
                self._send(m, "prev", grads_to_prev.pop(m))
