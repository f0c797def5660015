"""The layout-independent sampler over a map-style dataset (executor.sampler) and the GPT example's
Markov corpus (examples/gpt/data.py)."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from examples.gpt.data import TABLE_DRAW_LIMIT, MarkovWindows, generate_corpus
from executor.sampler import GlobalBatchSampler, Prefetcher, SampleBatch


class Numbers(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Item i is (tensor([i, i]), tensor(-i)): the dataset index can be read off every row."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.reads: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        self.reads.append(i)
        return torch.tensor([i, i]), torch.tensor(-i)


def _tensor_inputs(batch: SampleBatch) -> torch.Tensor:
    """The inputs of a batch whose inputs are a single tensor (not a tuple)."""
    assert isinstance(batch.inputs, torch.Tensor)
    return batch.inputs


def _indices(sampler: GlobalBatchSampler, step: int, start: int = 0, stop: int | None = None) -> list[int]:
    batch = sampler.rows(step, start, sampler.global_batch if stop is None else stop)
    assert isinstance(batch.inputs, torch.Tensor)
    assert torch.equal(batch.targets, -batch.inputs[:, 0])
    return batch.inputs[:, 0].tolist()


def test_each_epoch_is_a_seeded_permutation_of_the_dataset() -> None:
    sampler = GlobalBatchSampler(Numbers(12), global_batch=4, seed=5)
    epoch0 = [i for s in range(3) for i in _indices(sampler, s)]
    epoch1 = [i for s in range(3, 6) for i in _indices(sampler, s)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(12))  # every sample once per epoch
    assert epoch0 != list(range(12)) and epoch0 != epoch1  # shuffled, and differently each epoch
    assert [sampler.epoch_of_step(s) for s in range(7)] == [0, 0, 0, 1, 1, 1, 2]
    # A pure function of (seed, global sample id): another sampler of the same seed agrees, another seed does not.
    again = GlobalBatchSampler(Numbers(12), global_batch=4, seed=5)
    assert [i for s in range(6) for i in _indices(again, s)] == epoch0 + epoch1
    other = GlobalBatchSampler(Numbers(12), global_batch=4, seed=6)
    assert [i for s in range(3) for i in _indices(other, s)] != epoch0


def test_a_batch_that_crosses_an_epoch_takes_its_last_rows_from_the_next_epoch() -> None:
    sampler = GlobalBatchSampler(Numbers(10), global_batch=4, seed=1)
    assert sampler.sample_ids(2, 0, 4) == (8, 9, 10, 11)  # samples 8, 9 of epoch 0; 0, 1 of epoch 1
    rows = _indices(sampler, 2)
    assert rows[:2] == [sampler.dataset_index(8), sampler.dataset_index(9)]
    assert rows[2:] == [sampler.dataset_index(10), sampler.dataset_index(11)]
    flat = [i for s in range(5) for i in _indices(sampler, s)]  # 20 samples = exactly two epochs
    assert sorted(flat[:10]) == sorted(flat[10:]) == list(range(10))
    assert all(len(sampler.rows(s, 0, 4)) == 4 for s in range(5))  # no short batch, nothing dropped


def test_shuffle_off_walks_the_dataset_in_order() -> None:
    sampler = GlobalBatchSampler(Numbers(6), global_batch=4, shuffle=False)
    assert [i for s in range(3) for i in _indices(sampler, s)] == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]


def test_any_split_of_a_step_reassembles_the_global_batch() -> None:
    sampler = GlobalBatchSampler(Numbers(50), global_batch=8, seed=3)
    whole = sampler.rows(5, 0, 8)
    assert whole.sample_ids == tuple(range(40, 48))
    for cuts in ([0, 3, 8], [0, 1, 2, 7, 8], [0, 8, 8]):
        fresh = GlobalBatchSampler(Numbers(50), global_batch=8, seed=3)  # another rank, another process
        parts = [fresh.rows(5, lo, hi) for lo, hi in zip(cuts[:-1], cuts[1:], strict=True)]
        parts = [p for p in parts if len(p)]
        assert torch.equal(torch.cat([_tensor_inputs(p) for p in parts]), _tensor_inputs(whole))
        assert torch.equal(torch.cat([p.targets for p in parts]), whole.targets)
        assert sum((p.sample_ids for p in parts), ()) == whole.sample_ids
    empty = sampler.rows(5, 3, 3)
    assert len(empty) == 0 and empty.inputs is None
    # Replaying a step after others gives the same rows (rollback + replay).
    sampler.rows(6, 0, 8)
    assert torch.equal(_tensor_inputs(sampler.rows(5, 0, 8)), _tensor_inputs(whole))


def test_tuple_inputs_and_a_custom_collate() -> None:
    class Pairs(Dataset[tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]]):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
            return (torch.tensor([float(i)]), torch.tensor([i])), torch.tensor(i)

    batch = GlobalBatchSampler(Pairs(), 2, shuffle=False).rows(0, 0, 2)
    assert isinstance(batch.inputs, tuple) and len(batch.inputs) == 2
    assert batch.inputs[1].dtype == torch.int64 and batch.inputs[1][:, 0].tolist() == [0, 1]

    def collate(items: list) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack([x[0][0] for x in items]) * 10, torch.stack([x[1] for x in items])

    batch = GlobalBatchSampler(Pairs(), 2, shuffle=False, collate_fn=collate).rows(1, 0, 2)
    assert _tensor_inputs(batch).tolist() == [[20.0], [30.0]]


def test_prefetched_rows_equal_rows_loaded_on_the_spot() -> None:
    data = Numbers(30)
    sampler = GlobalBatchSampler(data, global_batch=6, seed=2)
    pre = Prefetcher(sampler)
    try:
        pre.prefetch(1, [(0, 3), (3, 6)])
        asked = [(1, 0, 3), (1, 3, 6)]
        pre.prefetch(2, [(0, 6)])
        pre.prefetch(3, [(0, 2)])  # drops what is left of step 2: loaded on the spot when asked for
        asked += [(2, 0, 6), (3, 0, 2), (3, 1, 4)]  # (3, 1, 4) was never prefetched
        for step, lo, hi in asked:
            got, direct = pre.rows(step, lo, hi), sampler.rows(step, lo, hi)
            assert got.sample_ids == direct.sample_ids and torch.equal(
                _tensor_inputs(got), _tensor_inputs(direct)
            )
    finally:
        pre.close()


class SlowNumbers(Numbers):
    """`Numbers` that takes `delay_s` per item: a load is still running when its step is dropped."""

    def __init__(self, n: int, delay_s: float) -> None:
        super().__init__(n)
        self.delay_s = delay_s

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay_s)
        return super().__getitem__(i)


@pytest.mark.timeout(60)
def test_a_load_dropped_while_a_loader_process_runs_it_is_let_go_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Steps 1 and 2 are prefetched, then dropped while step 1's load runs in the loader process
    # (it finishes into a cancelled future) and step 2's waits in the queue (it never runs).
    sampler = GlobalBatchSampler(SlowNumbers(30, delay_s=0.2), global_batch=3, seed=4)
    pre = Prefetcher(sampler, workers=1)
    try:
        assert len(pre.rows(0, 0, 1).sample_ids) == 1  # the loader process is up
        pre.prefetch(1, [(0, 3)])
        pre.prefetch(2, [(0, 3)])
        time.sleep(0.2)
        with caplog.at_level(logging.ERROR, logger="concurrent.futures"):
            pre.prefetch(3, [(0, 3)])
            got, direct = pre.rows(3, 0, 3), sampler.rows(3, 0, 3)
            assert got.sample_ids == direct.sample_ids and torch.equal(
                _tensor_inputs(got), _tensor_inputs(direct)
            )
        assert not [r for r in caplog.records if r.name.startswith("concurrent.futures")]
        # the same answer for rows asked again, loaded on the spot through the loader
        assert pre.rows(1, 0, 3).sample_ids == sampler.rows(1, 0, 3).sample_ids
    finally:
        pre.close()


def test_bad_datasets_and_requests_are_refused() -> None:
    with pytest.raises(ValueError, match="fewer than one global batch of 8"):
        GlobalBatchSampler(Numbers(7), global_batch=8)
    with pytest.raises(ValueError, match="global_batch must be positive"):
        GlobalBatchSampler(Numbers(7), global_batch=0)

    class Stream(Dataset[int]):  # no __len__: an iterable-style source
        def __getitem__(self, i: int) -> int:
            return i

    with pytest.raises(TypeError, match="map-style"):
        GlobalBatchSampler(Stream(), global_batch=2)
    sampler = GlobalBatchSampler(Numbers(8), global_batch=4)
    with pytest.raises(ValueError, match="outside the global batch"):
        sampler.rows(0, 2, 5)
    with pytest.raises(ValueError, match="no row"):
        sampler.sample_id(-1, 0)

    class NoTargets(Dataset[torch.Tensor]):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.zeros(3)

    with pytest.raises(TypeError, match=r"pair \(inputs, targets\)"):
        GlobalBatchSampler(NoTargets(), global_batch=2).rows(0, 0, 2)


def test_sampler_reads_only_the_rows_asked_for() -> None:
    data = Numbers(40)
    sampler = GlobalBatchSampler(data, global_batch=8)
    sampler.rows(3, 2, 5)
    assert sorted(data.reads) == sorted(sampler.dataset_index(i) for i in (26, 27, 28))


# ------------------------------------------------------------------ the GPT example's corpus


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


def test_a_large_vocabulary_corpus_walks_the_same_chain_one_draw_per_token() -> None:
    """Past TABLE_DRAW_LIMIT (make gpu-check (d)'s 32k vocabulary and 1 M tokens needed 256 GB
    the original way) the walk draws once per token: every step goes to one of its
    predecessor's successors, as often as the chain's weights say."""
    vocab, tokens, successors = 256, TABLE_DRAW_LIMIT // 256 + 1, 4
    corpus = generate_corpus(vocab, tokens, seed=5, successors=successors)
    assert torch.equal(corpus, generate_corpus(vocab, tokens, seed=5, successors=successors))
    rng = np.random.Generator(np.random.PCG64(5))  # the chain generate_corpus draws first
    nexts = np.stack([rng.choice(vocab, size=successors, replace=False) for _ in range(vocab)])
    weights = rng.dirichlet(np.ones(successors), size=vocab)
    prev, nxt = corpus[:-1].numpy(), corpus[1:].numpy()
    counts = np.zeros((vocab, successors))
    for k in range(successors):
        taken = nxt == nexts[prev, k]
        np.add.at(counts, (prev[taken], k), 1)
    assert counts.sum() == tokens - 1
    visits = counts.sum(axis=1)
    seen = visits > 500  # sampling error of a frequency below 0.023 there
    assert seen.sum() >= 20
    assert np.abs(counts[seen] / visits[seen, None] - weights[seen]).max() < 0.08


def test_markov_windows_are_next_token_pairs_covering_the_corpus() -> None:
    data = MarkovWindows(64, seq_len=16, num_tokens=16 * 12 + 1, seed=0)
    assert len(data) == 12
    x, y = data[3]
    assert torch.equal(x[1:], y[:-1]) and x.shape == y.shape == (16,)
    assert torch.equal(torch.cat([data[i][0] for i in range(12)]), data.corpus[:-1])
    sampler = GlobalBatchSampler(data, global_batch=4)
    seen = {tuple(_tensor_inputs(sampler.rows(s, r, r + 1))[0].tolist()) for s in range(3) for r in range(4)}
    assert len(seen) == 12  # one epoch: every window once
    with pytest.raises(IndexError):
        data[12]
    with pytest.raises(ValueError, match="no window"):
        MarkovWindows(64, seq_len=16, num_tokens=10)
    with pytest.raises(ValueError, match="bad corpus"):
        generate_corpus(1, 100)
