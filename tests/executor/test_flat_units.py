"""Flat per-unit buffers (executor.flat_units, issue 23): the parameters and gradients of a unit
are views of one buffer each, the ZeRO-1 step reads, updates and writes the owners' intervals in
place (no concatenation, no owned-slice copy, the all-gather received into the parameter buffer),
and the results are bit-identical to the copying path. Two DP ranks run as threads of this
process over gloo (a HashStore), so these are in-process tests."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed import HashStore

from executor.comm.errors import PeerFailure
from executor.engine_comm import StaticComm, groups_for_stage_ranks
from executor.flat_units import FlatUnit, as_flat_view, flat_params
from executor.optim import OptimizerConfig, UnitSlice
from executor.trainer import Trainer
from executor.zero import Interval, ShardedOptimizer
from executor.zero_exchange import GATHER_TAG
from tests.executor.engine_cases import NUM_UNITS, gpt_spec, layout

GROUP = "dp/0"
_SEEDING = threading.Lock()  # the ranks are threads: one global RNG


def _units() -> dict[str, nn.Module]:
    with _SEEDING:
        torch.manual_seed(0)
        return {"a": nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)), "b": nn.Linear(3, 4)}


def _ownership(units: dict[str, nn.Module], swapped: bool) -> dict[str, list[Interval]]:
    """Two owners per unit; `swapped` gives unit b's first interval to DP rank 1 (not DP order)."""
    out: dict[str, list[Interval]] = {}
    for name, unit in units.items():
        n = sum(p.numel() for p in unit.parameters())
        cut = n // 2 + 1
        out[name] = [(cut, n), (0, cut)] if swapped and name == "b" else [(0, cut), (cut, n)]
    return out


def _both(
    store: HashStore, body: Callable[[ShardedOptimizer, dict[str, nn.Module], int], Any], **kw: Any
) -> list[Any]:
    """Run `body(optimizer, units, rank)` on DP ranks 0 and 1 (threads), return both results."""
    results: list[Any] = [None, None]
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            comm = StaticComm(store, rank, groups_for_stage_ranks([(0, 1)], world=True), timeout_s=30)
            units = _units()
            cfg = OptimizerConfig("adamw", lr=1e-2, weight_decay=0.01, max_grad_norm=0.5)
            own = _ownership(units, kw["swapped"])
            # bucket_min 0 by default: every unit its own exchange (the tiny units would share one)
            bucket = kw.get("bucket_min", 0)
            opt = ShardedOptimizer(comm, GROUP, units, own, rank, cfg, flat=kw["flat"], bucket_min=bucket)
            results[rank] = body(opt, units, rank)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


def _backward(units: dict[str, nn.Module], step: int, rank: int) -> None:
    """Two micro-batches of rank-dependent data, accumulated."""
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * step + rank))
    for mb in range(2):
        units["b"](units["a"](x[2 * mb : 2 * mb + 2])).pow(2).sum().backward()


class _SpyConfig:
    """An OptimizerConfig that records the parameter slice each update is applied to."""

    def __init__(self, cfg: OptimizerConfig, seen: list[tuple[str, torch.Tensor]]) -> None:
        self._cfg, self._seen = cfg, seen

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cfg, name)

    def update_slices(self, slices: Sequence[UnitSlice], *args: Any) -> None:
        self._seen.extend(("update", s.param) for s in slices)
        self._cfg.update_slices(slices, *args)


def _train(steps: int) -> Callable[[ShardedOptimizer, dict[str, nn.Module], int], Any]:
    def body(opt: ShardedOptimizer, units: dict[str, nn.Module], rank: int) -> Any:
        for step in range(steps):
            opt.zero_grads()
            _backward(units, step, rank)
            opt.step()
        params = {n: torch.cat([p.detach().reshape(-1) for p in u.parameters()]) for n, u in units.items()}
        return params, opt.state()

    return body


@pytest.mark.parametrize("swapped", [False, True])
@pytest.mark.parametrize("bucket_min", [0, 1 << 20])
def test_flat_and_copying_paths_agree_bitwise(swapped: bool, bucket_min: int) -> None:
    """Per-unit in place, or both units in one bucket (copied), against the copying path."""
    flat = _both(HashStore(), _train(4), flat=True, swapped=swapped, bucket_min=bucket_min)
    copying = _both(HashStore(), _train(4), flat=False, swapped=swapped)
    for (fp, fs), (cp, cs) in zip(flat, copying, strict=True):
        assert all(torch.equal(fp[n], cp[n]) for n in fp)
        for n, (lo, hi, m, v) in fs["shards"].items():
            assert (lo, hi) == cs["shards"][n][:2]
            assert torch.equal(m, cs["shards"][n][2]) and torch.equal(v, cs["shards"][n][3])
    # the parameters did move, and both ranks agree
    assert not torch.equal(
        flat[0][0]["a"], torch.cat([p.detach().reshape(-1) for p in _units()["a"].parameters()])
    )
    assert all(torch.equal(flat[0][0][n], flat[1][0][n]) for n in flat[0][0])


def test_the_step_addresses_the_flat_buffers_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    cats: list[int] = []
    real_cat = torch.cat

    def counting_cat(*a: Any, **k: Any) -> torch.Tensor:
        cats.append(1)
        return real_cat(*a, **k)

    monkeypatch.setattr(torch, "cat", counting_cat)
    seen: dict[int, list[tuple[str, torch.Tensor]]] = {0: [], 1: []}

    def body(opt: ShardedOptimizer, units: dict[str, nn.Module], rank: int) -> Any:
        comm = opt.exchange.comm
        real_post = comm.post_exchange

        real_alltoall = opt.exchange._alltoall

        def post_exchange(sends: Any, recvs: Any) -> Any:  # the all-gather, point to point on the host
            for kind, ops in (("send", sends), ("recv", recvs)):
                for _group, t, _peer, tag in ops:
                    assert tag >= GATHER_TAG
                    seen[rank].append((f"gather {kind}", t))
            return real_post(sends, recvs)

        def alltoall(out: torch.Tensor, sent: torch.Tensor, *args: Any) -> Any:  # the reduce-scatter
            seen[rank].append(("reduce send", sent))
            return real_alltoall(out, sent, *args)

        opt.cfg = _SpyConfig(opt.cfg, seen[rank])  # type: ignore[assignment]
        monkeypatch.setattr(comm, "post_exchange", post_exchange)
        monkeypatch.setattr(opt.exchange, "_alltoall", alltoall)
        opt.zero_grads()
        _backward(units, 0, rank)
        grads_are_views = all(
            p.grad is not None
            and p.grad.untyped_storage().data_ptr() == opt.flats[n].grad.untyped_storage().data_ptr()
            for n, u in units.items()
            for p in u.parameters()
        )
        opt.step()
        return opt, grads_are_views

    results = _both(HashStore(), body, flat=True, swapped=False)
    assert not cats, "the flat ZeRO-1 step concatenated"
    for rank, (opt, grads_are_views) in enumerate(results):
        assert grads_are_views
        for name, flat in opt.flats.items():
            ptr = flat.flat.untyped_storage().data_ptr()
            assert all(p.untyped_storage().data_ptr() == ptr for p in flat.unit.parameters())
            assert as_flat_view([p.detach() for p in flat.unit.parameters()]) is not None
            intervals = opt.ownership[name]
            where = {  # the message -> the buffer and the owner whose interval it must be, in place
                "update": (flat.flat, rank),
                "gather send": (flat.flat, rank),  # my updated slice, sent from where it lies
                "gather recv": (flat.flat, 1 - rank),  # the other owner's, received where it goes
            }
            ops = dict.fromkeys(where, 0)
            for kind, t in seen[rank]:
                if (
                    kind in where
                    and t.untyped_storage().data_ptr() == where[kind][0].untyped_storage().data_ptr()
                ):
                    buffer, owner = where[kind]
                    lo, hi = intervals[owner]
                    assert (t.storage_offset(), t.numel()) == (buffer.storage_offset() + lo, hi - lo), kind
                    ops[kind] += 1
            assert ops == dict.fromkeys(where, 1), (rank, name, ops)
            # the reduce-scatter sends the gradient buffer itself, cut by owner in gloo
            assert [
                t.numel()
                for k, t in seen[rank]
                if k == "reduce send" and t.data_ptr() == flat.grad.data_ptr()
            ] == [flat.numel]
    # the spy can fail: the copying path concatenates
    _both(HashStore(), _train(1), flat=False, swapped=False)
    assert cats


def test_a_re_pointed_parameter_or_replaced_grad_is_taken_again() -> None:
    def body(opt: ShardedOptimizer, units: dict[str, nn.Module], rank: int) -> Any:
        for step in range(3):
            opt.zero_grads()
            _backward(units, step, rank)
            if step == 1:  # someone replaces a gradient and re-points a parameter mid-step
                seq = units["a"]
                assert isinstance(seq, nn.Sequential)
                lin = seq[0]
                assert isinstance(lin, nn.Linear) and lin.weight.grad is not None
                lin.weight.grad = lin.weight.grad.clone()
                lin.bias.data = lin.bias.detach().clone()
            opt.step()
        return _train(0)(opt, units, rank), opt.flats["a"].intact()

    moved = _both(HashStore(), body, flat=True, swapped=False)
    plain = _both(HashStore(), _train(3), flat=True, swapped=False)
    for ((mp, ms), intact), (pp, ps) in zip(moved, plain, strict=True):
        assert intact
        assert all(torch.equal(mp[n], pp[n]) for n in mp)
        assert all(torch.equal(ms["shards"][n][2], ps["shards"][n][2]) for n in ms["shards"])


def test_a_step_checks_each_flat_unit_before_its_backward_and_before_its_update(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step reads each unit five times (clear, reduce-scatter, update, all-gather, write-back);
    the module tree is walked twice (at the clear, and once the backward is over), and every use
    after the step walks it again, so a parameter re-pointed between steps is still noticed."""
    checks: dict[int, list[str]] = {0: [], 1: []}
    whose: dict[int, tuple[int, str]] = {}  # id(flat unit) -> (rank, unit)
    real_intact = FlatUnit.intact

    def counted(flat: FlatUnit) -> bool:
        rank, name = whose[id(flat)]
        checks[rank].append(name)
        return real_intact(flat)

    monkeypatch.setattr(FlatUnit, "intact", counted)

    def body(opt: ShardedOptimizer, units: dict[str, nn.Module], rank: int) -> Any:
        whose.update({id(f): (rank, n) for n, f in opt.flats.items()})
        for step in range(2):
            checks[rank].clear()
            opt.zero_grads()
            _backward(units, step, rank)
            opt.step()
            assert sorted(checks[rank]) == ["a", "a", "b", "b"], checks[rank]
        seq = units["a"]
        assert isinstance(seq, nn.Sequential)
        lin = seq[0]
        assert isinstance(lin, nn.Linear)
        lin.bias = nn.Parameter(lin.bias.detach().clone())  # between steps: a load with assign=True
        vec = opt.exchange.param_vector("a")
        assert vec is not None and _same_storage(vec, lin.bias)  # adopted again before its use
        return True

    assert _both(HashStore(), body, flat=True, swapped=False, bucket_min=1 << 20) == [True, True]


@pytest.mark.parametrize(
    "change", ["parameter", "submodule", "nested", "shared", "added", "removed", "data", "reordered"]
)
def test_a_flat_unit_notices_every_change_that_re_points_a_parameter(change: str) -> None:
    shared = nn.Linear(2, 2)  # one submodule in two places of the tree (parameters() lists it once)
    unit = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Sequential(nn.Linear(4, 2), shared, shared))
    flat = FlatUnit(unit)
    assert flat.intact()
    first, inner = unit[0], unit[2]
    assert isinstance(first, nn.Linear) and isinstance(inner, nn.Sequential)
    if change == "parameter":
        first.weight = nn.Parameter(first.weight.detach().clone())
    elif change == "submodule":
        unit[2] = nn.Linear(4, 2)
    elif change == "nested":  # two levels down
        deep = inner[0]
        assert isinstance(deep, nn.Linear)
        deep.bias = nn.Parameter(deep.bias.detach().clone())
    elif change == "shared":  # the shared module's parameter, seen through either place
        shared.weight = nn.Parameter(shared.weight.detach().clone())
    elif change == "added":
        first.extra = nn.Parameter(torch.zeros(1))
    elif change == "removed":
        first.bias = None  # type: ignore[assignment]  # a Linear may hold no bias; the stub says it always does
    elif change == "data":
        first.bias.data = first.bias.detach().clone()
    else:  # the same parameters, in another order: parameters() changes order
        weight, bias = first._parameters.pop("weight"), first._parameters.pop("bias")
        first._parameters["bias"], first._parameters["weight"] = bias, weight
    assert not flat.intact()
    flat.ensure()  # adopted again: the values kept, views of one buffer once more
    assert flat.intact()
    assert as_flat_view([p.detach() for p in unit.parameters()]) is not None


def test_flat_unit_reads_what_grad_says() -> None:
    unit = nn.Linear(3, 2)
    flat = FlatUnit(unit)
    flat.zero_grads()
    unit(torch.ones(1, 3)).sum().backward()
    assert torch.equal(flat.grads()[:6], torch.ones(6)) and torch.equal(flat.grads()[6:], torch.ones(2))
    unit.weight.grad = torch.full((2, 3), 2.0)
    unit.bias.grad = None
    assert torch.equal(flat.grads(), torch.tensor([2.0] * 6 + [0.0] * 2))
    with pytest.raises(ValueError, match="floating-point"):
        FlatUnit(nn.Module())


def test_trainer_units_are_flat_after_steps() -> None:
    lay = layout([(0, NUM_UNITS)], [(0,)])
    trainer = Trainer(
        gpt_spec(0.1), lay, 0, StaticComm(HashStore(), 0, groups_for_stage_ranks([(0,)]), timeout_s=10)
    )
    for step in range(2):
        trainer.train_step(step)
    assert set(trainer.optimizer.flats) == set(trainer.unit_names)
    for name, unit in trainer.model.units.items():
        flat = trainer.optimizer.flats[name]
        assert all(
            p.untyped_storage().data_ptr() == flat.flat.untyped_storage().data_ptr()
            for p in unit.parameters()
        )
        assert all(
            p.grad is None or p.grad.untyped_storage().data_ptr() == flat.grad.untyped_storage().data_ptr()
            for p in unit.parameters()
        )


def _on_rank_threads(rank_main: Callable[[int], None], ranks: int) -> None:
    """Run `rank_main(rank)` for every rank on its own thread; re-raise the first error here."""
    errors: list[BaseException] = []

    def guarded(rank: int) -> None:
        try:
            rank_main(rank)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]


def _trainers(overlap: bool, steps: int) -> tuple[dict[int, Any], dict[int, int]]:
    """PP=2 x DP=2 (threads), dropout on: every rank's parameters, shards and losses after
    `steps`, and how many of its units' reduce-scatters had started when the backward ended."""
    ranks = [(0, 1), (2, 3)]
    lay = layout([(0, 3), (3, NUM_UNITS)], ranks)
    store, groups = HashStore(), groups_for_stage_ranks(ranks, world=True)
    out: dict[int, Any] = {}
    early: dict[int, int] = {}

    def rank_main(rank: int) -> None:
        comm = StaticComm(store, rank, groups, timeout_s=30)  # a rendezvous: not under the lock
        with _SEEDING:
            trainer = Trainer(gpt_spec(0.1), lay, rank, comm)
        trainer.overlap_exchange = overlap
        launcher = trainer.optimizer.exchange.launcher
        finish = launcher.finish

        def counted_finish() -> None:
            early[rank] = early.get(rank, 0) + launcher.started
            finish()

        launcher.finish = counted_finish  # type: ignore[method-assign]
        losses = [trainer.train_step(s).loss for s in range(steps)]
        out[rank] = (trainer.unit_params(), trainer.optimizer.state(), losses)

    _on_rank_threads(rank_main, 4)
    return out, early


def test_overlapped_exchange_gives_the_same_state_as_the_exchange_after_backward() -> None:
    overlapped, early = _trainers(True, 4)
    after, late = _trainers(False, 4)
    assert all(n > 0 for n in early.values()), early  # exchanges did start during the backward
    assert not any(late.values()), late
    for rank, (params, opt, losses) in overlapped.items():
        ref_params, ref_opt, ref_losses = after[rank]
        assert losses == ref_losses
        assert all(torch.equal(params[n], ref_params[n]) for n in params)
        assert opt["step_count"] == ref_opt["step_count"] == 4
        for n, (lo, hi, m, v) in opt["shards"].items():
            assert (lo, hi) == ref_opt["shards"][n][:2]
            assert torch.equal(m, ref_opt["shards"][n][2]) and torch.equal(v, ref_opt["shards"][n][3])


class _InjectedFailure(RuntimeError):
    """Raised on the last stage right after the overlap armed its hooks (a peer lost then)."""


def _relayout_after(fail_at: int | None, steps: int) -> dict[int, Any]:
    """PP=2 x DP=2 (threads), overlap on: steps 0..1, then (when `fail_at` is set) the last
    stage raises right after arming the overlap in step `fail_at` and the first stage times
    out waiting for its gradients; every rank then adopts the layout again with its state over
    a new communicator (what a recovery does), and runs the rest. Returns each rank's params."""
    ranks = [(0, 1), (2, 3)]
    lay = layout([(0, 3), (3, NUM_UNITS)], ranks)
    groups = groups_for_stage_ranks(ranks, world=True)
    stores = [HashStore(), HashStore()]
    out: dict[int, Any] = {}

    def rank_main(rank: int) -> None:
        comm = StaticComm(stores[0], rank, groups, timeout_s=3, namespace="before")
        with _SEEDING:
            trainer = Trainer(gpt_spec(0.1), lay, rank, comm)
        trainer.overlap_exchange = True
        for step in range(2):
            trainer.train_step(step)
        if fail_at is not None:
            if trainer.is_last:
                arm = trainer.optimizer.overlap_backward

                def arm_then_fail() -> None:
                    arm()
                    raise _InjectedFailure("peer lost in the backward")

                trainer.optimizer.overlap_backward = arm_then_fail  # type: ignore[method-assign]
            with pytest.raises((_InjectedFailure, RuntimeError)):
                trainer.train_step(fail_at)
        new_comm = StaticComm(stores[1], rank, groups, timeout_s=30, namespace="after")
        shards = trainer.optimizer.shards
        trainer.reset_layout(lay, new_comm, trainer.unit_params(), shards, trainer.optimizer.step_count, 2)
        for step in range(2, steps):
            trainer.train_step(step)
        out[rank] = trainer.unit_params()

    _on_rank_threads(rank_main, 4)
    return out


def test_a_step_that_fails_in_an_armed_backward_leaves_no_hook_behind_on_the_next_layout() -> None:
    """The overlap's hooks armed by a step that raised must not fire in the backwards of the
    layout adopted after it (they counted its gradients twice: `make demo` after a node loss)."""
    failed, clean = _relayout_after(2, 4), _relayout_after(None, 4)
    assert sorted(failed) == sorted(clean) == [0, 1, 2, 3]
    for rank, params in failed.items():
        assert all(torch.equal(params[n], clean[rank][n]) for n in params), rank


def test_an_abandoned_all_gather_leaves_its_late_receives_no_way_into_the_parameters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0 posts its first unit's all-gather (the peer's slice received in place into the
    unit's parameters), then its next post fails (a lost peer). A receive that is still posted
    then (gloo cancels one once its work is gone, so this test keeps the works, as a traceback
    or a device collective would) is completed by the straggling rank 1 after rank 0 gave up:
    it lands in the old buffer, never in the parameters rank 0 rolls back."""
    rank0_gave_up, kept = threading.Event(), []
    seen: dict[int, Any] = {}

    def body(opt: ShardedOptimizer, units: dict[str, nn.Module], rank: int) -> Any:
        comm, posts = opt.exchange.comm, []
        real_post = comm.post_exchange

        def post_exchange(sends: Any, recvs: Any) -> Any:
            if not sends or sends[0][3] < GATHER_TAG:
                return real_post(sends, recvs)
            posts.append(next(n for n, f in opt.flats.items() if _same_storage(recvs[0][1], f.flat)))
            if len(posts) == 1:
                seen[rank] = recvs[0][1]  # where the peer's slice of the first unit is received
            if len(posts) == 2:
                raise PeerFailure(GROUP, "test: the peer is lost")
            if rank == 1:
                assert rank0_gave_up.wait(30)  # the straggler
            ops = real_post(sends, recvs)
            kept.append((rank, ops))
            return ops

        monkeypatch.setattr(comm, "post_exchange", post_exchange)
        opt.zero_grads()
        _backward(units, 0, rank)
        with pytest.raises(PeerFailure):
            opt.step()
        target = posts[0]
        # the exchange keeps the buffer the receive was posted into, for a device collective
        # that may write it until its group is aborted
        assert any(_same_storage(seen[rank], kept_buffer) for kept_buffer in opt.exchange._orphans)
        seen[rank] = (opt.flats[target], seen[rank], flat_params(units[target]))
        if rank == 0:
            rank0_gave_up.set()
        return target

    targets = _both(HashStore(), body, flat=True, swapped=False)
    assert targets[0] == targets[1]
    for work in (w for _rank, ops in kept for w in ops):
        work.wait(timedelta(seconds=30))  # every late message has landed
    flat, old_receive, at_failure = seen[0]
    assert torch.equal(flat_params(flat.unit), at_failure)  # the late slice is not in it
    assert not _same_storage(old_receive, flat.flat)  # moved off the buffer it received into
    lo = (
        old_receive.storage_offset() - old_receive._base.storage_offset()
        if old_receive._base is not None
        else 0
    )
    assert not torch.equal(old_receive, at_failure[lo : lo + old_receive.numel()])  # it landed there


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
