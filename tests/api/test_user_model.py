"""A model that is not the GPT trains on any layout exactly as in one process (docs/api.md).

The toy model (tests/api/toy_model.py) has units of different kinds and sizes, a tuple activation
with an integer member crossing stage boundaries, a Huber loss, SGD with Nesterov momentum, a
warm-up + cosine schedule, decay groups and global-norm clipping. Every layout must give the
single-process run's losses to fp32 round-off at every step, and its final parameters and
optimizer state; the single process must match plain torch.optim.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from executor.launch import JobSpec, job_losses, merged_state, run_job
from executor.optim import OptimizerConfig
from executor.reference import run_reference
from executor.sampler import GlobalBatchSampler
from executor.trainer import TrainSpec
from executor.units import UnitModel
from executor.zero import Interval
from executor.zero_exchange import UnitExchange
from planners.layout import Layout, StageLayout
from tests.api.toy_model import (
    UNITS,
    Regression,
    build_fine_tune,
    build_unit,
    huber_per_sample,
    toy_optimizer,
    toy_spec,
)

STEPS, BATCH, SLOTS = 6, 8, 2
REL = 2e-6


def toy_layout(
    bounds: list[tuple[int, int]], ranks: list[tuple[int, ...]], spec: TrainSpec | None = None
) -> Layout:
    numel = (spec or toy_spec()).unit_numels()
    stages = tuple(
        StageLayout(p, lo, hi, r) for p, ((lo, hi), r) in enumerate(zip(bounds, ranks, strict=True))
    )
    return Layout(len(UNITS), BATCH, SLOTS, stages, numel)


def assert_close_states(a: dict, b: dict, atol: float = 1e-5) -> None:
    assert a["step_count"] == b["step_count"]
    assert set(a["units"]) == set(b["units"])
    for name in a["units"]:
        for key in ("param", "exp_avg"):
            diff = float((a["units"][name][key] - b["units"][name][key]).abs().max())
            assert diff <= atol, (name, key, diff)


def test_single_process_matches_torch_optim() -> None:
    spec = toy_spec(STEPS)
    ref = run_reference(spec, BATCH, SLOTS, STEPS)
    model = nn.Sequential(*[spec.model.build(i) for i in range(len(UNITS))])
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.SGD(
        [{"params": decay, "weight_decay": 1e-3}, {"params": no_decay, "weight_decay": 0.0}],
        lr=0.2,
        momentum=0.9,
        nesterov=True,
    )
    assert spec.optimizer.schedule is not None  # the toy optimizer's warm-up + cosine
    sched = torch.optim.lr_scheduler.LambdaLR(opt, spec.optimizer.schedule)
    sampler = GlobalBatchSampler(spec.dataset, BATCH)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for slot in range(SLOTS):
            rows = sampler.rows(step, slot * BATCH // SLOTS, (slot + 1) * BATCH // SLOTS)
            x = rows.inputs
            for unit in model:
                x = unit(*x) if isinstance(x, tuple) else unit(x)
            assert isinstance(x, torch.Tensor)  # the head's output
            loss = huber_per_sample(x, rows.targets).sum() / BATCH
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        sched.step()
        losses.append(total)
    assert ref.losses == pytest.approx(losses, rel=1e-5)
    for name, unit in zip(UNITS, model, strict=True):
        flat = torch.cat([p.detach().reshape(-1) for p in unit.parameters()])
        assert torch.allclose(ref.state["units"][name]["param"], flat, atol=1e-6), name


@pytest.mark.multiproc
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "bounds, ranks",
    [
        ([(0, 3), (3, 6)], [(0, 1), (2, 3)]),  # PP=2 x DP=2; the boundary carries a tuple with an int member
        ([(0, 3), (3, 4), (4, 6)], [(0,), (1,), (2,)]),  # PP=3 x DP=1: tuples on both boundaries
        ([(0, 2), (2, 6)], [(0, 1), (2,)]),  # stages of different DP sizes
    ],
    ids=["pp2xdp2", "pp3xdp1", "dp2-dp1"],
)
def test_layouts_match_single_process(bounds: list[tuple[int, int]], ranks: list[tuple[int, ...]]) -> None:
    spec = toy_spec(STEPS)
    ref = run_reference(spec, BATCH, SLOTS, STEPS)
    results = run_job(JobSpec(spec, toy_layout(bounds, ranks), STEPS, timeout_s=60.0))
    assert job_losses(results) == pytest.approx(ref.losses, rel=REL)
    assert_close_states(merged_state(results), ref.state)


def test_frozen_parameters_are_left_alone_as_torch_optim_does() -> None:
    from torch.utils.data import TensorDataset

    import elaswave

    def build(name: str) -> nn.Module:
        unit = nn.Linear(4, 4)
        if name == "frozen":
            unit.weight.requires_grad_(False)  # a frozen weight, its bias still trains
        return unit

    units = elaswave.Units(["frozen", "head"], build)
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 4))
    result = elaswave.train(
        units,
        lambda out, y: ((out - y) ** 2).mean(1),
        data,
        global_batch=8,
        steps=3,
        optimizer=elaswave.AdamW(lr=0.1, weight_decay=0.5),
    )
    assert result.state_dict is not None
    before = units.build(0)
    assert isinstance(before, nn.Linear)
    assert torch.equal(result.state_dict["frozen.weight"], before.weight)  # neither decayed nor moved
    assert not torch.equal(result.state_dict["frozen.bias"], before.bias)


FROZEN_UNITS = ("embed", "conv")  # a frozen embedding and first block, as a fine-tune freezes them


def _build_frozen(name: str) -> nn.Module:
    unit = build_unit(name)
    if name in FROZEN_UNITS:
        unit.requires_grad_(False)
    return unit


def frozen_spec(total_steps: int) -> TrainSpec:
    return TrainSpec(
        UnitModel(UNITS, _build_frozen), huber_per_sample, Regression(), toy_optimizer(total_steps)
    )


def _exchange(
    comm: object, units: dict[str, nn.Module], ownership: dict[str, list[Interval]]
) -> UnitExchange:
    """Worker 0's exchanges over a DP group of two, every unit its own bucket, with the decay
    segments the optimizer resolves by default (`comm` None: nothing is exchanged)."""
    segments = {n: OptimizerConfig().decay_segments(u.named_parameters()) for n, u in units.items()}
    return UnitExchange(comm, "dp/0", units, ownership, dp_index=0, segments=segments, bucket_min=0)  # type: ignore[arg-type]


def test_a_wholly_frozen_unit_is_in_no_exchange() -> None:
    units = {n: _build_frozen(n) for n in UNITS}
    numel = {n: sum(p.numel() for p in u.parameters()) for n, u in units.items()}
    ownership = {n: [(0, numel[n] // 2), (numel[n] // 2, numel[n])] for n in UNITS}
    exchange = _exchange(None, units, ownership)
    assert [b for b in exchange.buckets] == [(n,) for n in reversed(UNITS) if n not in FROZEN_UNITS]
    assert exchange.active() == [n for n in UNITS if n not in FROZEN_UNITS]


class _RecordingGroup:
    """A process group that records what each personalised exchange sends (nothing arrives)."""

    def __init__(self) -> None:
        self.sent: list[list[int]] = []

    def alltoall_base(self, out: torch.Tensor, sent: torch.Tensor, out_sizes, sent_sizes, opts) -> None:
        assert sent.numel() == sum(sent_sizes) and out.numel() == sum(out_sizes)
        self.sent.append(list(sent_sizes))


class _RecordingComm:
    """Two workers' DP group, as worker 0 sees it: records the sizes of what goes out."""

    def __init__(self) -> None:
        self.group = _RecordingGroup()

    def workers(self, group: str) -> tuple[int, ...]:
        return (0, 1)

    def issue(self, group: str, post):  # noqa: ANN001, ANN201
        return post(self.group)

    def post_exchange(self, sends, recvs):  # noqa: ANN001, ANN201 - the all-gather on the host
        assert [peer for _g, _t, peer, _tag in sends] == [1] == [peer for _g, _t, peer, _tag in recvs]
        self.group.sent.append([t.numel() for _g, t, _peer, _tag in sends])

    def wait(self, group: str, works, issued: int) -> None:  # noqa: ANN001
        pass


def test_a_unit_that_trains_in_part_sends_its_trainable_elements_only() -> None:
    """LoRA and BitFit units: each owner's part of the reduce-scatter and of the all-gather holds
    exactly the trainable elements of its interval (DDP's buckets hold trainable parameters only);
    a wholly trainable unit sends its whole interval, a wholly frozen one nothing."""
    units = {n: build_fine_tune(n) for n in UNITS}
    flat = {n: torch.cat([p.detach().reshape(-1) for p in u.parameters()]) for n, u in units.items()}
    trains = {
        n: torch.cat([torch.full((p.numel(),), p.requires_grad) for p in u.parameters()])
        for n, u in units.items()
    }
    ownership = {n: [(0, len(v) // 3), (len(v) // 3, len(v))] for n, v in flat.items()}
    comm = _RecordingComm()
    exchange = _exchange(comm, units, ownership)
    expected = {
        n: [int(trains[n][lo:hi].sum()) for lo, hi in ownership[n]] for n in UNITS if bool(trains[n].any())
    }
    assert {n: [exchange.carried(n, k) for k in range(2)] for n in expected} == expected
    assert exchange.partial_runs.keys() == {"conv", "split", "mlp"}
    for unit in units.values():
        for p in unit.parameters():
            p.grad = torch.ones_like(p)
    exchange.zero_grads()
    assert all(p.grad is None or bool((p.grad == 0).all()) for u in units.values() for p in u.parameters())
    launched = [n for (n,) in exchange.buckets]
    for i in range(len(exchange.buckets)):
        exchange._launch(str(i))
    assert comm.group.sent == [expected[n] for n in launched]
    reduced = exchange.reduce_scatter()
    for n, g in reduced.items():
        assert g.numel() == ownership[n][0][1] - ownership[n][0][0]  # the owner's whole slice
    comm.group.sent.clear()
    exchange.begin_gather(None)
    for n in UNITS:
        lo, hi = ownership[n][0]
        exchange.updated(n, flat[n][lo:hi])
    # the all-gather: my carried elements to the other rank, point to point, in update order
    assert comm.group.sent == [[expected[n][0]] for n in UNITS if n in expected]


def fine_tune_spec(total_steps: int) -> TrainSpec:
    return TrainSpec(
        UnitModel(UNITS, build_fine_tune), huber_per_sample, Regression(), toy_optimizer(total_steps)
    )


@pytest.mark.multiproc
@pytest.mark.timeout(240)
@pytest.mark.parametrize("fine_tune", ["frozen-units", "lora-bitfit"])
@pytest.mark.parametrize(
    "bounds, ranks",
    [([(0, 6)], [(0, 1)]), ([(0, 3), (3, 6)], [(0, 1), (2, 3)])],
    ids=["dp2", "pp2xdp2"],
)
def test_a_fine_tune_trains_as_in_one_process(
    fine_tune: str, bounds: list[tuple[int, int]], ranks: list[tuple[int, ...]]
) -> None:
    """Wholly frozen units out of the exchanges, or units that train in part (LoRA adapters,
    BitFit biases) exchanging, updating and rolling back their trainable elements only: every
    layout still gives the single process's losses and state (over the dynamic communicator,
    with steps rolled back and replayed), every frozen element ends as it began, and every unit
    with a trainable element trained."""
    spec = frozen_spec(STEPS) if fine_tune == "frozen-units" else fine_tune_spec(STEPS)
    ref = run_reference(spec, BATCH, SLOTS, STEPS)
    job = JobSpec(
        spec, toy_layout(bounds, ranks, spec), STEPS, timeout_s=60.0, replay_steps=(2, 4), comm_kind="dynamic"
    )
    results = run_job(job)
    assert job_losses(results) == pytest.approx(ref.losses, rel=REL)
    state = merged_state(results)
    assert_close_states(state, ref.state)
    for i, name in enumerate(UNITS):
        unit = spec.model.build(i)
        initial = torch.cat([p.detach().reshape(-1) for p in unit.parameters()])
        frozen = torch.cat([torch.full((p.numel(),), not p.requires_grad) for p in unit.parameters()])
        final = state["units"][name]["param"]
        assert torch.equal(final[frozen], initial[frozen]), name
        if not bool(frozen.all()):
            assert not torch.equal(final[~frozen], initial[~frozen]), name


def test_a_unit_whose_trainable_parameters_are_empty_is_frozen() -> None:
    """A trainable parameter of no elements (an empty adapter) trains nothing: its unit is in
    no exchange, as a wholly frozen one."""
    units = {n: build_fine_tune(n) for n in UNITS}
    units["head"].requires_grad_(False)
    units["head"].register_parameter("adapter", nn.Parameter(torch.empty(0)))
    numel = {n: sum(p.numel() for p in u.parameters()) for n, u in units.items()}
    ownership = {n: [(0, numel[n] // 2), (numel[n] // 2, numel[n])] for n in UNITS}
    exchange = _exchange(None, units, ownership)
    assert {"embed", "merge", "head"} <= exchange.frozen
    assert all("head" not in b for b in exchange.buckets)
