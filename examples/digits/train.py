"""Train a small CNN on scikit-learn's handwritten digits: `elaswave run --nproc-per-node 4 --pp 2 examples/digits/train.py`.

Also `python examples/digits/train.py` (one process: the reference every layout matches, and
the held-out accuracy printed at the end). See README.md here.

The model is four units of different kinds and sizes: two convolution blocks, a flatten + MLP
block with placement-invariant dropout, and a linear head. The data is `load_digits` (1,797 8x8
images, 10 classes; it ships with scikit-learn, nothing is downloaded), split once by a fixed
seed into 1,497 training and 300 held-out images.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import Dataset

import elaswave

UNITS = ("conv1", "conv2", "mlp", "head")
HELD_OUT = 300
SPLIT_SEED = 0


class Digits(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Item i: (image scaled to [0, 1], shape (1, 8, 8), float32; label, int64)."""

    def __init__(self, train: bool) -> None:
        digits = load_digits()
        order = np.random.Generator(np.random.PCG64(SPLIT_SEED)).permutation(len(digits.target))
        rows = order[HELD_OUT:] if train else order[:HELD_OUT]
        self.images = torch.from_numpy(digits.images[rows] / 16.0).float().unsqueeze(1)
        self.labels = torch.from_numpy(digits.target[rows]).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]


class ConvBlock(nn.Module):
    """3x3 convolution, GroupNorm (per sample: no statistics shared across a batch, so the result
    does not depend on how the batch is split), ReLU, optional 2x2 max-pool."""

    def __init__(self, cin: int, cout: int, pool: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm = nn.GroupNorm(4, cout)
        self.pool = pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm(self.conv(x)))
        return F.max_pool2d(x, 2) if self.pool else x


class MLP(nn.Module):
    """Flatten (32, 4, 4) -> 512, Linear 512 -> 128, ReLU, placement-invariant dropout."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(32 * 4 * 4, 128)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc(x.flatten(1)))
        return elaswave.dropout(h, self.dropout, site=0, training=self.training)


def build_unit(name: str, dropout: float = 0.1) -> nn.Module:
    """One unit, freshly initialised (ElasWave seeds torch from the unit's name before calling this)."""
    if name == "conv1":
        return ConvBlock(1, 16, pool=False)  # (1, 8, 8) -> (16, 8, 8)
    if name == "conv2":
        return ConvBlock(16, 32, pool=True)  # (16, 8, 8) -> (32, 4, 4)
    if name == "mlp":
        return MLP(dropout)  # (32, 4, 4) -> (128,)
    if name == "head":
        return nn.Linear(128, 10)  # (128,) -> (10,) logits
    raise ValueError(f"unknown unit {name!r}")


def per_sample_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each sample: shape (batch,)."""
    return F.cross_entropy(logits, labels, reduction="none")


@torch.no_grad()
def accuracy(state_dict: Mapping[str, torch.Tensor], data: Digits) -> float:
    """Held-out accuracy of the model whose whole state dict (`"<unit>.<param>"`) is given."""
    x = data.images
    for name in UNITS:
        unit = build_unit(name)
        prefix = f"{name}."
        unit.load_state_dict({k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)})
        x = unit.eval()(x)
    return float((x.argmax(1) == data.labels).float().mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume", default=None)
    p.add_argument("--accuracy-out", default=None, help='write {"accuracy": x, "final_loss": y} JSON here')
    args = p.parse_args()

    t0 = time.perf_counter()
    result = elaswave.train(
        elaswave.Units(UNITS, lambda name: build_unit(name, args.dropout)),
        per_sample_loss,
        Digits(train=True),
        global_batch=args.global_batch,
        micro_batches=args.micro_batches,
        steps=args.steps,
        optimizer=elaswave.AdamW(
            lr=args.lr,
            weight_decay=0.05,
            no_decay=elaswave.no_decay_norms_and_biases,
            max_grad_norm=1.0,
            schedule=elaswave.warmup_cosine(warmup_steps=min(10, args.steps), total_steps=args.steps),
        ),
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        log_every=max(1, args.steps // 10),
    )
    seconds = time.perf_counter() - t0

    # The whole model: in this process (single process), or from the final checkpoint on the
    # one rank that committed it (under a launcher, when checkpoints are written); else skip.
    state = result.state_dict
    if state is None and result.checkpoints:
        state = elaswave.load_model_state(result.checkpoints[-1])
    if state is None:
        return
    acc = accuracy(state, Digits(train=False))
    final_loss = result.losses[max(result.losses)] if result.losses else None
    loss_text = f"final loss {final_loss:.4f}, " if final_loss is not None else ""
    print(
        f"trained steps {result.start_step}..{result.committed_steps - 1} in {seconds:.1f} s; {loss_text}"
        f"held-out accuracy {acc:.4f} ({HELD_OUT} images)",
        flush=True,
    )
    if args.accuracy_out:
        tmp = f"{args.accuracy_out}.tmp"
        with open(tmp, "w") as f:
            json.dump({"accuracy": acc, "final_loss": final_loss}, f)
        os.replace(tmp, args.accuracy_out)


if __name__ == "__main__":
    main()
