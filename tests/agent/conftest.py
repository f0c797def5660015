"""Fixtures for agent tests (the harness itself is in ``harness.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.agent.harness import AgentProcess, RecordingCore


@pytest.fixture
def core() -> Iterator[RecordingCore]:
    server = RecordingCore().start()
    yield server
    server.close()


@pytest.fixture
def run_agent(tmp_path: Path) -> Iterator[Callable[..., AgentProcess]]:
    started: list[AgentProcess] = []

    def start(args: list[str], env: dict[str, str] | None = None) -> AgentProcess:
        agent = AgentProcess(args, tmp_path / f"agent{len(started)}.log", env)
        started.append(agent)
        return agent

    yield start
    for agent in started:
        agent.stop()
