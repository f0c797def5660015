"""What starting a job costs: `elaswave run` against `torchrun` on the same small model.

    python -m bench.launch [--repeats 5] [--steps 8] [--nproc 4]

Both launch `--nproc` CPU workers of one tiny regression (4 units, 705 parameters, a global
batch of 8 in 2 micro-batches) for `--steps` steps, alternately, so that both see the same load:

- `elaswave run --nproc-per-node N --pp 2`: describes the model, lays it out, starts its Core, the
  rendezvous store and its standby, and one agent per worker; the workers train under the step
  protocol (votes, backups, reports) and the launcher tears everything down;
- `torchrun --standalone --nproc-per-node N`: the same model under plain DDP, same batch, same
  optimizer, no fault tolerance at all.

`elaswave run` runs twice per round: as it starts by default (each worker forked from the
node's zygote, torch imported once; docs/engine.md, "Warm starts") and with `--cold-workers`
(each worker its own interpreter).

It prints, per launcher, the median wall time from the command to its exit, the CPU seconds the
launch used (every process it started, from getrusage of the waited children), and for
`elaswave run` when the Core was up and when the first step began (from its own timestamped
output). The ratio is the price of starting an elastic job rather than a static one.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = """
import torch
from torch import nn

def model():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = x.sum(dim=1, keepdim=True).tanh()
    torch.manual_seed(0)
    units = [nn.Linear(8, 16), nn.Sequential(nn.Tanh(), nn.Linear(16, 16)),
             nn.Sequential(nn.Tanh(), nn.Linear(16, 16)), nn.Sequential(nn.Tanh(), nn.Linear(16, 1))]
    return units, torch.utils.data.TensorDataset(x, y)

def loss_fn(out, target):
    return ((out - target) ** 2).mean(dim=1)
"""

ELASWAVE_SCRIPT = """
import sys
import elaswave
from model import model, loss_fn
units, data = model()
elaswave.train(units, loss_fn, data, global_batch=8, micro_batches=2, steps=int(sys.argv[1]),
               optimizer=elaswave.AdamW(lr=1e-2))
"""

DDP_SCRIPT = """
import os, sys
import torch
import torch.distributed as dist
from torch import nn
from model import model, loss_fn
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
units, data = model()
net = nn.parallel.DistributedDataParallel(nn.Sequential(*units))
opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
per_rank = 8 // world
for step in range(int(sys.argv[1])):
    x, y = data[step * 8 + rank * per_rank: step * 8 + (rank + 1) * per_rank]
    opt.zero_grad()
    for mx, my in zip(x.chunk(2), y.chunk(2)):  # 2 micro-batches, as elaswave's schedule
        (loss_fn(net(mx), my).sum() / 8 * world).backward()
    opt.step()
dist.barrier()
dist.destroy_process_group()
"""


def timed(cmd: list[str], cwd: Path, marks: dict[str, str]) -> tuple[float, float, dict[str, float]]:
    """Wall seconds from start to exit, CPU seconds of every process it started (waited), and
    when each of `marks` (name -> text) was printed."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen: dict[str, float] = {}
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        for name, text in marks.items():
            if name not in seen and text in line:
                seen[name] = time.monotonic() - started
    code = proc.wait(timeout=300)
    if code != 0:
        raise SystemExit(f"{cmd[:3]} exited with status {code}:\n{''.join(lines[-30:])}")
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=4)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps < 1:
        parser.error(f"--repeats and --steps must be >= 1, got {args.repeats} and {args.steps}")
    if args.nproc < 2 or 8 % args.nproc:
        parser.error(
            f"--nproc must be 2, 4 or 8 (two stages; it divides the global batch of 8), got {args.nproc}"
        )
    bin_dir = Path(sys.executable).parent
    elaswave = [str(bin_dir / "elaswave"), "run", "--nproc-per-node", str(args.nproc), "--pp", "2"]
    torchrun = [str(bin_dir / "torchrun"), "--standalone", "--nproc-per-node", str(args.nproc)]
    marks = {"core_up_s": "Core up", "first_step_s": "] starting", "finished_s": "finished:"}
    variants = {
        f"elaswave run (PP=2 x DP={args.nproc // 2})": ([*elaswave], "tiny.py", marks),
        f"elaswave run --cold-workers (PP=2 x DP={args.nproc // 2})": (
            [*elaswave, "--cold-workers"],
            "tiny.py",
            marks,
        ),
        f"torchrun + DDP (DP={args.nproc})": (torchrun, "ddp.py", {}),
    }
    walls: dict[str, list[float]] = {name: [] for name in variants}
    cpus: dict[str, list[float]] = {name: [] for name in variants}
    phases: dict[str, dict[str, list[float]]] = {name: {m: [] for m in marks} for name in variants}
    with tempfile.TemporaryDirectory(prefix="ew-bench-launch-") as tmp:
        work = Path(tmp)
        (work / "model.py").write_text(MODEL)
        (work / "tiny.py").write_text(ELASWAVE_SCRIPT)
        (work / "ddp.py").write_text(DDP_SCRIPT)
        for k in range(args.repeats):  # in turn, so that every variant sees the same load
            for v, (name, (cmd, script, wanted)) in enumerate(variants.items()):
                run_dir = ["--run-dir", str(work / f"run-{k}-{v}")] if wanted else []
                wall, cpu, seen = timed([*cmd, *run_dir, script, str(args.steps)], work, wanted)
                walls[name].append(wall)
                cpus[name].append(cpu)
                for mark, at in seen.items():
                    phases[name][mark].append(at)
            print(
                f"[launch] round {k + 1}/{args.repeats}: "
                + ", ".join(f"{name.split(' (')[0]} {walls[name][-1]:.2f} s" for name in variants),
                flush=True,
            )
    print(
        f"[launch] {args.nproc} CPU workers, {args.steps} steps, median of {args.repeats} "
        f"(load average {os.getloadavg()[0]:.1f})"
    )
    print(
        "| launcher | command to exit (s) | CPU (s) | Core up (s) | first step begins (s) | job finished (s) |"
    )
    print("|---|---|---|---|---|---|")
    for name in variants:
        cells = " | ".join(f"{statistics.median(v):.2f}" if v else "-" for v in phases[name].values())
        print(
            f"| {name} | {statistics.median(walls[name]):.2f} | {statistics.median(cpus[name]):.2f} | {cells} |"
        )
    warm, cold, ddp = (statistics.median(walls[name]) for name in variants)
    warm_cpu, cold_cpu = (statistics.median(cpus[name]) for name in list(variants)[:2])
    print(f"[launch] elaswave run / torchrun: {warm / ddp:.2f}x the wall time")
    print(
        f"[launch] warm / cold workers: {warm / cold:.2f}x the wall time, {warm_cpu / cold_cpu:.2f}x the CPU"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
