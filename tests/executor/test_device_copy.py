"""Device-side pieces that also run on the CPU: the integrity digest the snapshots compare (computed
where a tensor lives), the host stager's CPU path, and where point-to-point tensors are staged
per backend (executor.staging). The CUDA paths run in `make gpu-check`."""

from __future__ import annotations

import pytest
import torch

from executor.fabric.device_copy import HostStager, tensor_digest
from executor.fabric.state import ShardState, UnitShard
from executor.staging import Staging, needs_staging


def test_digest_sees_every_bit_and_every_move() -> None:
    x = torch.randn(1000)
    base = tensor_digest(x)
    assert tensor_digest(x.clone()) == base and len(base) == 16
    for i in (0, 1, 499, 999):
        for bit in (0, 7, 22, 31):  # a mantissa, the exponent and the sign
            y = x.clone()
            y.view(torch.int32)[i] ^= 1 << bit
            assert tensor_digest(y) != base, (i, bit)
    swapped = x.clone()
    swapped[[3, 7]] = swapped[[7, 3]]
    assert tensor_digest(swapped) != base  # same values, other places
    assert tensor_digest(torch.zeros(0)) == bytes(16)
    assert tensor_digest(x.to(torch.bfloat16)) != tensor_digest(x.to(torch.bfloat16) * 2)


def test_shard_checksum_is_bitwise_and_position_aware() -> None:
    def state(param: torch.Tensor) -> ShardState:
        s = ShardState(step=3)
        s.units["u"] = UnitShard(
            10, 10 + param.numel(), param, torch.ones_like(param), torch.zeros_like(param)
        )
        return s

    p = torch.randn(64)
    a, b = state(p), state(p.clone())
    assert a.checksum() == b.checksum()
    q = p.clone()
    q[5] = torch.nextafter(q[5], torch.tensor(float("inf")))  # one ulp
    assert state(q).checksum() != a.checksum()
    moved = state(p.clone())
    moved.step = 4
    assert moved.checksum() != a.checksum()


def test_host_stager_is_a_no_op_on_the_cpu() -> None:
    stager = HostStager()
    t = torch.randn(8)
    assert stager.stage(t) is t and stager.pending == 0
    stager.wait()


def test_staging_per_backend() -> None:
    cpu = torch.zeros(3)
    assert not needs_staging(cpu, "gloo") and needs_staging(cpu, "nccl") and needs_staging(cpu, "hccl")
    meta = torch.empty(3, device="meta")  # stands for any non-host tensor in this pure check
    assert needs_staging(meta, "gloo") and not needs_staging(meta, "nccl")
    staging = Staging("gloo")
    assert staging.send(cpu) is cpu and staging.recv(cpu) is cpu and not staging.copy_back


def test_device_backends_turn_async_error_handling_on_and_keep_what_the_user_set() -> None:
    from executor.comm.device_groups import apply_error_handling_env

    env: dict[str, str] = {}
    assert apply_error_handling_env("gloo", env) == {} and env == {}
    assert apply_error_handling_env("nccl", env) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    mine = {"HCCL_ASYNC_ERROR_HANDLING": "0"}
    assert apply_error_handling_env("hccl", mine) == {} and mine == {"HCCL_ASYNC_ERROR_HANDLING": "0"}


def _sketch(x: torch.Tensor, start: int = 0) -> torch.Tensor:
    from executor.fabric.device_copy import tensor_sketch

    return tensor_sketch((x,), start)


def test_sketch_passes_round_off_and_fails_drift_or_a_changed_element() -> None:
    from executor.fabric.device_copy import sketch_distance

    x = torch.randn(200_000, generator=torch.Generator().manual_seed(0))
    base = _sketch(x, 1000)
    assert sketch_distance(base, _sketch(x.clone(), 1000)) == 0.0
    up = torch.nextafter(x, torch.full_like(x, float("inf")))  # one ulp on every element: round-off
    assert sketch_distance(base, _sketch(up, 1000)) < 1e-6
    for seed, r in ((1, 1e-3), (2, 1e-5)):  # drift of relative size r, in no particular direction
        d = torch.randn(x.numel(), generator=torch.Generator().manual_seed(seed))
        drifted = x + d * (r * x.norm() / d.norm())
        assert 0.1 * r < sketch_distance(base, _sketch(drifted, 1000)) < 3 * r, (seed, r)
    one = x.clone()
    one[12345] += 1e-3 * float(x.norm())  # a single corrupted element, 1e-3 of the norm
    assert sketch_distance(base, _sketch(one, 1000)) >= 0.9e-3
    assert sketch_distance(base, _sketch(x, 1001)) > 1e-2  # positions matter: not a copy of this interval
    bad = x.clone()
    bad[7] = float("nan")
    assert sketch_distance(base, _sketch(bad, 1000)) == float("inf")


def test_sketch_is_the_same_in_chunks_and_a_shard_sketch_names_step_and_intervals(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from executor.fabric import device_copy

    x = torch.randn(10_007)
    whole = _sketch(x, 5)
    monkeypatch.setattr(device_copy, "_SKETCH_CHUNK", 1000)
    assert torch.allclose(_sketch(x, 5), whole, rtol=1e-12, atol=0.0)

    def shard(step: int, start: int) -> ShardState:
        s = ShardState(step=step)
        s.units["u"] = UnitShard(start, start + 64, torch.ones(64), torch.zeros(64), torch.ones(64))
        return s

    a = shard(3, 10).sketch()
    assert a.numel() == ShardState.sketch_numel(1)
    assert ShardState.sketch_drift(a, shard(3, 10).sketch()) == 0.0
    assert ShardState.sketch_drift(a, shard(4, 10).sketch()) == float("inf")  # another step
    assert ShardState.sketch_drift(a, shard(3, 11).sketch()) == float("inf")  # another interval
