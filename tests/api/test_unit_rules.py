"""One calling rule per way of building units, and tied weights declared or found (docs/api.md).

An `nn.Sequential` runs as a Sequential: a tuple is passed whole from module to module. Units
given as `Units(...)`, a list or a dict receive a tuple unpacked, and a module written for the
other rule fails before the first step with the rule that applied and what to change. Two
modules of a Sequential sharing a parameter (an embedding and its LM head) train as the
Sequential does under torch.optim, with one parameter."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import elaswave
from executor.units import UnitBuildError


class Split(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[:, :4], x[:, 4:]


class Mix(nn.Module):  # takes the tuple whole, as nn.Sequential hands it over
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(4, 8)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.tanh(self.a(pair[0]) + self.b(pair[1]))


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean(dim=1)


DATA = TensorDataset(torch.randn(16, 8, generator=torch.Generator().manual_seed(0)), torch.randn(16, 1))


def plain_sgd(model: nn.Module, steps: int) -> list[float]:
    """torch.optim on the same batches (shuffle off: samples in order)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x, y = DATA[step * 8 : step * 8 + 8]
        opt.zero_grad()
        loss = mse(model(x), y).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def train(model: object, steps: int = 2) -> elaswave.TrainResult:
    return elaswave.train(
        model,  # type: ignore[arg-type]
        mse,
        DATA,
        global_batch=8,
        steps=steps,
        shuffle=False,
        optimizer=elaswave.SGD(lr=0.1),
    )


def test_a_sequential_passes_tuples_whole_as_nn_sequential_does() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Split(), Mix(), nn.Linear(8, 1))
    result = train(model)
    assert [result.losses[s] for s in range(2)] == pytest.approx(plain_sgd(model, 2), rel=1e-6)


def test_the_unpacking_rule_fails_clearly_with_the_rule_and_the_change() -> None:
    torch.manual_seed(0)
    with pytest.raises(
        UnitBuildError,
        match=r"unit '1' failed .*TypeError.*rule applied: units given as Units\(\.\.\.\), a list or a dict "
        r"receive a tuple activation unpacked, unit\(\*x\); make forward take 2 tensor arguments, or give "
        r"the units as an nn.Sequential",
    ):
        train([Split(), Mix(), nn.Linear(8, 1)])


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids).mean(dim=1)


def test_two_modules_sharing_a_parameter_train_as_one_parameter() -> None:
    torch.manual_seed(0)
    embed, body, head = Embed(), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 10, bias=False)
    head.weight = embed.emb.weight  # tied: one parameter, used twice
    model = nn.Sequential(embed, body, head)
    ids = torch.randint(0, 10, (16, 3), generator=torch.Generator().manual_seed(1))
    data = TensorDataset(ids, torch.randint(0, 10, (16,)))

    def ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits, y, reduction="none")

    units = elaswave.Units.from_modules(model)
    assert [p.keys for p in units.tied] == [("0.emb.weight", "2.weight")]
    result = elaswave.train(
        units, ce, data, global_batch=8, steps=3, shuffle=False, optimizer=elaswave.AdamW(lr=0.05)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)  # parameters(): the tied weight once
    want = []
    for step in range(3):
        s = (step % 2) * 8
        opt.zero_grad()
        loss = ce(model(ids[s : s + 8]), data.tensors[1][s : s + 8]).mean()
        loss.backward()
        opt.step()
        want.append(float(loss.detach()))
    assert [result.losses[s] for s in range(3)] == pytest.approx(want, rel=1e-6)
    assert result.state_dict is not None
    assert torch.equal(result.state_dict["0.emb.weight"], result.state_dict["2.weight"])
    assert torch.allclose(result.state_dict["2.weight"], head.weight, atol=1e-6)


def test_declared_ties_are_checked() -> None:
    def build(name: str) -> nn.Module:
        return nn.Linear(4, 4) if name != "c" else nn.Linear(4, 3)

    with pytest.raises(UnitBuildError, match="must be '<unit>.<parameter>' with a unit of"):
        elaswave.Units(["a", "b"], build, tied=[("a.weight", "z.weight")])
    with pytest.raises(UnitBuildError, match="differ in shape or dtype"):
        elaswave.Units(["a", "c"], build, tied=[("a.weight", "c.weight")]).build(1)
    with pytest.raises(UnitBuildError, match="tied parameter 'nope' does not exist"):
        elaswave.Units(["a", "b"], build, tied=[("a.weight", "b.nope")]).build(1)


def test_a_placeholder_for_an_arriving_tied_unit_takes_the_held_copy() -> None:
    """A non-blocking migration adopts a layout whose arriving unit is a zero placeholder until its
    payload lands; on a stage where the pair is one parameter the held copy's value must win."""
    from executor.tied import TiedPair, align_tied_flats

    emb, head = nn.Linear(3, 2, bias=False), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 3, bias=False))
    pair = TiedPair(("emb", "weight"), ("head", "1.weight"))
    held = torch.arange(6, dtype=torch.float32)
    params = {"emb": held, "head": torch.zeros(12)}
    out = align_tied_flats(params, {"emb": emb, "head": head}, [pair], held={"emb"})
    assert torch.equal(out["head"][6:], held) and torch.equal(out["head"][:6], torch.zeros(6))
    back = align_tied_flats(
        {"emb": torch.zeros(6), "head": out["head"]}, {"emb": emb, "head": head}, [pair], {"head"}
    )
    assert torch.equal(back["emb"], held)
