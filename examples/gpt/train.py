"""Train the small GPT on the bundled Markov corpus: `elaswave run --nproc-per-node 4 --pp 2 examples/gpt/train.py`.

Also `python examples/gpt/train.py` (one process, the fault-free reference). See README.md here.
"""

from __future__ import annotations

import argparse
import json
import os

from data import MarkovWindows
from model import ModelConfig, gpt_units, per_sample_loss

import elaswave


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--max-grad-norm", type=float, default=1.0, help="clip by the global gradient norm (0: off)"
    )
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume", default=None)
    p.add_argument(
        "--verify-every",
        type=int,
        default=elaswave.DEFAULT_VERIFY_EVERY,
        help="committed steps between checks of the backups",
    )
    p.add_argument("--losses-out", default=None, help="write {step: loss} JSON here (single process)")
    args = p.parse_args()

    cfg = ModelConfig(hidden=args.hidden, num_layers=args.layers, dropout=args.dropout)
    result = elaswave.train(
        gpt_units(cfg),
        per_sample_loss,
        MarkovWindows(cfg.vocab_size, cfg.seq_len),
        global_batch=args.global_batch,
        micro_batches=args.micro_batches,
        steps=args.steps,
        optimizer=elaswave.AdamW(
            lr=args.lr,
            weight_decay=0.01,
            no_decay=elaswave.no_decay_norms_and_biases,
            max_grad_norm=args.max_grad_norm or None,
        ),
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        log_every=max(1, args.steps // 10),
        verify_every=args.verify_every,
    )
    if args.losses_out and result.losses:
        tmp = f"{args.losses_out}.tmp"
        with open(tmp, "w") as f:
            json.dump({str(k): v for k, v in result.losses.items()}, f)
        os.replace(tmp, args.losses_out)
    if result.losses and result.state_dict is not None:
        last = max(result.losses)
        print(
            f"trained {result.committed_steps} steps; loss {result.losses[min(result.losses)]:.4f} -> "
            f"{result.losses[last]:.4f}"
        )


if __name__ == "__main__":
    main()
