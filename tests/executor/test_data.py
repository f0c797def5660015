from __future__ import annotations

import pytest
import torch

from executor.data import GlobalBatchSampler, generate_corpus


def test_corpus_is_deterministic_and_structured() -> None:
    a, b = generate_corpus(64, 4096, seed=3), generate_corpus(64, 4096, seed=3)
    assert torch.equal(a, b)
    assert not torch.equal(a, generate_corpus(64, 4096, seed=4))
    assert a.dtype == torch.int64 and int(a.min()) >= 0 and int(a.max()) < 64
    # A sparse Markov chain: each token is followed by at most `successors` distinct tokens.
    followers: dict[int, set[int]] = {}
    for prev, nxt in zip(a[:-1].tolist(), a[1:].tolist(), strict=True):
        followers.setdefault(prev, set()).add(nxt)
    assert max(len(f) for f in followers.values()) <= 4


def test_any_split_of_a_step_reassembles_the_global_batch() -> None:
    sampler = GlobalBatchSampler(generate_corpus(64, 4096), seq_len=16, global_batch=8)
    whole = sampler.batch(5)
    assert whole.sample_ids == tuple(range(40, 48))
    for cuts in ([0, 3, 8], [0, 1, 2, 7, 8], [0, 8, 8]):
        parts = [GlobalBatchSampler(generate_corpus(64, 4096), 16, 8).rows(5, lo, hi)
                 for lo, hi in zip(cuts[:-1], cuts[1:], strict=True)]
        assert torch.equal(torch.cat([p.inputs for p in parts]), whole.inputs)
        assert torch.equal(torch.cat([p.targets for p in parts]), whole.targets)
        assert sum((p.sample_ids for p in parts), ()) == whole.sample_ids


def test_targets_are_inputs_shifted_and_steps_differ() -> None:
    sampler = GlobalBatchSampler(generate_corpus(64, 4096), seq_len=16, global_batch=4)
    b = sampler.batch(0)
    assert torch.equal(b.inputs[:, 1:], b.targets[:, :-1])
    assert not torch.equal(b.inputs, sampler.batch(1).inputs)
    # Replaying a step after others gives the same rows (rollback + replay).
    assert torch.equal(sampler.batch(0).inputs, b.inputs)


def test_epochs_cover_every_window_once() -> None:
    sampler = GlobalBatchSampler(generate_corpus(64, 16 * 12 + 1), seq_len=16, global_batch=4)
    assert sampler.num_windows == 12
    seen = {tuple(sampler.rows(s, r, r + 1).inputs[0].tolist()) for s in range(3) for r in range(4)}
    assert len(seen) == 12


def test_bad_requests_are_rejected() -> None:
    sampler = GlobalBatchSampler(generate_corpus(64, 1024), seq_len=16, global_batch=4)
    with pytest.raises(ValueError, match="outside the global batch"):
        sampler.rows(0, 2, 5)
    with pytest.raises(ValueError, match="longer than"):
        GlobalBatchSampler(torch.arange(10), seq_len=16, global_batch=4)
    with pytest.raises(ValueError, match="bad corpus"):
        generate_corpus(1, 100)
