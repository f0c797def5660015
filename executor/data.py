"""A built-in corpus and a layout-independent sampler (nothing is downloaded).

The corpus is generated in code: a fixed random "grammar" — a sparse first-order Markov chain
over the vocabulary, each token having a handful of likely successors — so a small model can
actually learn it and the loss curve goes down. It is a pure function of `(vocab_size,
num_tokens, seed)`.

The sampler defines the global batch of step `s` once for the whole job: row `j` of it is global
sample `s * B + j` (B = global batch), a window of the corpus picked by a per-epoch permutation.
Ranks ask for the rows of their own sample range, so the batch a step sees never depends on the
layout, on how many ranks share it, or on whether the step is a replay after a rollback.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def generate_corpus(vocab_size: int = 64, num_tokens: int = 1 << 15, seed: int = 0,
                    successors: int = 4) -> torch.Tensor:
    """Token stream (int64) of a seeded sparse Markov chain; deterministic across platforms."""
    if vocab_size < 2 or num_tokens < 2 or not 1 <= successors <= vocab_size:
        raise ValueError(f"bad corpus spec: vocab={vocab_size}, tokens={num_tokens}, successors={successors}")
    rng = np.random.Generator(np.random.PCG64(seed))
    nexts = np.stack([rng.choice(vocab_size, size=successors, replace=False) for _ in range(vocab_size)])
    weights = rng.dirichlet(np.ones(successors), size=vocab_size)
    choices = np.stack([rng.choice(successors, size=num_tokens, p=weights[v]) for v in range(vocab_size)])
    tokens = np.empty(num_tokens, dtype=np.int64)
    tokens[0] = rng.integers(vocab_size)
    for i in range(1, num_tokens):
        prev = tokens[i - 1]
        tokens[i] = nexts[prev, choices[prev, i]]
    return torch.from_numpy(tokens)


@dataclass(frozen=True)
class SampleBatch:
    """Rows of one step's global batch: their global sample ids, inputs and next-token targets."""

    sample_ids: tuple[int, ...]
    inputs: torch.Tensor
    targets: torch.Tensor

    def __len__(self) -> int:
        return len(self.sample_ids)


class GlobalBatchSampler:
    """Global batch of step `s` = samples `s*B .. s*B+B-1`; see the module docstring."""

    def __init__(self, corpus: torch.Tensor, seq_len: int, global_batch: int, seed: int = 0) -> None:
        if corpus.dim() != 1 or corpus.numel() < seq_len + 2:
            raise ValueError(f"corpus must be a 1-D token stream longer than seq_len+1={seq_len + 1}")
        if global_batch < 1 or seq_len < 1:
            raise ValueError(f"global_batch and seq_len must be positive, got {global_batch}, {seq_len}")
        self.corpus, self.seq_len, self.global_batch, self.seed = corpus, seq_len, global_batch, seed
        self.num_windows = (corpus.numel() - 1) // seq_len
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def sample_id(self, step: int, row: int) -> int:
        if step < 0 or not 0 <= row < self.global_batch:
            raise ValueError(f"no row {row} at step {step} (global batch {self.global_batch})")
        return step * self.global_batch + row

    def _window(self, sample_id: int) -> int:
        epoch, pos = divmod(sample_id, self.num_windows)
        if epoch != self._perm_epoch:
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._perm, self._perm_epoch = rng.permutation(self.num_windows), epoch
        return int(self._perm[pos])

    def rows(self, step: int, start: int, stop: int) -> SampleBatch:
        """Rows `[start, stop)` of step `step`'s global batch (may be empty)."""
        if not 0 <= start <= stop <= self.global_batch:
            raise ValueError(f"rows [{start}, {stop}) outside the global batch of {self.global_batch}")
        ids = tuple(self.sample_id(step, r) for r in range(start, stop))
        if not ids:
            empty = torch.empty(0, self.seq_len, dtype=torch.int64)
            return SampleBatch(ids, empty, empty.clone())
        windows = torch.stack([self.corpus[w * self.seq_len: w * self.seq_len + self.seq_len + 1]
                               for w in (self._window(i) for i in ids)])
        return SampleBatch(ids, windows[:, :-1].contiguous(), windows[:, 1:].contiguous())

    def batch(self, step: int) -> SampleBatch:
        return self.rows(step, 0, self.global_batch)
