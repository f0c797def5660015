"""`make gpu-check`: the device checks of docs/accelerators.md, on one GPU machine, in 8 minutes.

    python scripts/gpu_check.py [--budget-s 480] [--only a,c] [--out gpu-check]

Prints one line per check and PASS or FAIL last (exit 0 / 1). On a machine where torch sees no
CUDA device it says so on every line and ends with FAIL (exit 2): nothing was checked.

(a) one process, fp32 on CUDA, 20 steps: final parameters equal the CPU run's within 1e-5 relative;
(b) bf16 on CUDA matches the torch-autocast reference loop (fp32 master weights, torch.optim);
(c) six ranks sharing the one GPU (collectives over gloo, point-to-point staged through host
    memory) with a kill -9: recovered in place, parameters bitwise and Adam moments round-off
    close at the committed step (the backups are replayed on the host), losses after it
    following the fault-free run;
(d) a >= 300 M parameter GPT in bf16: engine throughput / plain torch throughput on the same
    model, and the per-step cost of staging each step's gradient shard to pinned host memory on a
    side stream (what a ring snapshot copies off the device) as a fraction of the step;
(e) two or more GPUs: NCCL group edit after a kill (time, device memory before and after, and over
    20 more edits); skipped with the reason on one GPU.

Each check runs in its own child process bounded by what is left of the budget, so a hang in one
is reported as that check's FAIL and the others still run. It runs from a checkout: (b), (c) and
(e) reuse the test suite's reference loop and fault harness (tests/), so the `dev` extra (pytest)
must be installed next to the machine's own torch. A live NVML reading goes to
<out>/nvml_reading.json (tests/agent/recorded/README.md says what to do with it).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CHECKS: dict[str, str] = {
    "a": "fp32 on CUDA, 20 steps, equals the CPU run within 1e-5 relative",
    "b": "bf16 on CUDA matches the torch autocast reference",
    "c": "6 ranks sharing one GPU over gloo, kill -9, recovered in place",
    "d": ">= 300 M parameters in bf16: throughput vs plain torch, snapshot staging per step",
    "e": "NCCL group edit after a kill, time and device memory",
}
RESULT_PREFIX = "GPU-CHECK-RESULT "
DEFAULT_BUDGET_S = 480.0


@dataclasses.dataclass(frozen=True)
class Outcome:
    status: str  # PASS, FAIL or SKIP
    detail: str


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="bound on the whole run (s)")
    p.add_argument("--only", default=",".join(CHECKS), help="checks to run, e.g. a,b (default: all)")
    p.add_argument("--out", type=Path, default=Path("gpu-check"), help="where readings are written")
    p.add_argument("--child", choices=sorted(CHECKS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    chosen = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = sorted(set(chosen) - set(CHECKS))
    if unknown or not chosen:
        p.error(f"--only takes some of {','.join(CHECKS)}; got {args.only!r}")
    if not args.budget_s > 0:
        p.error(f"--budget-s must be positive, got {args.budget_s}")
    args.only = chosen
    return args


def cuda_missing() -> str | None:
    """Why this machine cannot run the checks, or None."""
    import torch

    if not torch.cuda.is_available():
        build = torch.version.cuda or "none (a CPU build)"
        return f"no CUDA device visible to torch {torch.__version__} (CUDA build: {build})"
    return None


# --------------------------------------------------------------------------------- the checks


def _rel_norm(a: dict[str, Any], b: dict[str, Any]) -> float:
    """max over units of ||a - b|| / ||b|| of the flat parameters."""
    return max(
        float((a[n].double() - b[n].double()).norm() / b[n].double().norm().clamp_min(1e-30)) for n in b
    )


def _params(run: Any) -> dict[str, Any]:
    return {n: u["param"].cpu() for n, u in run.state["units"].items()}


def check_a() -> Outcome:
    import torch

    from executor.reference import run_reference
    from tests.executor.engine_cases import gpt_spec

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (TF32 would round to 10 bits)
    torch.backends.cudnn.allow_tf32 = False
    gpu = run_reference(dataclasses.replace(gpt_spec(), device_kind="cuda"), 12, 2, 20)
    cpu = run_reference(gpt_spec(), 12, 2, 20)
    rel = _rel_norm(_params(gpu), _params(cpu))
    loss = max(abs(a - b) / abs(b) for a, b in zip(gpu.losses, cpu.losses, strict=True))
    ok = rel <= 1e-5
    return Outcome("PASS" if ok else "FAIL", f"param rel {rel:.1e} (bound 1e-5), loss rel {loss:.1e}")


def check_b() -> Outcome:
    import torch

    from executor.reference import run_reference
    from tests.api.precision_cases import torch_reference, with_precision
    from tests.executor.engine_cases import gpt_spec

    spec = dataclasses.replace(with_precision(gpt_spec(), "bf16"), device_kind="cuda")

    def adamw(foreach: bool) -> Callable[[torch.nn.Module], torch.optim.Optimizer]:
        return lambda model: torch.optim.AdamW(
            model.parameters(), lr=3e-3, weight_decay=0.01, foreach=foreach
        )

    def compare() -> tuple[float, float, float]:
        ref = torch_reference(spec, adamw(True), 12, 2, 20, device="cuda")
        again = torch_reference(spec, adamw(True), 12, 2, 20, device="cuda")
        looped = torch_reference(spec, adamw(False), 12, 2, 20, device="cuda")
        run = run_reference(spec, 12, 2, 20)
        loss = max(abs(a - b) / abs(b) for a, b in zip(run.losses, ref.losses, strict=True))
        spread = max(_rel_norm(again.params, ref.params), _rel_norm(looped.params, ref.params))
        return _rel_norm(_params(run), ref.params), loss, spread

    # Deterministic kernels first (CUDA's default embedding backward adds with atomics, in no
    # fixed order, so even torch's own loop differs from itself run to run); the bound is then
    # torch's own spread: the loop run twice, and with AdamW's per-tensor loop instead of its
    # foreach kernels (fp32 round-off, which can flip a bf16 rounding that AdamW's normalised
    # update carries on). The engine differs from torch only in such orders (its slice update).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    mode = "deterministic kernels"
    try:
        torch.use_deterministic_algorithms(True)
        rel, loss, spread = compare()
    except RuntimeError as exc:
        if "determinis" not in str(exc):
            raise
        mode = f"default kernels ({str(exc).splitlines()[0][:120]})"
        torch.use_deterministic_algorithms(False)
        rel, loss, spread = compare()
    bound = max(1e-3, 2 * spread)
    ok = rel <= bound and loss <= 1e-3
    return Outcome(
        "PASS" if ok else "FAIL",
        f"{mode}: param rel {rel:.1e} (bound {bound:.1e}: 2x torch's own spread {spread:.1e}, at "
        f"least 1e-3), loss rel {loss:.1e} (bound 1e-3)",
    )


def check_c() -> Outcome:
    from tests.executor.test_failstop import Scenario, check_kill_recovery_with_drifting_backups

    # The backups are replayed on the host, the live shards updated on the GPU: they drift by
    # round-off (executor/fabric/remap.py, "Backups replayed off the live device"), so the check
    # is the drift-tolerant one: parameters bitwise at the committed step, moments round-off close.
    faulty = check_kill_recovery_with_drifting_backups(Scenario(kill_at_op=5, victim=4, device_kind="cuda"))
    edits = sorted({tuple(e["rebuilt"]) for r in faulty.values() for e in r["edits"]})
    found = sum(r["checksum_mismatches"] for r in faulty.values())
    checks = sum(len(r["verified"]) for r in faulty.values())
    detail = (
        f"recovered in place; parameters bitwise and moments within 1e-5 of the fault-free run at the "
        f"committed step; rebuilt {edits}; backup checks within round-off: {checks - found} of {checks}"
    )
    # a check that fails on a GPU means drift beyond round-off (VERIFY_DRIFT_REL), not its noise
    return Outcome("PASS" if found == 0 else "FAIL", detail)


def check_d() -> Outcome:
    from bench.precision_cost import bench_300m

    r = bench_300m()
    ratio, overhead = r["engine_vs_torch"], r["snapshot_staging_overhead"]
    detail = (
        f"{r['params'] / 1e6:.0f} M params, engine/torch throughput {ratio:.3f} (target >= 0.95), "
        f"snapshot staging {100 * overhead:.2f} % of a step awaited off the step (target <= 1 %; "
        f"{100 * r['staging_awaited_overhead']:.1f} % awaited at the step's end, as before), "
        f"step {r['engine_step_s']:.3f} s; "
        f"the {r['staged_bytes'] / 1e9:.2f} GB of gradients alone copy in {r['staging_alone_s']:.3f} s "
        f"({r['staged_bytes'] / r['staging_alone_s'] / 1e9:.1f} GB/s); a holder's host replay of the "
        f"update {r['host_replay_s']:.3f} s/step on {r['host_threads']} threads "
        f"({r['host_replay_s'] / r['engine_step_s']:.1f}x the step)"
    )
    return Outcome("PASS" if ratio >= 0.95 and overhead <= 0.01 else "FAIL", detail)


def check_e() -> Outcome:
    import torch

    n = torch.cuda.device_count()
    if n < 2:
        return Outcome("SKIP", f"one GPU visible ({torch.cuda.get_device_name(0)}): NCCL needs two or more")
    from bench.nccl_edit import nccl_edit_after_kill

    r = nccl_edit_after_kill(min(n, 4))
    growth = r["used_after_20"] - r["used_after_edit"]
    detail = (
        f"{r['workers']} GPUs, edit after kill {r['edit_s']:.2f} s; device used before/after edit/after 20 "
        f"more: {r['used_before'] / 2**20:.0f}/{r['used_after_edit'] / 2**20:.0f}/{r['used_after_20'] / 2**20:.0f}"
        f" MiB; allocated {r['allocated_before']}->{r['allocated_after_20']} B, reserved "
        f"{r['reserved_before']}->{r['reserved_after_20']} B"
    )
    return Outcome("PASS" if r["sums_ok"] and growth <= 128 * 2**20 else "FAIL", detail)


RUNNERS: dict[str, Callable[[], Outcome]] = {
    "a": check_a,
    "b": check_b,
    "c": check_c,
    "d": check_d,
    "e": check_e,
}


# ------------------------------------------------------------------------------------ driver


def failure_summary(exc: BaseException) -> str:
    """One line for a check's failure: the message's first line and, when a worker's traceback
    arrived inside the message (tests/executor/ft_procs.py), its last line, which says what
    failed in the worker."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    said = lines[0][:200] + (f" ... {lines[-1][:300]}" if len(lines) > 1 else "") if lines else ""
    return f"{type(exc).__name__}: {said}"


def _child(name: str) -> int:
    try:
        outcome = RUNNERS[name]()
    except BaseException as exc:  # noqa: BLE001 - reported as the check's FAIL
        traceback.print_exc()  # the whole story goes to the check's log
        outcome = Outcome("FAIL", failure_summary(exc))
    sys.stdout.flush()
    print(RESULT_PREFIX + json.dumps(dataclasses.asdict(outcome)), flush=True)
    return 0


def _run_child(name: str, timeout_s: float, log: Path) -> Outcome:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        # TimeoutExpired carries bytes whatever text=True says (subprocess docs)
        out, err = (
            b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
            for b in (exc.stdout, exc.stderr)
        )
        log.write_text(f"{out}\n{err}")
        return Outcome("FAIL", f"no result within the {timeout_s:.0f} s left of the budget (log: {log})")
    log.write_text(proc.stdout + "\n" + proc.stderr)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return Outcome(**json.loads(line[len(RESULT_PREFIX) :]))
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
    return Outcome("FAIL", f"exit {proc.returncode} without a result: {tail} (log: {log})")


def _record_nvml(out: Path) -> str:
    from agent.nvml import NvmlReader

    reader = NvmlReader.open()
    if reader is None:
        return "no NVML reading (pynvml not installed or NVML unavailable)"
    path = out / "nvml_reading.json"
    path.write_text(json.dumps(reader.read_raw(), indent=1))
    return f"NVML reading written to {path}"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return _child(args.child)
    import torch

    started = time.monotonic()
    print(
        f"gpu-check {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
        f"budget {args.budget_s:.0f} s",
        flush=True,
    )
    missing = cuda_missing()
    if missing is not None:
        for name in args.only:
            print(f"({name}) {CHECKS[name]}: SKIP - {missing}", flush=True)
        print(f"FAIL: nothing checked: {missing}", flush=True)
        return 2
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"devices: {names}; {_record_nvml(args.out)}", flush=True)
    failed = False
    for name in args.only:
        left = args.budget_s - (time.monotonic() - started)
        if left < 5:
            outcome = Outcome("FAIL", "the budget ran out before this check")
        else:
            t0 = time.monotonic()
            outcome = _run_child(name, left, args.out / f"check-{name}.log")
            outcome = dataclasses.replace(outcome, detail=f"{outcome.detail} [{time.monotonic() - t0:.0f} s]")
        failed |= outcome.status == "FAIL"
        print(f"({name}) {CHECKS[name]}: {outcome.status} - {outcome.detail}", flush=True)
    print("FAIL" if failed else "PASS", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
