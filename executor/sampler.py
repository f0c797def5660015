"""A layout-independent sampler over any map-style dataset, with prefetch (docs/api.md, "Data").

The sampler defines the global batch of step `s` once for the whole job: row `j` of it is global
sample `s * B + j` (B = global batch). Global sample `g` is dataset index `perm_e[g mod N]` with
`e = g div N` (N = len(dataset)) and `perm_e` a seeded permutation of epoch `e` (the identity
with `shuffle=False`). So the job walks the dataset epoch after epoch, every sample once per
epoch; a global batch that straddles an epoch boundary takes its last rows from the next epoch
(no sample is dropped and no batch is short). Ranks ask for the rows of their own sample range,
so the batch a step sees never depends on the layout, on how many ranks share it, or on whether
the step is a replay after a rollback; the data position of a job is just its next step.

`Prefetcher` loads the rows a rank will need next while the current step computes (dataset
access and collation overlap compute; rows asked for that were not prefetched are loaded on the
spot): on one background thread by default, or with `workers > 0` in that many loader processes
(spawned, each holding its own copy of the dataset, so the dataset and `collate_fn` must be
picklable), for datasets whose `__getitem__` is CPU-heavy and would hold the GIL. The dataset
is never read from two threads at once. A dataset that draws random numbers (augmentation)
should draw them from its own `torch.Generator` (or run in loader processes): the loading thread
shares torch's global generator with the training thread, which re-seeds it before every unit's
forward (executor.rng.unit_call).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from executor.units import Activation

Collate = Callable[[list[Any]], Any]


@lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    # Cached and shared by the training thread and the prefetch thread (lru_cache is thread-safe).
    return np.random.Generator(np.random.PCG64([seed, epoch])).permutation(n)


@dataclass(frozen=True)
class SampleBatch:
    """Rows of one step's global batch: their global sample ids, inputs and targets (collated)."""

    sample_ids: tuple[int, ...]
    inputs: Activation | None
    targets: Any

    def __len__(self) -> int:
        return len(self.sample_ids)


def split_inputs_targets(batch: Any) -> tuple[Activation, Any]:
    """A collated batch must be `(inputs, targets)`; inputs a tensor or a tuple of tensors."""
    if not isinstance(batch, list | tuple) or len(batch) != 2:
        raise TypeError(
            "a collated batch must be a pair (inputs, targets): make the dataset return "
            f"(input, target) items or pass a collate_fn that does; got {type(batch).__name__}"
        )
    inputs, targets = batch
    if isinstance(inputs, list):
        inputs = tuple(inputs)
    items = inputs if isinstance(inputs, tuple) else (inputs,)
    if not items or not all(isinstance(t, torch.Tensor) for t in items):
        raise TypeError(
            f"the inputs of a batch must be a tensor or a tuple of tensors, got {type(inputs).__name__}"
        )
    return inputs, targets


class GlobalBatchSampler:
    """Global batch of step `s` = samples `s*B .. s*B+B-1`; see the module docstring."""

    def __init__(
        self,
        dataset: Dataset[Any],
        global_batch: int,
        seed: int = 0,
        shuffle: bool = True,
        collate_fn: Collate | None = None,
    ) -> None:
        try:
            n = len(dataset)  # type: ignore[arg-type]
        except TypeError as exc:
            raise TypeError(
                f"the dataset must be a map-style torch Dataset with __len__, got {type(dataset).__name__}"
            ) from exc
        if global_batch < 1:
            raise ValueError(f"global_batch must be positive, got {global_batch}")
        if n < global_batch:
            raise ValueError(
                f"the dataset has {n} samples, fewer than one global batch of {global_batch}: use a "
                "smaller global_batch or more data"
            )
        self.dataset, self.global_batch, self.seed, self.shuffle = dataset, global_batch, seed, shuffle
        self.collate = collate_fn or default_collate
        self.num_samples = n

    def sample_id(self, step: int, row: int) -> int:
        if step < 0 or not 0 <= row < self.global_batch:
            raise ValueError(f"no row {row} at step {step} (global batch {self.global_batch})")
        return step * self.global_batch + row

    def sample_ids(self, step: int, start: int, stop: int) -> tuple[int, ...]:
        if not 0 <= start <= stop <= self.global_batch:
            raise ValueError(f"rows [{start}, {stop}) outside the global batch of {self.global_batch}")
        return tuple(self.sample_id(step, r) for r in range(start, stop))

    def epoch_of_step(self, step: int) -> int:
        return step * self.global_batch // self.num_samples

    def dataset_index(self, sample_id: int) -> int:
        epoch, pos = divmod(sample_id, self.num_samples)
        if not self.shuffle:
            return pos
        return int(_permutation(self.seed, epoch, self.num_samples)[pos])

    def rows(self, step: int, start: int, stop: int) -> SampleBatch:
        """Rows `[start, stop)` of step `step`'s global batch, loaded and collated (may be empty)."""
        ids = self.sample_ids(step, start, stop)
        if not ids:
            return SampleBatch(ids, None, None)
        inputs, targets = load_items(self.dataset, self.collate, [self.dataset_index(i) for i in ids])
        return SampleBatch(ids, inputs, targets)


def load_items(dataset: Dataset[Any], collate: Collate, indices: Sequence[int]) -> tuple[Activation, Any]:
    """Dataset items `indices`, collated and split into (inputs, targets)."""
    return split_inputs_targets(collate([dataset[i] for i in indices]))


# A loader process's own copy of the dataset (set once by its initializer).
_loader_state: tuple[Dataset[Any], Collate] | None = None


def _init_loader(dataset: Dataset[Any], collate: Collate) -> None:
    import torch  # noqa: PLC0415 - the loader process computes nothing heavy: one thread is plenty

    torch.set_num_threads(1)
    global _loader_state
    _loader_state = (dataset, collate)


def _load_in_loader(indices: tuple[int, ...]) -> tuple[Activation, Any]:
    assert _loader_state is not None, "loader process started without its dataset"
    return load_items(*_loader_state, indices)


class Prefetcher:
    """Loads `GlobalBatchSampler.rows` ahead on one background thread (see the module docstring)."""

    def __init__(self, sampler: GlobalBatchSampler, workers: int = 0) -> None:
        if workers < 0:
            raise ValueError(f"loader_workers must be >= 0, got {workers}")
        self.sampler, self.workers = sampler, workers
        self._pool: Executor
        if workers:
            # spawn, not fork: the training process already runs gloo and OpenMP threads.
            self._pool = ProcessPoolExecutor(
                workers,
                multiprocessing.get_context("spawn"),
                _init_loader,
                (sampler.dataset, sampler.collate),
            )
        else:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="elaswave-data")
        self._pending: dict[tuple[int, int, int], Future[SampleBatch]] = {}

    def _submit(self, step: int, start: int, stop: int) -> Future[SampleBatch]:
        if not self.workers:
            return self._pool.submit(self.sampler.rows, step, start, stop)
        ids = self.sampler.sample_ids(step, start, stop)
        loaded = self._pool.submit(_load_in_loader, tuple(self.sampler.dataset_index(i) for i in ids))
        batch: Future[SampleBatch] = Future()

        def done(f: Future[tuple[Activation, Any]]) -> None:
            # Claim `batch` first: `prefetch` and `close` cancel it from the training thread while
            # the load runs, and setting a cancelled future raises in the pool's thread (which,
            # logging it, raced CPython 3.11's ast module: a later ast.parse raised SystemError).
            if not batch.set_running_or_notify_cancel():
                return  # dropped: nobody waits for it
            if f.cancelled():
                batch.set_exception(CancelledError("the loader pool shut down before loading these rows"))
            elif f.exception() is not None:
                batch.set_exception(f.exception())
            else:
                batch.set_result(SampleBatch(ids, *f.result()))

        loaded.add_done_callback(done)
        batch.add_done_callback(lambda b: loaded.cancel() if b.cancelled() else None)  # not started: skip it
        return batch

    def prefetch(self, step: int, ranges: Sequence[tuple[int, int]]) -> None:
        """Start loading these row ranges of `step` (drops what was prefetched for older steps)."""
        for key in [k for k in self._pending if k[0] < step]:
            self._pending.pop(key).cancel()
        for start, stop in ranges:
            key = (step, start, stop)
            if stop > start and key not in self._pending:
                self._pending[key] = self._submit(step, start, stop)

    def rows(self, step: int, start: int, stop: int) -> SampleBatch:
        """The rows, from the prefetched load if there is one (blocks until it is done)."""
        pending = self._pending.pop((step, start, stop), None)
        if pending is None and stop > start:
            # Through the same loader even on a miss: the dataset is only ever read by one thread
            # (or the loader processes), never concurrently from the training thread.
            pending = self._submit(step, start, stop)
        return pending.result() if pending is not None else self.sampler.rows(step, start, stop)

    def close(self) -> None:
        for fut in self._pending.values():
            fut.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
