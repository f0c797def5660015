"""The loss curve of the README: one process and `elaswave run` (with its kill) on one plot.

python examples/llama/plot.py --single one.json --run-dir elaswave-run/train --kill-at 40 --out loss.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def launched_losses(run_dir: Path) -> dict[int, float]:
    """Each step's loss as the last stage's ranks reported it (rank-R.json of the run)."""
    losses: dict[int, float] = {}
    for f in sorted(run_dir.glob("rank-*.json")):
        for step, loss in json.loads(f.read_text())["losses"].items():
            losses.setdefault(int(step), loss)
    return losses


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = argparse.ArgumentParser()
    p.add_argument("--single", type=Path, required=True, help="train.py --losses-out of the one-process run")
    p.add_argument("--run-dir", type=Path, required=True, help="elaswave-run/<job> of the launched run")
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--out", type=Path, default=Path("loss.png"))
    args = p.parse_args()
    single = {int(k): v for k, v in json.loads(args.single.read_text()).items()}
    run = launched_losses(args.run_dir)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(sorted(single), [single[s] for s in sorted(single)], label="one process", lw=2.5, alpha=0.6)
    ax.plot(sorted(run), [run[s] for s in sorted(run)], "--", label="elaswave run, PP=2 (3 workers)", lw=1.2)
    if args.kill_at is not None:
        ax.axvline(
            args.kill_at + 0.5,
            color="red",
            lw=0.8,
            ls=":",
            label=f"worker SIGKILLed after step {args.kill_at}",
        )
    ax.set(xlabel="step", ylabel="training loss (mean token cross-entropy)", yscale="log")
    ax.set_title("examples/llama: 10.8 M-parameter Llama, tied embeddings")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    worst = max((abs(run[s] - single[s]) / single[s] for s in run if s in single), default=float("nan"))
    print(f"wrote {args.out}; {len(run)} launched steps, largest relative difference {worst:.2e}")


if __name__ == "__main__":
    main()
