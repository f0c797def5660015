"""The GPT example's corpus: a seeded sparse Markov chain over a small vocabulary (nothing to
download), served as a map-style `Dataset` of `(tokens, next tokens)` windows.

Each token has a handful of likely successors, so a small model can actually learn the stream
and the loss goes down. The corpus is a pure function of `(vocab_size, num_tokens, seed)`.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch
from torch.utils.data import Dataset

# The largest vocab_size * num_tokens drawn the original way (one row of draws per vocabulary
# entry, 8 bytes each: 128 MB). Every corpus up to it is the one earlier runs and the tests used.
TABLE_DRAW_LIMIT = 1 << 24


def generate_corpus(
    vocab_size: int = 64, num_tokens: int = 1 << 15, seed: int = 0, successors: int = 4
) -> torch.Tensor:
    """Token stream (int64) of a seeded sparse Markov chain; deterministic across platforms."""
    if vocab_size < 2 or num_tokens < 2 or not 1 <= successors <= vocab_size:
        raise ValueError(f"bad corpus spec: vocab={vocab_size}, tokens={num_tokens}, successors={successors}")
    rng = np.random.Generator(np.random.PCG64(seed))
    nexts = np.stack([rng.choice(vocab_size, size=successors, replace=False) for _ in range(vocab_size)])
    weights = rng.dirichlet(np.ones(successors), size=vocab_size)
    if vocab_size * num_tokens <= TABLE_DRAW_LIMIT:
        return _walk_table(rng, nexts, weights, num_tokens)
    return _walk_per_token(rng, nexts, weights, num_tokens)


def _walk_table(
    rng: np.random.Generator, nexts: np.ndarray, weights: np.ndarray, num_tokens: int
) -> torch.Tensor:
    """The original walk: a row of `num_tokens` successor draws per vocabulary entry, memory
    O(vocab_size * num_tokens) (a 32k vocabulary and 1 M tokens would need 256 GB)."""
    vocab_size, successors = nexts.shape
    choices = np.stack([rng.choice(successors, size=num_tokens, p=weights[v]) for v in range(vocab_size)])
    tokens = np.empty(num_tokens, dtype=np.int64)
    tokens[0] = rng.integers(vocab_size)
    for i in range(1, num_tokens):
        prev = tokens[i - 1]
        tokens[i] = nexts[prev, choices[prev, i]]
    return torch.from_numpy(tokens)


def _walk_per_token(
    rng: np.random.Generator, nexts: np.ndarray, weights: np.ndarray, num_tokens: int
) -> torch.Tensor:
    """The same chain with one uniform draw per token, picking among its predecessor's
    successors by their cumulative weights: O(num_tokens + vocab_size * successors) memory (a
    32k vocabulary and 1 M tokens take 4 s on 2 slow cores)."""
    vocab_size, successors = nexts.shape
    cumulative = np.cumsum(weights, axis=1).tolist()
    draws = rng.random(num_tokens).tolist()
    successor_rows = nexts.tolist()
    tokens = [int(rng.integers(vocab_size))]
    for i in range(1, num_tokens):
        prev = tokens[-1]
        tokens.append(
            successor_rows[prev][min(bisect.bisect_right(cumulative[prev], draws[i]), successors - 1)]
        )
    return torch.tensor(tokens, dtype=torch.int64)


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
