"""Tied weights: one parameter used by two units (an input embedding reused by the LM head).

Declared as `Units(..., tied=[("embed.embed_tokens.weight", "head.lm_head.weight")])` (or found
by `Units.from_modules` when two modules share a parameter). The earlier unit's parameter is the
*leader*, the later one's the *follower*; each unit keeps its own parameter slot, so every unit
keeps its size, its flat vector and its ZeRO-1 shards on every layout, and migration, remap,
snapshots and checkpoints move it whole as before.

- **Same stage** (always in one process): `tie_stage` makes the follower's slot hold the leader's
  `Parameter` object, so autograd accumulates both uses into one gradient, exactly as in the
  `transformers` model. Both units' optimizer slices see that same reduced gradient and equal
  moments, so both apply the same update to the same bits.
- **Different stages** (Megatron-LM's scheme, as in its embedding group): the leader's stage and
  the follower's stage each hold a copy. Every step, before the optimizer, `TiedGradSync` sums the
  stage's gradient over its DP ranks in DP order (the order ZeRO uses), swaps that sum with the
  paired rank of the other stage, and adds the two: `E + H == H + E` bit for bit, so both copies
  get the same gradient and, with equal moments, the same update. The sum goes to DP index 0 and
  the other DP ranks contribute zeros, so ZeRO's reduce-scatter passes it through unchanged. The
  copies' checksums travel with the gradients and are compared every step: a mismatch raises.

The follower's copy is what the leader's is, so a checkpoint stores only the leader's
(`executor.checkpoint`), and the follower's elements are left out of the global gradient norm.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from executor.comm.groups import WORLD_GROUP
from executor.engine_comm import EngineComm, dp_group_name


class TiedWeightError(RuntimeError):
    """Two copies of a tied weight differ: the invariant that keeps them equal was broken."""


@dataclass(frozen=True)
class TiedPair:
    """`leader` and `follower` are `(unit, parameter name inside the unit)`; the leader's unit
    comes first in the model."""

    leader: tuple[str, str]
    follower: tuple[str, str]

    @property
    def keys(self) -> tuple[str, str]:
        return f"{self.leader[0]}.{self.leader[1]}", f"{self.follower[0]}.{self.follower[1]}"


def parse_ties(tied: Iterable[tuple[str, str]], names: Sequence[str]) -> tuple[TiedPair, ...]:
    """Validate `[("unit.param", "unit.param"), ...]` against the unit names; order each pair."""
    pairs: list[TiedPair] = []
    seen: set[tuple[str, str]] = set()
    for item in tied:
        if not (isinstance(item, tuple | list) and len(item) == 2 and all(isinstance(k, str) for k in item)):
            raise ValueError(f"tied entries are ('unit.param', 'unit.param') pairs, got {item!r}")
        ends = [tuple(k.split(".", 1)) for k in item]
        for key, end in zip(item, ends, strict=True):
            if len(end) != 2 or end[0] not in names:
                raise ValueError(
                    f"tied key {key!r} must be '<unit>.<parameter>' with a unit of {list(names)}"
                )
        a, b = (ends[0][0], ends[0][1]), (ends[1][0], ends[1][1])
        if a[0] == b[0]:
            raise ValueError(f"tied pair {item!r} is inside one unit: share the module there, no tie needed")
        if names.index(a[0]) > names.index(b[0]):
            a, b = b, a
        if a in seen or b in seen:
            raise ValueError(
                f"{item!r}: a parameter may be tied to one other only (Megatron-style pairs); "
                "tie each further use to the same leader is not supported: give it its own copy"
            )
        seen.update((a, b))
        pairs.append(TiedPair(a, b))
    return tuple(pairs)


def get_param(unit: nn.Module, name: str) -> nn.Parameter:
    try:
        p = unit.get_parameter(name)
    except AttributeError as exc:
        raise ValueError(f"tied parameter {name!r} does not exist ({exc})") from exc
    return p


def _set_param(unit: nn.Module, name: str, param: nn.Parameter) -> None:
    owner, _, attr = name.rpartition(".")
    module = unit.get_submodule(owner) if owner else unit
    module._parameters[attr] = param  # same slot: keeps parameters() order, hence the flat layout


def tie_stage(units: Mapping[str, nn.Module], pairs: Sequence[TiedPair]) -> None:
    """Make every pair whose two units are both here one shared parameter (module docstring)."""
    for pair in pairs:
        if pair.leader[0] in units and pair.follower[0] in units:
            leader = get_param(units[pair.leader[0]], pair.leader[1])
            follower = get_param(units[pair.follower[0]], pair.follower[1])
            if follower is not leader:  # values: the caller assigns the state it adopts
                _set_param(units[pair.follower[0]], pair.follower[1], leader)


def checksum(t: torch.Tensor) -> torch.Tensor:
    """An order-sensitive integer digest of a tensor's exact bits (int64, wraps on overflow)."""
    bits = t.detach().reshape(-1).contiguous().view(torch.int32).to(torch.int64)
    weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device) % 65521 + 1
    return (bits * weights).sum().reshape(1)


class TiedGradSync:
    """The cross-stage half of tying (module docstring), for one rank of one layout."""

    def __init__(
        self,
        comm: EngineComm,
        pairs: Sequence[TiedPair],
        unit_stage: Mapping[str, int],
        stage_ranks: Sequence[Sequence[int]],
        rank: int,
    ) -> None:
        self.comm, self.rank = comm, rank
        self.stage_ranks = [tuple(r) for r in stage_ranks]
        self.stage = next(s for s, ranks in enumerate(self.stage_ranks) if rank in ranks)
        self.pairs = [
            p
            for p in pairs
            if unit_stage[p.leader[0]] != unit_stage[p.follower[0]]
            and self.stage in (unit_stage[p.leader[0]], unit_stage[p.follower[0]])
        ]
        self.unit_stage = dict(unit_stage)

    @property
    def active(self) -> bool:
        return bool(self.pairs)

    def sync(self, units: Mapping[str, nn.Module]) -> None:
        """Give both copies of every cross-stage pair the gradient of the whole tied weight."""
        for pair in self.pairs:
            mine, other = (pair.leader, pair.follower)
            if self.unit_stage[pair.follower[0]] == self.stage:
                mine, other = other, mine
            param = get_param(units[mine[0]], mine[1])
            if not param.requires_grad:  # frozen together (checked by the dry run): nothing to add
                continue
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            total = self._stage_sum(grad.detach())
            theirs = self._swap(total, checksum(param), self.unit_stage[other[0]])
            peer_grad, peer_sum = theirs
            if not torch.equal(peer_sum, checksum(param)):
                raise TiedWeightError(
                    f"the copies of tied weight {pair.keys} differ between stage "
                    f"{self.unit_stage[pair.leader[0]]} and stage {self.unit_stage[pair.follower[0]]}"
                )
            whole = total + peer_grad  # commutative: the same bits on both stages
            dp = self.stage_ranks[self.stage]
            param.grad = whole if dp.index(self.rank) == 0 else torch.zeros_like(whole)

    def _stage_sum(self, grad: torch.Tensor) -> torch.Tensor:
        """Sum of the stage's local gradients, added in DP order (as ZeRO adds them)."""
        dp = self.stage_ranks[self.stage]
        if len(dp) == 1:
            return grad.clone()
        parts = [torch.empty_like(grad) for _ in dp]
        self.comm.all_gather(dp_group_name(self.stage), parts, grad.contiguous())
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total

    def _swap(
        self, total: torch.Tensor, digest: torch.Tensor, other_stage: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Send my stage's sum to my partners of `other_stage` and receive theirs. DP index j pairs
        with j mod (the smaller DP size): the larger stage's extra ranks only receive."""
        mine, theirs = self.stage_ranks[self.stage], self.stage_ranks[other_stage]
        j, m = mine.index(self.rank), min(len(mine), len(theirs))
        src = theirs[j % m]
        sends = [] if j >= m else [theirs[k] for k in range(j, len(theirs), m)]
        got, got_sum = torch.empty_like(total), torch.empty_like(digest)
        ops = [(WORLD_GROUP, t, peer, tag) for peer in sends for tag, t in ((1, total), (2, digest))]
        recvs = [(WORLD_GROUP, got, src, 1), (WORLD_GROUP, got_sum, src, 2)]
        self.comm.complete(self.comm.post_exchange(ops, recvs))
        return got, got_sum


def flat_range(unit: nn.Module, name: str) -> tuple[int, int]:
    """`[lo, hi)` of parameter `name` in the unit's flat vector (`parameters()` order)."""
    pos = 0
    for pname, p in unit.named_parameters():
        if pname == name:
            return pos, pos + p.numel()
        pos += p.numel()
    raise ValueError(f"tied parameter {name!r} does not exist")


def align_tied_flats(
    params: Mapping[str, torch.Tensor],
    units: Mapping[str, nn.Module],
    pairs: Sequence[TiedPair],
    held: set[str],
) -> dict[str, torch.Tensor]:
    """Flat parameters to adopt on a stage where a pair is one shared parameter: both members
    are written into it, so the member this rank already held gives the value (a unit still
    arriving, as in a non-blocking migration, has a placeholder until its payload lands, and that
    payload is the same bits)."""
    out = dict(params)
    for pair in pairs:
        (lu, lp), (fu, fp) = pair.leader, pair.follower
        if lu not in out or fu not in out or (lu in held) == (fu in held):
            continue
        (src, sp), (dst, dp) = ((lu, lp), (fu, fp)) if lu in held else ((fu, fp), (lu, lp))
        a, b = flat_range(units[src], sp)
        c, d = flat_range(units[dst], dp)
        out[dst] = out[dst].clone()
        out[dst][c:d] = out[src][a:b]
    return out


def follower_ranges(units: Mapping[str, nn.Module], pairs: Sequence[TiedPair]) -> dict[str, tuple[int, int]]:
    """Flat `[lo, hi)` of each follower copy held here: left out of the global gradient norm,
    which counts a tied weight once (as `clip_grad_norm_` on the `transformers` model does)."""
    out: dict[str, tuple[int, int]] = {}
    for pair in pairs:
        unit = units.get(pair.follower[0])
        if unit is not None:
            out[pair.follower[0]] = flat_range(unit, pair.follower[1])
    return out
