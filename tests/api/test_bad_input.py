"""Bad input to the public API gets an error that says what to fix, before any training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import elaswave
from executor.units import UnitBuildError


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean(1)


DATA = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))


def small_units() -> elaswave.Units:
    return elaswave.Units(["a", "b"], lambda n: nn.Linear(4, 8) if n == "a" else nn.Linear(8, 1))


def test_a_unit_that_cannot_be_built() -> None:
    def build(name: str) -> nn.Module:
        if name == "b":
            raise RuntimeError("out of ideas")
        return nn.Linear(4, 8)

    with pytest.raises(UnitBuildError, match="building unit 'b' failed: RuntimeError: out of ideas"):
        elaswave.train(elaswave.Units(["a", "b"], build), mse, DATA, global_batch=4, steps=1)


def test_a_unit_that_returns_no_module() -> None:
    with pytest.raises(UnitBuildError, match=r"build_unit\('a'\) returned int"):
        elaswave.train(elaswave.Units(["a"], lambda n: 3), mse, DATA, global_batch=4, steps=1)  # type: ignore[arg-type, return-value]


def test_units_that_do_not_fit_together() -> None:
    units = elaswave.Units(["a", "b"], lambda n: nn.Linear(4, 8) if n == "a" else nn.Linear(5, 1))
    with pytest.raises(UnitBuildError, match="unit 'b' failed on one sample"):
        elaswave.train(units, mse, DATA, global_batch=4, steps=1)


def test_a_model_with_batch_norm_is_refused_before_it_trains() -> None:
    # A user's own nn.Sequential, as one would write it for PyTorch: BatchNorm mixes the samples of
    # a rank's micro-batch and keeps running statistics that a moved unit would lose.
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    with pytest.raises(UnitBuildError, match=r"unit '1': 1 is a BatchNorm1d.*Use GroupNorm or LayerNorm"):
        elaswave.train(model, mse, DATA, global_batch=4, steps=1)


def test_a_dataset_smaller_than_a_global_batch() -> None:
    with pytest.raises(ValueError, match="the dataset has 16 samples, fewer than one global batch of 32"):
        elaswave.train(small_units(), mse, DATA, global_batch=32, steps=1)


def test_a_loss_that_is_not_per_sample() -> None:
    with pytest.raises(
        ValueError, match=r"loss_fn must return one floating-point loss per sample, shape \(4,\)"
    ):
        elaswave.train(small_units(), lambda out, y: ((out - y) ** 2).mean(), DATA, global_batch=4, steps=1)


def test_undeclared_weight_sharing_is_refused_with_what_to_do() -> None:
    shared = nn.Linear(4, 4)
    # A build function that hands out the same module twice shares its parameters without
    # declaring the tie: refused, and the message gives the declaration to write.
    units = elaswave.Units(["x", "y"], lambda n: shared)
    with pytest.raises(UnitBuildError, match=r"not declared tied: declare it with Units\(\.\.\., tied="):
        elaswave.train(
            units, mse, TensorDataset(torch.randn(8, 4), torch.randn(8, 4)), global_batch=4, steps=1
        )


def test_a_weight_shared_by_three_units_is_refused() -> None:
    shared = nn.Linear(4, 4)
    with pytest.raises(UnitBuildError, match="shared by 3 units .* ties pairs of units only"):
        elaswave.Units.from_modules([shared, shared, shared])


def test_resume_from_something_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(elaswave.CheckpointError, match="not a checkpoint directory"):
        elaswave.train(small_units(), mse, DATA, global_batch=4, steps=1, resume=tmp_path)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"steps": 0}, "need steps >= 1"),
        ({"micro_batches": 5}, "micro_batches <= global_batch"),
        ({"verify_every": 0}, "verify_every >= 1; got .* verify_every=0"),
    ],
)
def test_out_of_range_settings(kwargs: dict, match: str) -> None:
    args = {"global_batch": 4, "steps": 1} | kwargs
    with pytest.raises(ValueError, match=match):
        elaswave.train(small_units(), mse, DATA, **args)


def test_bad_optimizer_settings() -> None:
    with pytest.raises(ValueError, match="lr must be a positive number"):
        elaswave.AdamW(lr=-1.0)
    with pytest.raises(ValueError, match="nesterov needs momentum > 0"):
        elaswave.SGD(lr=0.1, nesterov=True)


def test_sequential_trains_and_returns_a_plain_state_dict() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    result = elaswave.train(
        model,
        mse,
        DATA,
        global_batch=8,
        micro_batches=2,
        steps=3,
        optimizer=elaswave.SGD(lr=0.05, momentum=0.9),
    )
    assert sorted(result.losses) == [0, 1, 2]
    assert result.state_dict is not None
    fresh = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    fresh.load_state_dict(result.state_dict)  # "<unit>.<param>" keys are nn.Sequential's own


def test_a_sequential_with_a_tied_weight_stays_tied_not_untied() -> None:
    emb, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # the usual tied LM head: a declared pair, not two weights
    units = elaswave.Units.from_modules(nn.Sequential(emb, head))
    assert [p.keys for p in units.tied] == [("0.weight", "1.weight")]
    emb_weight, head_weight = units.build(0).weight, units.build(1).weight
    assert isinstance(emb_weight, torch.Tensor) and isinstance(head_weight, torch.Tensor)
    assert torch.equal(emb_weight, head_weight)


def test_loader_processes_feed_the_same_batches_as_the_prefetch_thread() -> None:
    from tests.api.toy_model import Regression, huber_per_sample, toy_optimizer

    def run(workers: int) -> elaswave.TrainResult:
        from tests.api.toy_model import build_unit

        units = elaswave.Units(["embed", "conv", "split", "mlp", "merge", "head"], build_unit)
        return elaswave.train(
            units,
            huber_per_sample,
            Regression(),
            global_batch=8,
            micro_batches=2,
            steps=4,
            optimizer=toy_optimizer(4),
            loader_workers=workers,
        )

    threaded, processes = run(0), run(2)
    assert processes.losses == threaded.losses
    assert processes.state_dict is not None and threaded.state_dict is not None
    assert all(torch.equal(processes.state_dict[k], threaded.state_dict[k]) for k in threaded.state_dict)
    with pytest.raises(ValueError, match="loader_workers must be >= 0"):
        elaswave.train(small_units(), mse, DATA, global_batch=4, steps=1, loader_workers=-1)
