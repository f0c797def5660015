"""Mixed precision (executor.precision, docs/accelerators.md) against plain PyTorch, on CPU.

The reference is the loop every PyTorch user writes (tests/api/precision_cases.torch_reference):
fp32 modules, forward and loss under `torch.autocast(dtype=bf16|fp16)`, torch.optim, and
`torch.amp.GradScaler` for fp16. The toy model (tests/api/toy_model.py) crosses its stage
boundary with a tuple that holds a bf16/fp16 activation and an int mask, clips by the global norm,
and runs SGD with Nesterov momentum, decay groups and a schedule.

What a 16-bit run is compared with. Under autocast a weight gradient comes out of a 16-bit
matmul rounded to 16 bits, per backward call: data parallelism (DDP as much as ElasWave's DP
ranks) rounds every rank's contribution on its own before the fp32 sum, and CPU bf16 kernels
round differently with another thread count. Both are far above fp32 round-off on this toy
(lr 0.2 with Nesterov momentum): against a one-chunk reference a PP=2 x DP=2 run is 12 %
off in loss by step 5, and a one-process run at 2 threads vs 1 thread 9 %. So each run is
compared with the reference loop that computes what it computes: the same thread count as the
workers (one) and each micro-batch cut into the layout's DP chunks (`dp`). Then

- one process, PP-only and PP=2 x DP=2 layouts run the reference's very operations; only the
  optimizer arithmetic differs (the clipping norm adds in float64, torch in fp32) and the DP sum
  of fp32 gradient contributions adds in another order: losses agree to 1e-6 relative
  (measured: 0 to 1e-7), parameters to 1e-6 absolute (measured 3e-8; O(0.1) values). fp16 runs
  with two skipped steps are held to 1e-5 (measured 1.6e-6 / 6e-6);
- a run that silently trained in fp32 is 1e-3 or more off (asserted), far outside those bounds.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from executor.launch import JobSpec, job_losses, merged_state, run_job
from executor.reference import run_reference, single_rank_trainer
from planners.layout import Layout, StageLayout
from tests.api.precision_cases import torch_reference, with_precision
from tests.api.toy_model import UNITS, toy_spec

STEPS, BATCH, SLOTS = 6, 8, 2
REL, ABS = 1e-6, 1e-6
FP16_REL, FP16_ABS = 1e-5, 1e-5
OVERFLOW_STEPS = (2, 4)  # unit "conv" (stage 0) overflows fp16 at these steps


def toy_sgd(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.SGD(
        [{"params": decay, "weight_decay": 1e-3}, {"params": no_decay, "weight_decay": 0.0}],
        lr=0.2,
        momentum=0.9,
        nesterov=True,
    )


def layout(bounds: list[tuple[int, int]], ranks: list[tuple[int, ...]]) -> Layout:
    numel = toy_spec().unit_numels()
    stages = tuple(
        StageLayout(p, lo, hi, r) for p, ((lo, hi), r) in enumerate(zip(bounds, ranks, strict=True))
    )
    return Layout(len(UNITS), BATCH, SLOTS, stages, numel)


PP2xDP2 = layout([(0, 3), (3, 6)], [(0, 1), (2, 3)])
PP3 = layout([(0, 3), (3, 4), (4, 6)], [(0,), (1,), (2,)])


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The reference at the workers' thread count (CPU bf16 kernels round per thread split)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def max_param_diff(state: dict, params: dict[str, torch.Tensor]) -> float:
    return max(float((state["units"][n]["param"] - params[n]).abs().max()) for n in UNITS)


def test_bf16_one_process_matches_torch_autocast_loop() -> None:
    spec = with_precision(toy_spec(STEPS), "bf16")
    dtypes = [t.dtype for p in spec.unit_probes() for t in p.output.tensors]
    assert torch.bfloat16 in dtypes and torch.int64 in dtypes  # autocast reached the boundaries
    ref = torch_reference(spec, toy_sgd, BATCH, SLOTS, STEPS, clip=0.5)
    run = run_reference(spec, BATCH, SLOTS, STEPS)
    assert max_rel(run.losses, ref.losses) <= REL
    assert max_param_diff(run.state, ref.params) <= ABS
    fp32 = run_reference(toy_spec(STEPS), BATCH, SLOTS, STEPS)
    assert max_rel(run.losses, fp32.losses) > 1e-3  # bf16 really computed in bf16
    for unit in run.state["units"].values():  # master weights and optimizer state stay fp32
        assert unit["param"].dtype == unit["exp_avg"].dtype == torch.float32


@pytest.mark.multiproc
@pytest.mark.timeout(240)
@pytest.mark.parametrize("lay, dp", [(PP2xDP2, 2), (PP3, 1)], ids=["pp2xdp2", "pp3"])
def test_bf16_layouts_match_torch_autocast_loop(one_thread: None, lay: Layout, dp: int) -> None:
    spec = with_precision(toy_spec(STEPS), "bf16")
    ref = torch_reference(spec, toy_sgd, BATCH, SLOTS, STEPS, clip=0.5, dp=dp)
    results = run_job(JobSpec(spec, lay, STEPS, timeout_s=60.0))
    rel = max_rel(job_losses(results), ref.losses)
    diff = max_param_diff(merged_state(results), ref.params)
    print(
        f"\nbf16 {lay.num_stages} stages, DP {dp} vs torch autocast loop: loss rel {rel:.1e}, param {diff:.1e}"
    )
    assert rel <= REL and diff <= ABS


def test_reduce_dtype_bf16_rounds_the_gradient_once_and_fp32_is_default() -> None:
    """`reduce_dtype="bf16"`: the gradient slices travel in bf16 (half the bytes). In one
    process that is one rounding of the summed gradient to bf16, which the reference applies
    before its optimizer step; the default wire dtype is fp32."""
    assert with_precision(toy_spec(STEPS), "bf16").precision.reduce_dtype == "fp32"
    spec = with_precision(toy_spec(STEPS), "bf16", reduce_dtype="bf16")
    ref = torch_reference(spec, toy_sgd, BATCH, SLOTS, STEPS, clip=0.5, wire=torch.bfloat16)
    run = run_reference(spec, BATCH, SLOTS, STEPS)
    assert max_rel(run.losses, ref.losses) <= REL
    assert max_param_diff(run.state, ref.params) <= ABS
    fp32_wire = run_reference(with_precision(toy_spec(STEPS), "bf16"), BATCH, SLOTS, STEPS)
    assert max_rel(run.losses, fp32_wire.losses) > 1e-3  # the wire dtype really was bf16


def test_fp16_forced_overflow_is_skipped_like_grad_scaler() -> None:
    """One process: the overflowing steps are skipped (parameters untouched, no optimizer
    update, scale halved) exactly where torch.amp.GradScaler skips them."""
    spec = with_precision(toy_spec(STEPS), "fp16", "conv", OVERFLOW_STEPS)
    ref = torch_reference(spec, toy_sgd, BATCH, SLOTS, STEPS, clip=0.5)
    trainer = single_rank_trainer(spec, BATCH, SLOTS)
    skipped, losses = [], []
    for step in range(STEPS):
        before = trainer.unit_params()
        result = trainer.train_step(step)
        assert result.loss is not None
        losses.append(result.loss)
        after = trainer.unit_params()
        same = all(torch.equal(before[n], after[n]) for n in before)
        assert same == result.skipped, step
        if result.skipped:
            skipped.append(step)
    assert skipped == list(OVERFLOW_STEPS)
    assert trainer.optimizer.step_count == ref.updates == STEPS - len(OVERFLOW_STEPS)
    assert trainer.scaler is not None and trainer.scaler.scale == ref.scale == 2.0**16 / 4
    assert max_rel(losses, ref.losses) <= FP16_REL
    state = trainer.gather_full_state()
    assert max_param_diff(state, ref.params) <= FP16_ABS


def _fp16_job(lay: Layout, **kw: object) -> dict:
    spec = with_precision(toy_spec(STEPS), "fp16", "conv", OVERFLOW_STEPS)
    return run_job(JobSpec(spec, lay, STEPS, timeout_s=60.0, **kw))  # type: ignore[arg-type]


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_fp16_overflow_skipped_on_every_rank_of_every_layout_and_in_a_replay(one_thread: None) -> None:
    """PP=2 x DP=2 and PP=3: the overflow starts on stage 0 only, yet every rank skips the same
    steps (the verdict is agreed over the world group); a replayed overflow step (rolled back and
    run again) skips again; the result follows GradScaler's run."""
    spec = with_precision(toy_spec(STEPS), "fp16", "conv", OVERFLOW_STEPS)
    for lay, dp, replay in ((PP2xDP2, 2, (OVERFLOW_STEPS[0],)), (PP3, 1, ())):
        ref = torch_reference(spec, toy_sgd, BATCH, SLOTS, STEPS, clip=0.5, dp=dp)
        results = _fp16_job(lay, replay_steps=replay)
        for r in results.values():
            assert r.skipped == list(OVERFLOW_STEPS), (r.rank, r.skipped)
            assert r.loss_scale is not None and r.loss_scale["scale"] == ref.scale
            assert r.loss_scale["skipped"] == len(OVERFLOW_STEPS)
        state = merged_state(results)
        assert state["step_count"] == ref.updates
        assert max_param_diff(state, ref.params) <= FP16_ABS


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_fp16_scaler_survives_a_resume_on_another_layout(tmp_path: object) -> None:
    """Checkpoint after step 2 (one overflow behind it) on PP=2 x DP=2, resume on PP=3: the loss
    scale comes back from the checkpoint, the second overflow is skipped there too, and the end
    state is the uninterrupted run's."""
    ckpt = str(tmp_path)
    first = _fp16_job(PP2xDP2, checkpoint_dir=ckpt, checkpoint_steps=(2,))
    assert all(r.skipped == list(OVERFLOW_STEPS) for r in first.values())
    resumed = _fp16_job(PP3, resume_dir=ckpt)
    for r in resumed.values():
        assert r.skipped == [OVERFLOW_STEPS[1]]
        assert r.loss_scale is not None and r.loss_scale["scale"] == 2.0**16 / 4
        assert r.loss_scale["skipped"] == 2  # the checkpoint's skip and this run's
    a, b = merged_state(first), merged_state(resumed)
    assert a["step_count"] == b["step_count"] == STEPS - len(OVERFLOW_STEPS)
    # From step 3 on the resumed run adds one chunk per slot where the first added two (the
    # fp16 weight gradients round per chunk, docstring): close, not round-off close.
    for name in UNITS:
        assert float((a["units"][name]["param"] - b["units"][name]["param"]).abs().max()) <= 5e-2


def test_bad_precision_settings_are_refused_and_the_scaler_follows_grad_scalers_rule() -> None:
    from executor.precision import LossScaler, PrecisionConfig

    with pytest.raises(ValueError, match="precision must be one of"):
        PrecisionConfig("fp8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reduce_dtype must be one of"):
        PrecisionConfig("bf16", "int8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="growth_factor > 1"):
        PrecisionConfig("fp16", growth_factor=1.0)
    cfg = PrecisionConfig("fp16", init_scale=8.0, growth_interval=2)
    scaler = LossScaler.initial(cfg)
    for overflow, scale in ((False, 8.0), (False, 16.0), (True, 8.0), (False, 8.0), (False, 16.0)):
        scaler.update(overflow, cfg)
        assert scaler.scale == scale
    assert scaler.skipped == 1
    copy = LossScaler()
    copy.load_state_dict(scaler.state_dict())
    assert copy == scaler
    with pytest.raises(ValueError, match="loss scale must be a positive number"):
        copy.load_state_dict({"scale": float("inf"), "growth_tracker": 0})
