"""Engine tests: one torch thread in the pytest process, as in every rank process they spawn.

The in-process references and single-rank trainers run a tiny model whose ops gain nothing from
intra-op threads; on a small machine those threads only contend with the rank processes (and
with the data prefetch thread) for the same cores, which made a 10-step reference ~15x slower."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
