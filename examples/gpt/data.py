"""The GPT example's corpus: a seeded sparse Markov chain over a small vocabulary (nothing to
download), served as a map-style `Dataset` of `(tokens, next tokens)` windows.

Each token has a handful of likely successors, so a small model can actually learn the stream
and the loss goes down. The corpus is a pure function of `(vocab_size, num_tokens, seed)`.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset


def generate_corpus(
    vocab_size: int = 64, num_tokens: int = 1 << 15, seed: int = 0, successors: int = 4
) -> torch.Tensor:
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


class MarkovWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Item i: window i of the corpus, as (tokens[0:seq_len], tokens[1:seq_len+1])."""

    def __init__(
        self, vocab_size: int = 64, seq_len: int = 16, num_tokens: int = 1 << 14, seed: int = 0
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self.corpus, self.seq_len = generate_corpus(vocab_size, num_tokens, seed), seq_len
        self.num_windows = (self.corpus.numel() - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(f"a corpus of {num_tokens} tokens has no window of {seq_len + 1}")

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.num_windows:
            raise IndexError(index)
        w = self.corpus[index * self.seq_len : index * self.seq_len + self.seq_len + 1]
        return w[:-1], w[1:]
